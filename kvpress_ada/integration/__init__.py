"""Integration with Hugging Face transformers (attention interface, caches, prefill hook)."""

from .masked_cache import MaskedCache
from .press_context import ATTENTION_NAME, SUPPORTED_MODEL_TYPES, apply_press, check_supported
from .ragged_cache import RaggedCache, RaggedLayer

__all__ = ["ATTENTION_NAME", "SUPPORTED_MODEL_TYPES", "MaskedCache", "RaggedCache", "RaggedLayer", "apply_press",
           "check_supported"]
