"""Small public helpers every module that calls a transformers model needs, written once.

transformers 5.24 renames the forward's ``past_key_values`` argument ``cache`` (deprecated alias);
:func:`cache_kwarg` and :func:`output_cache` hide the difference. :func:`check_supported` asks the
model-family registry (:mod:`kvpress_ada.families`); :data:`SUPPORTED_MODEL_TYPES` is its live view.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...families import SUPPORTED_MODEL_TYPES, Family, family_of

__all__ = ["SUPPORTED_MODEL_TYPES", "check_supported", "cache_kwarg", "output_cache", "input_shape",
           "prefill_key_mask", "check_left_padded"]


def check_supported(model: Any) -> Family:
    """``model``'s family adapter; a one-line ``ValueError`` for a family kvpress_ada does not serve (or that
    declares this host cannot serve it)."""
    family = family_of(model)
    refusal = family.refuses("transformers")
    if refusal is not None:
        raise ValueError(f"model type {family.model_type!r} cannot be served by the transformers host: {refusal}")
    return family


def cache_kwarg(model: Any) -> str:
    """The name of ``model.forward``'s cache argument: ``"cache"`` (transformers >= 5.24) or
    ``"past_key_values"``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    """The cache a forward returned, whichever attribute name this transformers version uses."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def input_shape(args: tuple, kwargs: dict) -> tuple[torch.Size, torch.device]:
    """``([B, T], device)`` of a forward's ``input_ids`` or ``inputs_embeds``."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None:
        return ids.shape, ids.device
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        raise ValueError("the forward call has neither input_ids nor inputs_embeds")
    return embeds.shape[:2], embeds.device


def prefill_key_mask(args: tuple, kwargs: dict) -> torch.Tensor:
    """``[B, L]`` bool mask of the real (non-padding) tokens of a forward's inputs.

    Uses a 2-D ``attention_mask`` of the inputs' shape when given, or the last query's row of a 4-D one
    (``[B, 1, T, T]``, bool or additive: what ``generate`` builds for a compileable cache); all True otherwise.
    """
    shape, device = input_shape(args, kwargs)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == shape:
        return mask.to(device=device, dtype=torch.bool)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] == shape[0] and mask.shape[-1] == shape[1]:
        allowed = mask[:, 0, -1, :]  # a left-padded prefill: the last query sees every real token
        return (allowed if allowed.dtype == torch.bool else allowed == 0).to(device)
    return torch.ones(shape, dtype=torch.bool, device=device)


def check_left_padded(key_mask: torch.Tensor) -> None:
    """Refuse padding anywhere but on the left: a press would protect pad tokens and score
    with pad queries. One host sync, at prefill only."""
    inner = key_mask[:, :-1] & ~key_mask[:, 1:]  # a real token followed by a pad token
    if bool(inner.any()):
        row = int(inner.any(-1).nonzero()[0, 0])
        raise ValueError(f"row {row} of the attention_mask has padding after real tokens; kvpress_ada presses need "
                         "left padding (tokenizer.padding_side = 'left')")
    empty = ~key_mask.any(-1)
    if bool(empty.any()):
        raise ValueError(f"row {int(empty.nonzero()[0, 0])} of the attention_mask has no real token")
