"""Read policies: which pages of each (layer, kv head) row of the kept cache a decode step reads.

Eviction decides what a cache *holds*; a reader decides what each decode step *reads* of it (dynamic sparse
attention: Quest, Tang et al., ICML 2024, arXiv 2406.10774). A row's kept entries are cut into pages of
``page_size`` consecutive entries; the host keeps, per page, a bound on every query's logit over the page and
hands the reader the bounds of one layer; the reader returns the pages to read. ``Pipeline(reader=None)`` (the
default) reads every kept entry, as before. Register your own with :func:`register_reader`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..components import Component, Registry
from ..kernels.ragged.sparse import page_bounds


class Reader(Component):
    """``select(bounds, lengths, layer_idx) -> [B, H_kv, W]`` bool: the pages each kv head of one layer reads.

    ``bounds [B, H_kv, G, W]`` (fp32): for each query head ``g`` of the kv head's group, an upper bound of its
    scaled logit over every entry of page ``j`` (``-inf`` for a page that holds nothing); ``lengths [B, H_kv]``:
    the entries each row holds (page ``j`` holds entries ``j * page_size`` .. ``(j + 1) * page_size - 1``). No
    host sync (a compiled decode step runs it)."""

    kind: ClassVar[str] = "reader"
    page_size: int

    def select(self, bounds: torch.Tensor, lengths: torch.Tensor,
               layer_idx: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement select(bounds, lengths, layer_idx)")

    def reads_every_page(self, longest: int) -> bool:
        """Whether every page of rows of at most ``longest`` entries is read (a host then reads them densely)."""
        return False

    def select_fused(self, query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor,
                     lengths: torch.Tensor, scale: float, layer_idx: int,
                     softcap: float | None = None) -> torch.Tensor | None:
        """What :func:`select_pages` returns, computed in one fused kernel where the reader has one for the call
        (bounds and selection together); ``None`` (the default): bounds, then :meth:`select`."""
        return None


READERS = Registry("reader", Reader)
register_reader = READERS.decorator_function()


def select_pages(reader: Reader, query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor,
                 lengths: torch.Tensor, scale: float, layer_idx: int,
                 softcap: float | None = None) -> torch.Tensor:
    """``[B, H_kv, W]`` bool: the pages ``reader`` reads for ``query [B, H_q, 1, D]`` over rows whose page ``j`` is
    page ``table[r, j]`` (``[B * H_kv, W]``, ``-1``: none) of the summaries ``kmin, kmax [pages, D]`` and which hold
    ``lengths [B * H_kv]`` entries: each page's Quest bound (:func:`~kvpress_ada.kernels.ragged.sparse.page_bounds`),
    then :meth:`Reader.select` (or both at once: :meth:`Reader.select_fused`). What every host that pages calls (the
    ragged cache's pages, an engine's pages)."""
    fused = reader.select_fused(query, kmin, kmax, table, lengths, scale, layer_idx, softcap)
    if fused is not None:
        return fused
    B = query.shape[0]
    bounds = page_bounds(query, kmin, kmax, table, scale, softcap)
    return reader.select(bounds, lengths.view(B, -1), layer_idx)
