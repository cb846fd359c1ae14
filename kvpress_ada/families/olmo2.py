"""OLMo-2."""

from __future__ import annotations

from .base import LlamaLike
from .registry import register_family


@register_family("olmo2")
class Olmo2Family(LlamaLike):
    """OLMo-2: RMS norms over the whole query and key projections (all heads at once) before RoPE."""

    vllm_checked = True

    qk_norm_names = ("q_norm", "k_norm")
