"""Qwen3."""

from __future__ import annotations

from .base import LlamaLike
from .registry import register_family


@register_family("qwen3")
class Qwen3Family(LlamaLike):
    """Qwen3: Qwen2's attention with an RMS norm on each head's queries and keys before RoPE."""

    vllm_checked = True

    qk_norm_names = ("q_norm", "k_norm")
