"""Llama (and models of its architecture, e.g. SmolLM2)."""

from __future__ import annotations

from .base import LlamaLike
from .registry import register_family


@register_family("llama")
class LlamaFamily(LlamaLike):
    """Llama: the Llama-like defaults, no sliding window."""

    vllm_checked = True
