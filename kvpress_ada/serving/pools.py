"""The page pool the serving layer holds each storage kind in: a table from a kind's
:attr:`~kvpress_ada.storage.Storage.structure` to its pool class (``"native"``: :class:`~.pages.PagePool`, or the
engine's own pool for entries in the model's dtype; ``"records"``: :class:`~.record_pages.QuantizedPagePool`
over the same bytes). A kind of another structure registers its pool with :func:`register_page_pool`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .pages import PagePool
from .record_pages import QuantizedPagePool


@dataclass(frozen=True)
class PoolKind:
    """How the serving layer holds one storage structure: ``pool(storage, pages [P, 2, S, D], native)`` over an
    engine's pages (each page's keys then its values, in the model's dtype; ``native(pages)``: the engine's own
    pool for entries in that dtype, or ``None``), and ``reserve(storage, page_size, head_dim, dtype)``: pages per
    (request, kv head) row a first eviction may take beyond the pages it frees."""

    pool: Callable[[Any, torch.Tensor, Any], PagePool]
    reserve: Callable[[Any, int, int, torch.dtype], int]


PAGE_POOLS: dict[str, PoolKind] = {}


def register_page_pool(structure: str, kind: PoolKind, override: bool = False) -> None:
    """Hold storage kinds of ``structure`` in the pools ``kind`` builds."""
    if structure in PAGE_POOLS and not override:
        raise ValueError(f"the storage structure {structure!r} already has a page pool; pass override=True")
    PAGE_POOLS[structure] = kind


def _kind(storage: Any) -> PoolKind:
    structure = type(storage).structure
    kind = PAGE_POOLS.get(structure)
    if kind is None:
        raise ValueError(f"storage={storage.label!r} keeps entries as {structure!r}, which the serving layer holds in "
                         f"no page pool (known: {', '.join(sorted(PAGE_POOLS))}): register one with register_page_pool")
    return kind


def page_pool(storage: Any, pages: torch.Tensor, native: Callable[[torch.Tensor], PagePool] | None = None) -> PagePool:
    """The pool of one layer's ``pages [P, 2, S, D]`` holding ``storage``'s entries."""
    return _kind(storage).pool(storage, pages, native)


def pool_reserve(storage: Any, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Pages per (request, kv head) row a first eviction under ``storage`` may take beyond the pages it frees."""
    return _kind(storage).reserve(storage, page_size, head_dim, dtype)


def _native_pool(storage: Any, pages: torch.Tensor, native: Any) -> PagePool:
    return native(pages) if native is not None else PagePool(pages[:, 0], pages[:, 1])


def _record_pool(storage: Any, pages: torch.Tensor, native: Any) -> PagePool:
    """Records over the bytes of ``pages`` (each page's bytes whole: ``native`` is not used)."""
    P, _, S, D = pages.shape
    raw = torch.as_strided(pages, (P, 2 * S * D), (pages.stride(0), 1)).view(torch.uint8)
    return QuantizedPagePool(raw, S, D, pages.dtype, storage.layout)


register_page_pool("native", PoolKind(_native_pool, lambda storage, size, head_dim, dtype: 0))
register_page_pool("records", PoolKind(_record_pool, lambda storage, size, head_dim, dtype:
                                       QuantizedPagePool.reserve_pages(size, head_dim, dtype, storage.layout)))
