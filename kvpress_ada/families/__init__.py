"""Model-family adapters: one class per family (architecture, by ``config.model_type``) that says how to reach
a model's attention modules and their tensors and what the family's attention computes (sliding-window layers,
attention sinks, logit soft-capping, layers without RoPE, query scaling). Hosts ask the adapter
(:func:`family_of`) instead of naming architectures or module paths. Imports no host library.

Adding a family: subclass :class:`LlamaLike` (or :class:`Family`), override what differs, and decorate it with
``@register_family("model_type")``.
"""

from .base import Family, LlamaLike
from .gemma import Gemma2Family, Gemma3Family
from .gpt_oss import GptOssFamily
from .granite import GraniteFamily
from .llama import LlamaFamily
from .mistral import MistralFamily
from .moe import MixtralFamily, Qwen3MoeFamily
from .olmo2 import Olmo2Family
from .phi3 import Phi3Family
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
from .smollm3 import SmolLM3Family

__all__ = ["Family", "LlamaLike", "LlamaFamily", "MistralFamily", "Qwen2Family", "Qwen3Family", "Gemma2Family",
           "Gemma3Family", "GptOssFamily", "Phi3Family", "Olmo2Family", "SmolLM3Family", "MixtralFamily",
           "Qwen3MoeFamily", "GraniteFamily",
           "SUPPORTED_MODEL_TYPES", "ModelTypes", "family_for", "family_of", "register_family",
           "supported_model_types", "unregister_family"]
