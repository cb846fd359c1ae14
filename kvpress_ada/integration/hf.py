"""Small public helpers every module that calls a transformers model needs, written once.

transformers 5.24 renames the forward's ``past_key_values`` argument ``cache`` (deprecated alias);
:func:`cache_kwarg` and :func:`output_cache` hide the difference. :data:`SUPPORTED_MODEL_TYPES`
lives here (not in the model downloader) so the integration never imports download code.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_supported(model: Any) -> None:
    """Raise a clear error for a model whose architecture kvpress_ada does not support."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model type {model_type!r}: kvpress_ada supports "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def cache_kwarg(model: Any) -> str:
    """The name of ``model.forward``'s cache argument: ``"cache"`` (transformers >= 5.24) or
    ``"past_key_values"``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    """The cache a forward returned, whichever attribute name this transformers version uses."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def prefill_key_mask(args: tuple, kwargs: dict) -> torch.Tensor:
    """``[B, L]`` bool mask of the real (non-padding) tokens of a forward's inputs.

    Uses a 2-D ``attention_mask`` of the inputs' shape when given; all True otherwise.
    """
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    if ids is None and embeds is None:
        raise ValueError("the forward call has neither input_ids nor inputs_embeds")
    shape = ids.shape if ids is not None else embeds.shape[:2]
    device = ids.device if ids is not None else embeds.device
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == shape:
        return mask.to(device=device, dtype=torch.bool)
    return torch.ones(shape, dtype=torch.bool, device=device)
