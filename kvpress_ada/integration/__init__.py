"""Integration with Hugging Face transformers (attention interface, caches, prefill hook)."""

from .hf import SUPPORTED_MODEL_TYPES, cache_kwarg, check_left_padded, check_supported, output_cache, prefill_key_mask
from .masked_cache import MaskedCache, MaskedLayer
from .press_cache import PressCache, PressLayer
from .press_context import ATTENTION_NAME, PrefillHandler, PressRun, apply_press, attach, detach
from .ragged_cache import RaggedCache, RaggedLayer

__all__ = ["ATTENTION_NAME", "SUPPORTED_MODEL_TYPES", "MaskedCache", "MaskedLayer", "PressCache", "PressLayer",
           "PrefillHandler", "PressRun", "RaggedCache", "RaggedLayer", "apply_press", "attach", "detach",
           "cache_kwarg", "check_left_padded", "check_supported", "output_cache", "prefill_key_mask"]
