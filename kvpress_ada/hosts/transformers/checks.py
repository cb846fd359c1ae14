"""What a transformers model can serve of a press, checked once when they meet (``with press(model)``,
fan-out): the press's components against the model's config, the scorer's model pass against its
tokenizer, the storage against its geometry and dtype, the modes tensor parallelism cannot follow."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...scorers.base import PassScorer
from ...storage import model_head_dim
from .hf import check_supported
from .model_pass import check_gradient_pass, check_pass_inputs
from .tensor_parallel import head_shard

if TYPE_CHECKING:
    from ...pipeline import Pipeline


def check_press(press: Pipeline, model: Any) -> None:
    """Raise a one-line ``ValueError`` when ``press`` cannot serve ``model``: an unsupported architecture,
    a calibration or surrogate made for another model, no usable tokenizer for a model pass, a storage
    that cannot hold this model's entries, a tensor-parallel layout it cannot follow."""
    check_supported(model)
    press.check_config(model.config)
    if isinstance(press.scorer, PassScorer):  # its tokenizer (and a backward pass it needs), before any prefill
        check_pass_inputs(model, press.scorer)
        check_gradient_pass(model, press.scorer)
    head_dim = model_head_dim(model.config)
    param = next(iter(model.parameters()), None)
    if head_dim is not None:
        press.storage.check_geometry(head_dim, param.dtype if param is not None else torch.float32)
    if head_shard(model) is not None and (press.compresses_decode or press.prefill_chunk is not None):
        raise ValueError("decode compression (decode_budget) and chunked prefill (prefill_chunk) are not "
                         "supported on a tensor-parallel model yet; use a press without them")
    if head_shard(model) is not None and press.reader is not None:
        raise ValueError(f"reader {type(press.reader).__name__} splits a layer's read budget across every kv head, "
                         "which a tensor-parallel rank does not hold: use a press without a reader")
