"""H2O (Zhang et al., 2023): heavy hitters = keys that received the most attention during prefill."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..observation import Observation
from .attention import window_attention
from .base import Scorer, protect_last, register_scorer


@register_scorer("h2o", aliases=("observed_attention",))
class ObservedAttention(Scorer):
    """Accumulated attention each key received from every prefill query (mean over the query
    group); the ``recent`` most recent tokens are protected. Computed in query chunks of
    ``chunk`` so the full ``L x L`` matrix is never held. Registered as ``h2o`` (its preset's name;
    the old name ``observed_attention`` still loads); ``H2O`` is the same class.

    Chunked prefill: the queries handed over are the last ones of the keys (the chunk's), so each
    compression scores the kept entries and the chunk by the attention of the chunk's queries only;
    earlier chunks' votes are not carried over (entries kept earlier are re-scored from scratch)."""

    name: Literal["h2o"] = "h2o"
    recent: int = Field(0, ge=0, description="most recent tokens always kept")
    chunk: int = Field(512, ge=1, description="queries per chunk when accumulating attention")

    def query_window(self) -> None:
        return None

    def min_context(self) -> int:
        return max(self.recent, 1)

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.recent)

    def score(self, obs: Observation) -> torch.Tensor:
        L, Q = obs.seq_len, obs.queries.shape[2]
        B, Hkv = obs.keys.shape[:2]
        total = torch.zeros(B, Hkv, L, device=obs.keys.device, dtype=torch.float32)
        for start in range(0, Q, self.chunk):  # the queries sit at the last Q key positions
            stop = min(start + self.chunk, Q)
            q = obs.queries[:, :, start:stop]
            attn = _chunk_attention(obs, q, L - Q + stop)
            total += attn.sum(dim=3).mean(dim=2)
        return protect_last(total, self.recent)


H2O = ObservedAttention


def _chunk_attention(obs: Observation, q: torch.Tensor, stop: int) -> torch.Tensor:
    """Attention of queries ending at position ``stop - 1`` over all keys (causal)."""
    w = q.shape[2]
    keys, key_mask = obs.keys[:, :, :stop], obs.key_mask[:, :stop]
    sub = Observation(keys=keys, values=obs.values[:, :, :stop], queries=q, key_mask=key_mask,
                      layer_idx=obs.layer_idx, n_layers=obs.n_layers, scaling=obs.scaling)
    attn = window_attention(sub, w)
    return torch.nn.functional.pad(attn, (0, obs.seq_len - stop))
