"""Phi-3."""

from __future__ import annotations

from .base import LlamaLike, setting
from .registry import register_family


@register_family("phi3")
class Phi3Family(LlamaLike):
    """Phi-3: one fused ``qkv_proj`` (queries, then keys, then values) instead of separate projections; every layer
    slides when the config sets ``sliding_window``."""

    vllm_checked = True

    projection_names = {"qkv": "qkv_proj", "o": "o_proj"}

    @property
    def sliding_window_layers(self) -> tuple[int, ...]:
        return () if setting(self.config, "sliding_window") is None else tuple(range(self.n_layers))
