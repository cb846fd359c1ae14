"""Granite."""

from __future__ import annotations

from .base import LlamaLike, setting
from .registry import register_family


@register_family("granite")
class GraniteFamily(LlamaLike):
    """Granite: Llama's attention with logits scaled by ``attention_multiplier`` (not ``head_dim ** -0.5``);
    its embedding, residual and logit multipliers are outside attention."""

    vllm_checked = True

    @property
    def query_scaling(self) -> float:
        return float(setting(self.config, "attention_multiplier", self.head_dim ** -0.5))
