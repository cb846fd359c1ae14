"""TopK eviction (SnapKV / Ada-KV style): evicted entries really leave memory."""

from __future__ import annotations

from typing import Literal

from .base import Evictor, register_evictor


@register_evictor("topk")
class TopK(Evictor):
    """Each head keeps its ``counts`` best tokens in position order; a host compacts them into its
    storage (rows of different lengths, no padding: the transformers host's ragged cache)."""

    name: Literal["topk"] = "topk"
