"""Gemma-2 and Gemma-3 (text)."""

from __future__ import annotations

from .base import LlamaLike, setting
from .registry import register_family


@register_family("gemma2")
class Gemma2Family(LlamaLike):
    """Gemma-2: sliding-window and global layers alternate (``layer_types``), attention logits are soft-capped
    (``attn_logit_softcapping``) and scaled by ``query_pre_attn_scalar ** -0.5``."""

    @property
    def logit_softcap(self) -> float | None:
        cap = setting(self.config, "attn_logit_softcapping")
        return float(cap) if cap else None

    @property
    def query_scaling(self) -> float:
        return float(setting(self.config, "query_pre_attn_scalar", self.head_dim)) ** -0.5


@register_family("gemma3_text")
class Gemma3Family(Gemma2Family):
    """Gemma-3 (text): five sliding-window layers to one global layer (``layer_types``), an RMS norm on each
    head's queries and keys before RoPE, a RoPE base per layer type, no soft-capping unless the config sets it."""

    qk_norm_names = ("q_norm", "k_norm")
