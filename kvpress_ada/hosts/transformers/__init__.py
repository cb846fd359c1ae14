"""The Hugging Face transformers host: the attention function, the press caches (the storage), the
routing that picks each forward's mode handler, the handlers themselves, and the checks a model must
pass. :data:`HOST` is registered with :mod:`kvpress_ada.hosts.base` when this package is imported, which
``hosts.base`` does on the first lookup (``press(model)``), so a transformers model comes here; the attention
function is registered with transformers when a press is first applied (:func:`.attention.register_attention`)."""

from typing import Any

import torch

from ..base import register_host
from .attention import ATTENTION_NAME, Handler
from .caches import new_cache
from .checks import check_press
from .hf import SUPPORTED_MODEL_TYPES, cache_kwarg, check_left_padded, check_supported, output_cache, prefill_key_mask
from .masked_cache import MaskedCache, MaskedLayer
from .press_cache import HeldEntries, PressCache, PressLayer
from .quantized_cache import QuantizedRaggedCache, QuantizedRaggedLayer
from .ragged_cache import RaggedCache, RaggedLayer
from .routing import apply_press, attach, detach


class TransformersHost:
    """Serves ``torch.nn.Module`` models with a ``config`` (``PreTrainedModel``); its checks refuse an
    architecture it does not support in one line."""

    name = "transformers"

    def serves(self, model: Any) -> bool:
        return isinstance(model, torch.nn.Module) and hasattr(model, "config")

    def apply(self, press: Any, model: Any, **options: Any) -> Any:
        return apply_press(press, model, **options)


HOST = register_host(TransformersHost())

__all__ = ["ATTENTION_NAME", "HOST", "SUPPORTED_MODEL_TYPES", "Handler", "HeldEntries", "MaskedCache", "MaskedLayer",
           "PressCache", "PressLayer", "QuantizedRaggedCache", "QuantizedRaggedLayer", "RaggedCache", "RaggedLayer",
           "TransformersHost", "apply_press", "attach",
           "check_press", "detach", "cache_kwarg", "check_left_padded", "check_supported", "new_cache",
           "output_cache", "prefill_key_mask"]
