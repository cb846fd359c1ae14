"""Which cache a press's kept entries go to, on this host: the host, not the evictor, picks the storage.

An evictor that frees memory (``TopK``) compacts into the ragged cache the press's ``storage`` kind declares
(the :class:`~.ragged_cache.RaggedCache` class :func:`~.ragged_cache.ragged_cache_class` names for the kind's
structure; records: :class:`~.quantized_cache.QuantizedRaggedCache`); one that keeps the dense cache and hides
entries (``Mask``) into a :class:`~.masked_cache.MaskedCache` (full precision only: ``Pipeline`` refuses a
storage kept as records with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import quantized_cache  # noqa: F401  (holds the records structure: registers its layer class)
from .masked_cache import MaskedCache
from .press_cache import PressCache
from .ragged_cache import RaggedCache, ragged_cache_class

if TYPE_CHECKING:
    from ...pipeline import Pipeline
    from ...storage import Storage


def new_cache(press: Pipeline, config: Any) -> PressCache:
    """An empty cache for a model with ``config`` that ``press`` compresses into."""
    if not type(press.evictor).frees_memory:
        return MaskedCache(config=config)
    return ragged_cache(press.storage, config)


def ragged_cache(storage: Storage, config: Any) -> RaggedCache:
    """An empty ragged cache whose layers store entries as ``storage`` says (the layer class of its structure)."""
    return ragged_cache_class(storage)(config=config, storage=storage)
