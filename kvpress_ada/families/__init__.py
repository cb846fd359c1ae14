"""Model-family adapters: one class per family (architecture, by ``config.model_type``) that says how to reach
a model's attention modules and their tensors and what the family's attention computes (sliding-window layers,
attention sinks, logit soft-capping, layers without RoPE, query scaling). Hosts ask the adapter
(:func:`family_of`) instead of naming architectures or module paths. Imports no host library.

Adding a family: subclass :class:`LlamaLike` (or :class:`Family`), override what differs, and decorate it with
``@register_family("model_type")``.
"""

from .base import Family, LlamaLike
from .llama import LlamaFamily
from .mistral import MistralFamily
from .qwen2 import Qwen2Family
from .qwen3 import Qwen3Family
from .registry import (
    SUPPORTED_MODEL_TYPES,
    ModelTypes,
    family_for,
    family_of,
    register_family,
    supported_model_types,
    unregister_family,
)

__all__ = ["Family", "LlamaLike", "LlamaFamily", "MistralFamily", "Qwen2Family", "Qwen3Family",
           "SUPPORTED_MODEL_TYPES", "ModelTypes", "family_for", "family_of", "register_family",
           "supported_model_types", "unregister_family"]
