"""Compactor (Chari and Van Durme, 2025, arXiv 2507.08143): z-scored leverage scores of the pre-RoPE keys blended
with z-scored non-causal chunked attention, the first and last tokens kept."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, register_scorer
from .leverage import leverage_scores
from .non_causal_attention import non_causal_scores
from .statistics import ranks, row_zscore


@register_scorer("compactor")
class Compactor(Scorer):
    """Score = ``blending * z(leverage) + z(non-causal attention)`` over a row's inner tokens (all but its first
    ``sinks_start`` and last ``sinks_end``, which are protected): :class:`~.leverage.Leverage`'s ridge leverage
    of the pre-RoPE keys and :class:`~.non_causal_attention.NonCausalAttention`'s scores, both computed on the
    inner tokens alone and each z-scored per row over every head's inner tokens.

    Differs from NVIDIA kvpress's ``CompactorPress`` (``kvpress/presses/compactor_press.py``, 0.5.5), which this
    follows: ``blending`` is a number (kvpress sets it to the press's compression ratio, which a scorer here never
    sees: the same scores serve a ratio, a budget and model-scope allocation; 0.5 by default, the blending of
    the authors' ``compactor-vllm`` engine; give ``blending=r`` to match kvpress at ratio ``r``); the kept
    tokens get ``+inf`` (kvpress: the layer's maximum score); the leverage sketch is seeded and the parts
    differ as :class:`~.leverage.Leverage` and :class:`~.non_causal_attention.NonCausalAttention` say.

    The whole context is read at once (chunked prefill and decode compression are refused). Across heads: the
    attention part carries each head's ``||v||`` scale, so raw scores are not compared."""

    name: Literal["compactor"] = "compactor"
    sinks_start: int = Field(8, ge=0, description="initial tokens always kept")
    sinks_end: int = Field(4, ge=0, description="final tokens always kept")
    chunk_size: int = Field(256, ge=1, description="tokens per chunk of non-causal attention")
    sketch_dimension: int | None = Field(48, ge=1, description="columns of the leverage's Gaussian sketch "
                                                               "(None: no sketch)")
    blending: float = Field(0.5, ge=0.0, description="weight of the z-scored leverage against the z-scored attention")
    ridge: float = Field(1e-2, gt=0.0, description="added to the Gram matrix's diagonal before the Cholesky factor")
    seed: int = Field(0, ge=0, description="seed of the Gaussian sketch")
    comparable_across_heads: ClassVar[bool] = False
    needs_rope: ClassVar[bool] = True
    supports_chunked_prefill: ClassVar[bool] = False

    def query_window(self) -> None:
        return None

    def min_context(self) -> int:
        return self.sinks_start + self.sinks_end + 2

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks_start + self.sinks_end)

    def score(self, obs: Observation) -> torch.Tensor:
        n = obs.valid_lengths()[:, None]
        rank = ranks(obs.key_mask)
        start = n.clamp(max=self.sinks_start)
        end = (n - start).clamp(min=0, max=self.sinks_end)
        inner = obs.key_mask & (rank >= start) & (rank < n - end)
        full = inner[:, None, :].expand(obs.keys.shape[:3])
        lev = leverage_scores(obs, inner, self.sketch_dimension, self.ridge, self.seed)
        lev = row_zscore(lev, full, shard=obs.shard)
        attn = row_zscore(non_causal_scores(obs, inner, self.chunk_size), full, shard=obs.shard)
        return torch.where(full, self.blending * lev + attn, torch.full_like(attn, float("inf")))
