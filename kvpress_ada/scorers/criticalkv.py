"""CriticalKV (Feng et al., 2025, "Identify Critical KV Cache in LLM Inference from an Output
Perturbation Perspective"): an entry matters by the attention it gets *and* by how much its
value moves the layer output, i.e. the norm of the value projected through ``W_o``."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..observation import Observation
from .attention import mean_over_queries, pool_scores, window_attention
from .base import WindowScorer, protect_last, register_scorer


@register_scorer("criticalkv")
class CriticalKV(WindowScorer):
    """SnapKV's window attention per query head, reweighted by ``||W_o^h v||_1`` for that head,
    averaged over the query group, pooled, window protected.

    Chunked prefill: as SnapKV (the chunk's trailing queries re-score the kept entries and the chunk);
    when kv heads are scored one at a time, ``output_weight`` holds that head's query group."""

    name: Literal["criticalkv"] = "criticalkv"
    window: int = Field(64, ge=1, description="observation window (trailing queries)")
    kernel: int = Field(5, ge=1, description="average-pooling width")
    needs_output_weight: ClassVar[bool] = True

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.output_weight is None:
            raise ValueError("CriticalKV needs the layer's output projection (obs.output_weight)")
        attn = mean_over_queries(window_attention(obs, self.window), obs.key_mask)  # [B, Hkv, G, L]
        B, Hkv, G, L = attn.shape
        D = obs.keys.shape[-1]
        w_o = obs.output_weight.float().view(-1, Hkv, G, D)  # [hidden, Hkv, G, D]
        projected = torch.einsum("bhld,ohgd->bhglo", obs.values.float(), w_o)
        weight = projected.abs().sum(dim=-1)  # [B, Hkv, G, L]
        scores = pool_scores(attn * weight, self.kernel, obs.key_mask).mean(dim=2)
        return protect_last(scores, self.window)
