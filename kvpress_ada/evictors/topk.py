"""TopK eviction into the ragged cache (SnapKV / Ada-KV style): evicted entries really leave memory."""

from __future__ import annotations

from typing import Any, Literal

from ..integration.ragged_cache import RaggedCache
from .base import Evictor, register_evictor


@register_evictor("topk")
class TopK(Evictor):
    """Each head keeps its ``counts`` best tokens in position order, compacted into a
    :class:`~kvpress_ada.RaggedCache` (rows of different lengths, no padding)."""

    name: Literal["topk"] = "topk"

    def new_cache(self, config: Any) -> RaggedCache:
        return RaggedCache(config=config)
