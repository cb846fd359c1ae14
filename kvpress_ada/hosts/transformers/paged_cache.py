"""PagedCache: a transformers ``Cache`` whose compressed layers hold pages owned per (batch row, kv head).

The storage a serving host gives a request (:mod:`kvpress_ada.serving.pages`), here under
``model.generate``: a layer is dense while its prefill is in flight; :meth:`PagedLayer.retain` writes
each head's kept entries into pages of its own (``page_size`` entries each) and attention reads them
with :func:`~kvpress_ada.kernels.paged.ops.paged_attention`. Each layer owns its pool: it starts with the
pages the kept entries fill plus ``reserve_pages`` per row, and grows geometrically when decode
tokens need more (amortised O(1) appends; page ids stay valid across growth). Pass one as the cache
(``model(..., past_key_values=PagedCache(config))``) inside ``with press(model)``; it compresses exactly
as :class:`~.ragged_cache.RaggedCache` does. Eager only (no compiled decode step).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...kernels.paged.ops import paged_attention
from ...serving.pages import PagedSequence, PagePool
from .attention import logit_extras
from .entries import real_entries
from .press_cache import DenseAttention, DenseUntilKept, HeldEntries, PressCache, uncroppable
from .window_layer import press_layers


class PagedLayer(DenseUntilKept):
    """One layer: dense while prefill is in flight, paged per (row, kv head) once it keeps a selection."""

    is_compileable = False

    def __init__(self, page_size: int = 32, reserve_pages: int = 1, growth: float = 0.25):
        super().__init__()
        if page_size < 1 or reserve_pages < 0:
            raise ValueError(f"page_size must be >= 1 and reserve_pages >= 0, got {page_size}, {reserve_pages}")
        self.page_size, self.reserve_pages, self.growth = page_size, reserve_pages, growth
        self.reset()

    def reset(self) -> None:
        self._reset_dense()
        self.pool: PagePool | None = None
        self.seqs: list[PagedSequence] = []
        self._appended = 0  # tokens appended to every row since the layer last kept a selection

    # ------------------------------------------------------------------ HF API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, q, D = key_states.shape
        if not self.compressed:
            return self._update_dense(key_states, value_states)
        pool = self._pool()
        self._make_room(sum(pool.pages_needed(seq, q) for seq in self.seqs))
        positions = torch.arange(self.seen, self.seen + q, device=key_states.device).repeat(B)
        pool.append(self.seqs, key_states.detach().transpose(1, 2).reshape(B * q, H, D),
                    value_states.detach().transpose(1, 2).reshape(B * q, H, D), positions, [q] * B)
        self.seen += q
        self._appended += q
        return pool.k_pages, pool.v_pages

    def _crop_kept(self, n: int) -> None:
        """Drop the last ``n`` tokens appended since the layer last kept a selection (their pages go back)."""
        if n > self._appended:
            raise uncroppable(n, self._appended)
        pool = self._pool()
        self._appended -= n
        for seq in self.seqs:
            for h in range(seq.heads):
                seq.lengths[h] -= n
                keep = -(-seq.lengths[h] // self.page_size)
                pool.give(seq.pages[h][keep:])
                seq.pages[h] = seq.pages[h][:keep]

    # ------------------------------------------------------------- press API
    def _pool(self) -> PagePool:
        assert self.pool is not None
        return self.pool

    def _make_room(self, pages: int) -> None:
        """Grow the pool when fewer than ``pages`` are free (geometrically; page ids stay valid)."""
        pool = self._pool()
        if pages <= pool.free_pages:
            return
        pool.grow(max(pages - pool.free_pages, math.ceil(self.growth * pool.capacity)))

    def view(self, key_mask: torch.Tensor | None = None) -> HeldEntries:
        if not self.compressed:
            return self._dense_view(key_mask)
        keys, values, present, positions = self._pool().view(self.seqs)
        return HeldEntries(keys, values, present & real_entries(key_mask, positions), positions)

    def retain(self, keep: torch.Tensor, held: HeldEntries, spare: int | None = None) -> None:
        """Keep the entries of ``held`` (this layer's :meth:`view`) where ``keep`` is True, each (row, kv head)
        in pages of its own; ``spare`` free entries per row are made room for (default: ``reserve_pages``). A
        compressed layer's kept entries keep their pages, unless ``held`` was rewritten (merged values, pruned
        key channels): then its pages are laid out again from ``held``."""
        if keep.shape != held.valid.shape:
            raise ValueError(f"keep mask of shape {tuple(keep.shape)} does not match the layer's view "
                             f"{tuple(held.valid.shape)}")
        keep = keep & held.valid
        B, H, W, D = held.keys.shape
        reserve = self.reserve_pages if spare is None else -(-spare // self.page_size)
        if not self.compressed or held.rewritten:
            counts = keep.sum(-1)
            pages = int((-(-counts // self.page_size)).sum()) + reserve * B * H
            self.pool = PagePool.allocate(max(pages, 1), self.page_size, D, self.dtype, self.device)
            self.seqs = [PagedSequence(H) for _ in range(B)]
            for b, seq in enumerate(self.seqs):
                for h in range(H):
                    seq.pages[h] = self.pool.take(-(-int(counts[b, h]) // self.page_size))
                self.pool.append_heads(seq, held.keys[b], held.values[b], held.positions[b], keep[b])
            self.keys = self.values = None
            self.compressed = True
        else:
            self._pool().retain(self.seqs, keep)
        self._appended = 0
        self._make_room(reserve * B * H)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float, dense_fn: DenseAttention, module: torch.nn.Module,
               **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if not self.compressed:
            return dense_fn(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        B, H_q, Q, D = query.shape
        pool = self._pool()
        table, lengths = pool.table(self.seqs)
        start = torch.arange(0, (B + 1) * Q, Q, dtype=torch.int32, device=query.device)
        with torch.no_grad():
            softcap, sinks = logit_extras(kwargs)
            out = paged_attention(query.transpose(1, 2).reshape(B * Q, H_q, D), pool.k_pages, pool.v_pages,
                                  table, lengths, start, scaling, softcap=softcap, sinks=sinks)
        return out.view(B, Q, H_q, D), None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported with PagedCache (pages are owned per head); "
                                  "use num_beams=1")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            raise NotImplementedError("expanding a filled PagedCache along the batch is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            raise NotImplementedError("selecting batch rows of a filled PagedCache is not supported")

    # ------------------------------------------------------------ inspection
    def nbytes(self) -> int:
        """Bytes of keys and values the layer holds: the dense prefill, or its whole pool (free pages included)."""
        if not self.compressed:
            return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)
        pool = self._pool()
        return sum(t.numel() * t.element_size() for t in (pool.k_pages, pool.v_pages))

    def pages_held(self) -> int:
        """Pages the rows of this layer hold (``sum over (row, kv head) of ceil(entries / page_size)``)."""
        return sum(seq.pages_held for seq in self.seqs)

    def head_lengths(self) -> torch.Tensor:
        if not self.compressed:
            return self._dense_head_lengths()
        return torch.tensor([seq.lengths for seq in self.seqs], dtype=torch.long, device=self.device)


class PagedCache(PressCache):
    """A press cache of :class:`PagedLayer` objects (see the module docstring)."""

    def __init__(self, config: Any = None, num_layers: int | None = None, page_size: int = 32,
                 reserve_pages: int = 1):
        super().__init__(layers=press_layers(config, num_layers, lambda: PagedLayer(page_size, reserve_pages)))

    def pages_held(self) -> int:
        return sum(layer.pages_held() for layer in self.layers if isinstance(layer, PagedLayer))
