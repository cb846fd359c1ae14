"""Integration with Hugging Face transformers (attention interface, caches, prefill hook)."""

from .hf import SUPPORTED_MODEL_TYPES, cache_kwarg, check_supported, output_cache, prefill_key_mask
from .masked_cache import MaskedCache
from .press_context import ATTENTION_NAME, apply_press
from .ragged_cache import RaggedCache, RaggedLayer

__all__ = ["ATTENTION_NAME", "SUPPORTED_MODEL_TYPES", "MaskedCache", "RaggedCache", "RaggedLayer", "apply_press", "cache_kwarg", "output_cache", "prefill_key_mask",
           "check_supported"]
