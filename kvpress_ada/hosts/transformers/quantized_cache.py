"""QuantizedRaggedCache: the ragged cache with its kept entries stored as records of a storage kind's layout
(int8, int4, fp8, or a registered kind's :class:`~kvpress_ada.kernels.quantized.scheme.RecordLayout`).

A layer is a :class:`~.ragged_cache.RaggedLayer` (same rows, offsets, reserve, re-layout, crop, compiled
decode step) whose slots hold one ``uint8`` record per token instead of ``head_dim`` floats: the
elements with the token's scales (and zero points) (:mod:`kvpress_ada.kernels.quantized.scheme`), plus, per row,
``side [3 + 2 * residual, rows, D]`` in the entries' dtype: the row's anchor (its first entry, key and
value, kept in full precision), its key centre (a layout that rotates keys stores them centred and rotated) and,
with a
``residual``, its newest entries in full precision (a ring beside their records). The dense prefill stays
in full precision until the layer is compressed, so selection reads full-precision entries; compression fixes
each row's side tensors and quantizes the kept entries, a decode token is quantized when it is appended
(with its row's centre; an eager append's records are written in batches before its tokens leave the
residual ring: :meth:`QuantizedRaggedLayer._append_entries`), and attention dequantizes the rows as it reads
them.
:meth:`~.ragged_cache.RaggedLayer.view` gives the dequantized entries (the anchor exactly: what a later
selection, a decode compaction or the next chunk of a chunked prefill reads: what is stored), and keeping
part of a compressed layer moves the kept records as they are (never quantized twice; centres unchanged; a
row whose anchor is dropped takes its new first entry's read-back value as anchor; each row's residual is
refilled from what its newest kept entries read back as: kept residual entries stay exact, and the same
after a crop). ``nbytes()`` counts the records, scales and zero points included, and the side tensors
(the residual included). Every record operation takes the layer's ``layout``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ... import kernels
from ...kernels.quantized.scheme import (
    RecordLayout,
    append_side,
    decode_keys,
    dequantize,
    fill_residual,
    record_newest,
    record_width,
    row_anchors,
    side_slots,
)
from ...kernels.ragged.sparse import sparse_quantized_attention
from ...storage import Storage
from .entries import gather_slots, ragged_index
from .press_cache import HeldEntries
from .ragged_cache import RaggedCache, RaggedLayer, register_ragged_cache


class QuantizedRaggedLayer(RaggedLayer):
    """One layer of a :class:`QuantizedRaggedCache`: records of ``layout``, and each row's ``side`` tensors
    (anchor key, anchor value, key centre, then its newest ``layout.residual`` entries' keys and values, a ring:
    :func:`~kvpress_ada.kernels.quantized.scheme.residual_of`)."""

    defer_appends: ClassVar[bool] = True
    """Whether eager appends write their records in batches (see :meth:`_append_entries`)."""
    rewrites_kept_keys = False  # a compressed layer's kept records move unchanged

    def __init__(self, layout: RecordLayout, decode_reserve: int = 8, growth: float = 0.125):
        if not isinstance(layout, RecordLayout):
            raise TypeError(f"layout must be a RecordLayout (a storage kind's layout), got {layout!r}")
        super().__init__(decode_reserve, growth)
        self.layout, self.residual = layout, layout.residual

    def _clear(self) -> None:
        super()._clear()
        self.side = torch.empty(0)
        self._unrecorded = 0  # each row's newest entries whose records may not be written yet (all in the ring)

    def reserve(self, q: int) -> None:
        """As :meth:`RaggedLayer.reserve`; first writes the pending records of entries the next ``q`` tokens
        would push out of the residual ring (see :meth:`_append_entries`)."""
        if self._unrecorded + q > self.residual:
            self._record_pending()
        super().reserve(q)
        if q <= self.residual:
            self._unrecorded += q  # written now by a compiled step, or later by _record_pending

    def _record_pending(self) -> None:
        """Write the records of the appended entries that have none yet (a no-op when none is pending)."""
        if self._unrecorded:
            record_newest(self.k_flat, self.v_flat, self.row_offsets, self.row_lengths, self.side,
                          self._unrecorded, self.layout)
            self._summarise_newest(self._unrecorded)
            self._unrecorded = 0

    def _empty_slots(self, total: int) -> torch.Tensor:
        width = record_width(self.head_dim, self.layout, self.dtype)
        return torch.zeros(total, width, dtype=torch.uint8, device=self.device)

    def _compact_entries(self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> None:
        if keys.dtype == torch.uint8:  # records of this layer (see retain): moved as they are
            kernels.compact_ref(keys, values, keep, self.row_offsets, self.k_flat, self.v_flat)
            return
        self._unrecorded = 0
        B, H, _ = self.shape
        with torch.inference_mode(False):  # a normal tensor, as the flat buffers (see RaggedLayer._layout)
            self.side = torch.zeros(3 + 2 * self.residual, B * H, self.head_dim, dtype=self.dtype,
                                    device=self.device)
        if self.side.device.type == "cuda" and not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.side)  # mutated in place by appends (see _mark_for_compile)
        kernels.quantized_compact(keys, values, keep, self.row_offsets, self.k_flat, self.v_flat, self.side,
                                  self.layout)

    def _append_entries(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Eager appends of at most ``residual`` tokens are deferred: the tokens go into the residual ring
        (what every read of a row's newest entries uses) and their records are written in one batch by
        :meth:`reserve` before they would leave it, or before anything moves records (KIVI's grouped
        quantization of the residual; the records are those an immediate append writes). A compiled step
        defers too (its caller reserved it, outside the graph): through a custom op that checks every row for
        emptiness on the device. A longer append, no residual or ``defer_appends = False`` quantizes at once."""
        Q = keys.shape[-2]
        if self.defer_appends and Q <= self.residual:
            if torch.compiler.is_compiling():
                kernels.quantized_append_side(keys, values, self.row_lengths, self.side)
                return
            empty = min(self._base, default=0) + self._appended - Q <= 0  # _appended counts these Q already
            append_side(keys, values, self.row_lengths, self.side, empty_rows=empty)
            return
        kernels.quantized_append(keys, values, self.k_flat, self.v_flat, self.row_offsets, self.row_lengths,
                                 self.side, self.layout)
        self._summarise_newest(Q)

    # ------------------------------------------------------------ page summaries (sparse reads)
    def _page_keys(self) -> tuple[torch.Tensor, ...]:
        """float32 ``[N, D]`` twice: each slot's key read back from its record, then the same with each row's
        newest entries read from its residual ring (each row's first slot reads as its anchor in both): a ring
        entry reads as its full-precision copy now and as its record once it leaves the ring, so the summaries
        cover both."""
        N, D = self.k_flat.shape[0], self.head_dim
        offs = self.row_offsets.long()
        row = (torch.searchsorted(offs, torch.arange(N, device=offs.device), right=True) - 1).clamp(min=0)
        recorded = torch.zeros(N + 1, D, dtype=torch.float32, device=offs.device)  # slot N: where free ones go
        recorded[:N] = decode_keys(self.k_flat, self.side[2].index_select(0, row), D, self.layout, self.dtype,
                                   torch.float32)
        slots = side_slots(self.row_offsets, self.row_lengths, self.residual, N)  # [1 + residual, rows]
        recorded.index_copy_(0, slots[0], self.side[0].float())  # the anchors
        ringed = recorded.clone()
        if self.residual:
            ringed.index_copy_(0, slots[1:].reshape(-1), self.side[3:3 + self.residual].float().reshape(-1, D))
        return recorded[:N], ringed[:N]

    def _summarise_newest(self, n: int) -> None:
        """Fold what each row's newest ``n`` entries read back as from their records, just written, into their
        pages' summaries (their full-precision keys were folded in when they were appended)."""
        if self.pages is None or not n:
            return
        B, H, D = self.shape
        first = self.row_offsets.long() + self.row_lengths.long() - n  # every row holds the n appended entries
        slots = first[:, None] + torch.arange(n, device=first.device)
        keys = decode_keys(self.k_flat[slots], self.side[2][:, None], D, self.layout, self.dtype, torch.float32)
        self.pages.append(keys.view(B, H, n, D), self.row_offsets, self.row_lengths)

    def _read_slots(self, index: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, _ = self.shape
        D = self.head_dim
        anchor_k, anchor_v, centre = self.side[:3].view(3, B, H, 1, D)
        keys = decode_keys(gather_slots(self.k_flat, index, present), centre, D, self.layout, self.dtype)
        values = dequantize(gather_slots(self.v_flat, index, present), D, self.layout, self.dtype)
        rank = index - self.row_offsets.view(B, H, 1).long()
        first = (present & (rank == 0))[..., None]  # each row's anchor slot
        if self.residual:  # the newest entries of each row: its residual ring, in full precision
            R = self.residual
            tail = (present & (rank >= self.row_lengths.view(B, H, 1).long() - R))[..., None]
            ring = (rank.clamp(min=0) % R).view(B * H, -1)
            rows = torch.arange(B * H, device=index.device)[:, None]
            shape = (B, H, index.shape[-1], D)
            keys = torch.where(tail, self.side[3:3 + R][ring, rows].view(shape), keys)
            values = torch.where(tail, self.side[3 + R:][ring, rows].view(shape), values)
        zero = torch.zeros((), dtype=self.dtype, device=keys.device)
        return (torch.where(present[..., None], torch.where(first, anchor_k, keys), zero),
                torch.where(first, anchor_v, values))

    def _attention(self, query: torch.Tensor, scaling: float, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.pages is not None and self._reads_pages(query):
            selected = self.pages.select(query, self.row_lengths, scaling, self.layer_idx, softcap)
            self._count_read(query, selected)
            return sparse_quantized_attention(query, self.k_flat, self.v_flat, self.row_offsets, self.row_lengths,
                                              self.side, self.pages.table, selected, self.pages.size, scaling,
                                              self.layout, softcap=softcap, sinks=sinks)
        self._count_read(query)
        return kernels.quantized_attention(query, self.k_flat, self.v_flat, self.row_offsets, self.row_lengths,
                                           self.side, scaling, self.layout, softcap=softcap, sinks=sinks)

    def _row_bytes(self) -> int:
        """Each row's side tensors, which attention reads whole: its anchor key and value, key centre and residual
        ring (an entry's record is read too, :meth:`_entry_bytes`: scales and zero points included)."""
        return self.side.shape[0] * self.side.shape[2] * self.side.element_size()

    def retain(self, keep: torch.Tensor, held: HeldEntries, spare: int | None = None) -> None:
        """As :meth:`RaggedLayer.retain`; on a compressed layer the kept entries' records move unchanged
        (``held`` is this layer's :meth:`view`, so its slots map to the layer's rows), the centres stay, and
        each row's anchor becomes what its first kept entry reads back as (itself when the anchor is kept)."""
        if not self.compressed:
            super().retain(keep, held, spare)
            return
        self._record_pending()  # records move as they are
        if keep.shape != held.valid.shape:
            raise ValueError(f"keep mask of shape {tuple(keep.shape)} does not match the layer's view "
                             f"{tuple(held.valid.shape)}")
        B, H, _ = self.shape
        index, present = ragged_index(self.row_offsets, self.row_lengths, (B, H))
        if present.shape != keep.shape:
            raise ValueError(f"the view of shape {tuple(keep.shape)} is not this layer's ({tuple(present.shape)})")
        kept = keep & held.valid & present
        anchors = row_anchors(held.keys, held.values, kept)
        self.side[:2] = torch.where(kept.any(-1).view(1, B * H, 1), anchors.to(self.dtype), self.side[:2])
        self.keys, self.values = gather_slots(self.k_flat, index, present), gather_slots(self.v_flat, index, present)
        self.compressed = False
        self.compress(kept, spare=spare, positions=held.positions)
        self._refill_residual(held.keys, held.values, kept)
        self._rebuild_pages()  # over the refilled rings

    def _refill_residual(self, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor) -> None:
        """Each row's residual ring from what its newest ``residual`` kept entries read back as (``keys,
        values``: the layer's view before the change, so no kept entry's read-back value changes)."""
        if self.residual:
            self.side[3:].zero_()
            fill_residual(self.side, keys, values, kept)

    def _crop_kept(self, n: int) -> None:
        if self.compressed:
            self._record_pending()  # entries older than the cropped ones become the ring's, read from records
        if not (self.compressed and self.residual and n):
            super()._crop_kept(n)
            return
        # each row's ring refilled from what its entries before the last n read back as now (some were older
        # than the residual, so their records are what they read as)
        held = self.view()
        kept = held.valid & (torch.cumsum(held.valid, dim=-1) <= self.row_lengths.view(held.valid.shape[:2] + (1,)) - n)
        super()._crop_kept(n)
        self._refill_residual(held.keys, held.values, kept)
        self._rebuild_pages()  # over the refilled rings

    def nbytes(self) -> int:
        return super().nbytes() + (self.side.numel() * self.side.element_size() if self.compressed else 0)

    def batch_nbytes(self) -> list[int]:
        per_row = super().batch_nbytes()
        if not self.compressed:
            return per_row
        side = self.side.numel() * self.side.element_size() // max(len(per_row), 1)  # each batch row's kv heads
        return [n + side for n in per_row]


class QuantizedRaggedCache(RaggedCache):
    """A :class:`~.ragged_cache.RaggedCache` for a ``storage`` kept as records (a
    :class:`~kvpress_ada.storage.RecordStorage`: int8, int4, fp8, ...): its layers are the kind's
    records' layers (:class:`QuantizedRaggedLayer` of its layout)."""

    def __init__(self, storage: Storage, config: Any = None, num_layers: int | None = None,
                 decode_reserve: int = 8):
        super().__init__(config=config, num_layers=num_layers, decode_reserve=decode_reserve, storage=storage)

    def _new_layer(self, decode_reserve: int) -> RaggedLayer:
        layout = self.storage.layout
        assert layout is not None  # a records kind (RaggedCache checked the structure)
        return QuantizedRaggedLayer(layout, decode_reserve)


register_ragged_cache("records", QuantizedRaggedCache)
