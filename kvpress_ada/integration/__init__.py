"""Integration with Hugging Face transformers: the attention function, the press caches, the
routing that picks each forward's mode handler, and the handlers themselves."""

from .attention import ATTENTION_NAME, Handler
from .hf import SUPPORTED_MODEL_TYPES, cache_kwarg, check_left_padded, check_supported, output_cache, prefill_key_mask
from .masked_cache import MaskedCache, MaskedLayer
from .press_cache import HeldEntries, PressCache, PressLayer
from .ragged_cache import RaggedCache, RaggedLayer
from .routing import apply_press, attach, detach

__all__ = ["ATTENTION_NAME", "SUPPORTED_MODEL_TYPES", "Handler", "HeldEntries", "MaskedCache", "MaskedLayer",
           "PressCache", "PressLayer", "RaggedCache", "RaggedLayer", "apply_press", "attach", "detach",
           "cache_kwarg", "check_left_padded", "check_supported", "output_cache", "prefill_key_mask"]
