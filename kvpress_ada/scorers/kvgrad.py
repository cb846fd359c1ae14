"""KVgrad (OpenReview cg1wTCJjjk, https://openreview.net/forum?id=cg1wTCJjjk; NVIDIA kvpress's ``KVgradPress``): an
entry matters by how much the model's last hidden states depend on what it writes into the residual stream while the
model reconstructs its context (input x gradient attribution over KVzip's reconstruction).

KVzip's passes (:class:`~kvpress_ada.scorers.kvzip.ContextReplay`: the same prompts, sinks and chunks; chunks of 512
context tokens by default, as kvpress) run through the model with autograd on, its weights frozen; per layer ``l``
and context entry ``c``::

    S_{l,c} = max over pass tokens p and query heads g of c's kv group of
              A^l_g(p, c) * ||W_O^{l,g} v_c|| * ||grad_{a_p^l} Phi||,     Phi = sum_p ||h_p^L||^2

``A``: KVzip's attention of the pass token's query over the chunk's visible entries and the pass's own tokens;
``W_O^{l,g}``: the ``head_dim`` columns of the layer's output projection that query head ``g`` feeds; ``a_p^l``:
the attention module's output at pass token ``p`` (what it adds to the residual stream); ``h_p^L``: the last decoder
layer's output at ``p`` (before the final norm), summed over the pass's tokens (padding left out). The context's
cached keys and values stay constants of the gradient. Scores share one scale across layers and heads: the
``kvgrad`` preset takes one top-k over all of them (kvpress's ``layerwise=False``).

Needs a backward pass: the integration leaves ``torch.inference_mode`` for it (the dense cache's tensors are only
read), and refuses, in one line, a model whose weights were made under inference mode and a tensor-parallel model;
as every model-pass scorer, no chunked prefill, decode compression or serving engine.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import PassChunk, register_scorer
from .kvzip import ContextReplay, replay_scores


@register_scorer("kvgrad")
class KVgrad(ContextReplay):
    """KVzip's reconstruction attention times ``||W_O v||`` times the gradient norm of the last hidden states'
    energy w.r.t. the attention output at each pass token, maximised over the pass (module docstring)."""

    name: Literal["kvgrad"] = "kvgrad"
    chunk: int = Field(512, ge=1, description="context tokens reconstructed per pass (one forward and backward each)")
    pass_needs_gradients: ClassVar[bool] = True

    def pass_scores(self, query: torch.Tensor, key: torch.Tensor, chunk: PassChunk, scaling: float,
                    value: torch.Tensor | None = None, output_weight: torch.Tensor | None = None,
                    hidden_norm: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    lse_own: torch.Tensor | None = None, output_grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H_kv, L]``: ``max_{p, g} A_g(p, c) ||W_O^g v_c|| ||grad_{a_p} Phi||`` over this pass (0 on the
        entries it does not score)."""
        if value is None or output_weight is None or output_grad_norm is None:
            raise ValueError("KVgrad needs the pass's values, the layer's output projection weight and the norm of "
                             "the objective's gradient at each pass token (output_grad_norm): run it through "
                             "`with press(model)` or fan-out, which back-propagate through its passes")
        log_weight = -output_grad_norm.float().log()  # multiplying by ||grad||; a zero gradient scores 0
        return replay_scores(query, key, chunk, scaling, log_weight=log_weight, value=value,
                             output_weight=output_weight, lse=lse, lse_own=lse_own)
