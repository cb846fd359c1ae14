"""Page summaries of one ragged layer, for a press with a ``reader`` (:mod:`kvpress_ada.readers`).

A :class:`~.ragged_cache.RaggedLayer` that reads sparsely holds, beside its flat buffers, each page's channel-wise
key ``kmin, kmax`` (:mod:`kvpress_ada.kernels.ragged.sparse`) and the page table of its rows. They are rebuilt
whenever the layer is laid out anew (compression, decode compaction, crop), moved with their rows when the layer
grows (the entries move unchanged, so the summaries do not depend on when the buffers grew) and updated in place
by every append (one custom op, no host sync, so the compiled decode step keeps them current). A decode step (one
query per row) scores every page with its bound, asks the reader which pages each kv head reads, and attends over
those (:func:`~kvpress_ada.kernels.ragged.sparse.sparse_ragged_attention`). The summaries are 16-bit
(:func:`~kvpress_ada.kernels.ragged.sparse.summary_dtype`: a 16-bit cache's dtype, float16 rounded outward for
float32 keys), so ``nbytes`` counts ``2 * D * 2 / page_size`` bytes per slot, plus 8 bytes per page of the table.
Over quantized storage (int8, int4, fp8) the summaries cover what each key reads back as (its record, and while it
is among its row's newest the residual ring's full-precision copy; the anchor): float32 read-backs rounded outward
to float16, so the bound holds for the logits attention computes; records written after the append that put a key
in the ring are folded in when written.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.ragged.reference import CHUNK
from ...kernels.ragged.sparse import append_summaries, page_summaries, page_table, sparse_ragged_attention
from ...readers import select_pages


def check_page_size(reader: Any) -> None:
    """Refuse, in one line, a reader whose pages would straddle two rows of the ragged layout (rows start on
    :data:`~kvpress_ada.kernels.ragged.reference.CHUNK` boundaries)."""
    P = int(reader.page_size)
    if P < 1 or CHUNK % P:
        raise ValueError(f"reader page_size={P} must divide the ragged cache's row alignment ({CHUNK} entries): "
                         f"use one of {[d for d in range(1, CHUNK + 1) if CHUNK % d == 0]}")


class PageSummaries:
    """The summaries of one compressed layer's pages and what a decode step reads with them."""

    def __init__(self, reader: Any):
        check_page_size(reader)
        self.reader = reader
        self.size = int(reader.page_size)
        self.kmin = self.kmax = torch.empty(0, dtype=torch.float16)  # 16-bit: see summary_dtype
        self.table = torch.empty(0, 0, dtype=torch.long)

    def rebuild(self, keys: tuple[torch.Tensor, ...], row_offsets: torch.Tensor, row_lengths: torch.Tensor) -> None:
        """Summaries of every page of the layout (eager: at each layout, crop or compaction) over ``keys``:
        one ``[N, D]`` tensor of what each slot's key reads as, or several whose union each summary covers (a slot
        of quantized storage reads as its record, or from the residual ring while it is among the newest)."""
        with torch.inference_mode(False):  # normal tensors, as the flat buffers (RaggedLayer._layout)
            self.kmin, self.kmax = page_summaries(keys[0], row_offsets, row_lengths, self.size)
            for more in keys[1:]:
                kmin, kmax = page_summaries(more, row_offsets, row_lengths, self.size)
                self.kmin, self.kmax = torch.minimum(self.kmin, kmin), torch.maximum(self.kmax, kmax)
            self.table = page_table(row_offsets, keys[0].shape[0], self.size)
        self._mark()

    def move(self, old_offsets: torch.Tensor, row_offsets: torch.Tensor, row_lengths: torch.Tensor,
             n_slots: int) -> None:
        """The summaries of every row's pages moved with the row to ``row_offsets`` in a layout of ``n_slots`` slots
        (a re-layout that moves the entries unchanged, :meth:`~.ragged_cache.RaggedLayer._grow`): each page keeps
        what it covered, so the summaries do not depend on when the buffers grew."""
        P = self.size
        pages = (row_lengths.long() + P - 1) // P
        j = torch.arange(int(pages.max()) if pages.numel() else 0, device=pages.device)
        held = j < pages[:, None]
        src = (old_offsets.long()[:, None] // P + j)[held]
        dst = (row_offsets.long()[:, None] // P + j)[held]
        with torch.inference_mode(False):
            kmin = self.kmin.new_full((n_slots // P, self.kmin.shape[-1]), float("inf"))
            kmax = self.kmax.new_full((n_slots // P, self.kmax.shape[-1]), float("-inf"))
            kmin[dst], kmax[dst] = self.kmin[src], self.kmax[src]
            self.kmin, self.kmax = kmin, kmax
            self.table = page_table(row_offsets, n_slots, P)
        self._mark()

    def _mark(self) -> None:
        if torch.compiler.is_compiling():
            return
        for t in (self.kmin, self.kmax):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(self.table, 1)
        if self.kmin.device.type == "cuda":
            for t in (self.kmin, self.kmax, self.table):
                torch._dynamo.mark_static_address(t)

    def append(self, keys: torch.Tensor, row_offsets: torch.Tensor, row_lengths: torch.Tensor) -> None:
        """Fold the keys ``[B, H_kv, Q, D]`` just appended (``row_lengths`` counts them) into their pages."""
        append_summaries(keys, self.kmin, self.kmax, row_offsets, row_lengths, self.size)

    def select(self, query: torch.Tensor, row_lengths: torch.Tensor, scaling: float, layer_idx: int,
               softcap: float | None = None) -> torch.Tensor:
        """``[R, W]`` bool: the pages of each row the reader reads for ``query [B, H_q, 1, D]``."""
        return select_pages(self.reader, query, self.kmin, self.kmax, self.table, row_lengths, scaling, layer_idx,
                            softcap).reshape(self.table.shape)

    def attention(self, query: torch.Tensor, selected: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                  row_offsets: torch.Tensor, row_lengths: torch.Tensor, scaling: float, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H_q, Q, D]`` attention of ``query`` over the ``selected`` pages (:meth:`select`)."""
        return sparse_ragged_attention(query, k_flat, v_flat, row_offsets, row_lengths, self.table, selected,
                                       self.size, scaling, softcap=softcap, sinks=sinks)

    def read(self, selected: torch.Tensor, row_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(entries, summary_bytes)`` int64 ``[R]``: what a step that selected ``selected [R, W]`` reads of each row,
        the entries its selected pages hold (a partial page: its entries; a page past them: none), and the bytes
        of the summaries it scored: ``kmin, kmax`` (16-bit) of every page holding an entry (a free page of the row's
        reserve bounds at ``-inf`` and is not counted). Device ops, no host sync."""
        P = self.size
        lengths = row_lengths.long()
        start = torch.arange(selected.shape[-1], device=lengths.device) * P
        held = (lengths[:, None] - start).clamp(min=0, max=P)  # entries page j of each row holds
        entries = (held * selected).sum(-1)
        per_page = self.kmin.shape[-1] * (self.kmin.element_size() + self.kmax.element_size())
        return entries, (lengths + P - 1) // P * per_page

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kmin, self.kmax, self.table))

    def batch_nbytes(self, batch: int) -> list[int]:
        """Bytes per batch row (its rows' pages and table rows; every row is laid out on its own)."""
        if not self.table.numel():
            return [0] * batch
        pages = (self.table >= 0).sum(-1).view(batch, -1).sum(-1)  # pages of each batch row's rows
        per_page = self.kmin[0].nbytes + self.kmax[0].nbytes if self.kmin.numel() else 0
        table_row = self.table[0].nbytes * (self.table.shape[0] // batch)
        return [int(n) * per_page + table_row for n in pages.tolist()]
