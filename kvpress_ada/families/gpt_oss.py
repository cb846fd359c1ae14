"""GPT-OSS."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import LlamaLike
from .registry import register_family

if TYPE_CHECKING:
    import torch


@register_family("gpt_oss")
class GptOssFamily(LlamaLike):
    """GPT-OSS: sliding-window and global layers alternate (``layer_types``); each query head has a learned
    sink logit (``self_attn.sinks``) that joins its softmax and takes probability mass without a value; MoE MLP."""

    def attention_sinks(self, module: Any) -> torch.Tensor | None:
        return module.sinks
