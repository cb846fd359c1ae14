"""Qwen2 (and Qwen2.5)."""

from __future__ import annotations

from .base import LlamaLike
from .registry import register_family


@register_family("qwen2")
class Qwen2Family(LlamaLike):
    """Qwen2: the layers from ``max_window_layers`` on slide when ``use_sliding_window`` is set (its config's
    ``layer_types`` say which)."""

    vllm_checked = True
