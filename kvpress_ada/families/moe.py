"""Mixture-of-experts families whose attention is a known family's: Mixtral, Qwen3-MoE."""

from __future__ import annotations

from .mistral import MistralFamily
from .qwen3 import Qwen3Family
from .registry import register_family


@register_family("mixtral")
class MixtralFamily(MistralFamily):
    """Mixtral: Mistral's attention (every layer slides when the config sets ``sliding_window``), MoE MLP."""

    vllm_checked = True


@register_family("qwen3_moe")
class Qwen3MoeFamily(Qwen3Family):
    """Qwen3-MoE: Qwen3's attention (per-head query and key norms), MoE MLP."""

    vllm_checked = True
