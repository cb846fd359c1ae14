"""RoPE inverse frequencies from a transformers config alone, for a host that runs another implementation of the
model (the vLLM host): those the transformers host reads of the model (:meth:`Family.rope_inv_freq
<kvpress_ada.families.Family.rope_inv_freq>`), through the same family rule (:meth:`Family.rotary_inv_freq
<kvpress_ada.families.Family.rotary_inv_freq>`: a rotary embedding per layer type, zeros for a layer without
RoPE) over the rotary embedding the family's transformers decoder would build from that config (its rope init for
the config's rope parameters, so scaled RoPE such as ``llama3``, ``yarn``, ``linear`` or ``longrope`` matches).
``dynamic`` and ``longrope`` frequencies are those before transformers updates them for a sequence past the
original length."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

from ...families import family_for


def rotary_embedding(config: Any) -> torch.nn.Module:
    """The rotary embedding a transformers decoder of ``config`` builds (``decoder.rotary_emb``): the one
    ``*RotaryEmbedding`` class of the config's modeling module, built from ``config`` (a transformers config; a
    ``config.json`` mapping is read as one). A one-line ``ValueError`` where that class is not found."""
    from transformers import AutoConfig

    if isinstance(config, Mapping):
        config = AutoConfig.for_model(**config)
    module = type(config).__module__
    if not (module.startswith("transformers.models.") and ".configuration_" in module):
        raise ValueError(f"{type(config).__name__} is not a transformers config: cannot build the rotary embedding "
                         "its RoPE frequencies come from")
    modeling = importlib.import_module(module.replace(".configuration_", ".modeling_"))
    classes = [c for name, c in vars(modeling).items()
               if name.endswith("RotaryEmbedding") and isinstance(c, type) and c.__module__ == modeling.__name__]
    if len(classes) != 1:
        raise ValueError(f"{modeling.__name__} defines {len(classes)} *RotaryEmbedding classes, not one: cannot tell "
                         "which its decoder builds")
    return classes[0](config)


def config_rope_inv_freq(config: Any, layer_idx: int = 0, rotary: torch.nn.Module | None = None) -> torch.Tensor:
    """The RoPE inverse frequencies ``[D // 2]`` layer ``layer_idx`` of the transformers model of ``config`` rotates
    with (see the module docstring); ``rotary``: :func:`rotary_embedding` of ``config``, built once by a caller
    asking for every layer."""
    built = rotary_embedding(config) if rotary is None else rotary
    return family_for(config).rotary_inv_freq(built, layer_idx, f"{type(built).__name__} of the config")
