"""Which cache a press's kept entries go to, on this host: the host, not the evictor, picks the storage.

An evictor that frees memory (``TopK``) compacts into a :class:`~.ragged_cache.RaggedCache` of the
press's ``storage`` (int8 / int4: a :class:`~.quantized_cache.QuantizedRaggedCache`); one that keeps
the dense cache and hides entries (``Mask``) into a :class:`~.masked_cache.MaskedCache` (full
precision only: ``Pipeline`` refuses a quantized storage with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .masked_cache import MaskedCache
from .press_cache import PressCache
from .quantized_cache import QuantizedRaggedCache
from .ragged_cache import RaggedCache

if TYPE_CHECKING:
    from ...pipeline import Pipeline
    from ...storage import Storage


def new_cache(press: Pipeline, config: Any) -> PressCache:
    """An empty cache for a model with ``config`` that ``press`` compresses into."""
    if not type(press.evictor).frees_memory:
        return MaskedCache(config=config)
    return ragged_cache(press.storage, config)


def ragged_cache(storage: Storage, config: Any) -> RaggedCache:
    """An empty ragged cache whose layers store entries as ``storage`` says (full precision: :class:`RaggedCache`;
    int8 / int4: :class:`~.quantized_cache.QuantizedRaggedCache`)."""
    return QuantizedRaggedCache(storage, config=config) if storage.quantized else RaggedCache(config=config)
