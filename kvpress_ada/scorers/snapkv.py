"""SnapKV (Li et al., 2024): window queries vote for the context keys, pooled to keep clusters."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..observation import Observation
from .attention import mean_over_queries, pool_scores, window_attention
from .base import WindowScorer, protect_last, register_scorer


@register_scorer("snapkv")
class SnapKV(WindowScorer):
    """Attention of the last ``window`` queries, averaged over the window and the query group,
    smoothed by 1-D average pooling of width ``kernel``; the window itself is always kept.

    Chunked prefill: the window is the last ``window`` queries of the chunk (all of them when the chunk is
    shorter); they vote for the kept entries and the chunk at every compression, so kept entries are
    re-scored by each new chunk. With the chunks aligned on the end of the context, the last compression
    uses the same window queries as the one-shot press."""

    name: Literal["snapkv"] = "snapkv"
    window: int = Field(64, ge=1, description="observation window (trailing queries)")
    kernel: int = Field(5, ge=1, description="average-pooling width")

    def score(self, obs: Observation) -> torch.Tensor:
        attn = window_attention(obs, self.window)  # [B, Hkv, G, w, L]
        scores = pool_scores(mean_over_queries(attn, obs.key_mask), self.kernel, obs.key_mask).mean(dim=2)
        return protect_last(scores, self.window)
