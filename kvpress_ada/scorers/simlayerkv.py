"""SimLayerKV (Zhang et al., ICLR 2025, arXiv 2410.13846): "lazy" layers, whose last queries attend almost only to
the initial and recent tokens, keep only those; the other layers keep everything."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..observation import Observation
from .attention import window_attention
from .base import Scorer, register_scorer

#: score of an entry a lazy layer may drop (below any threshold >= 0; more recent entries score higher)
_DROPPABLE = -1.0


@register_scorer("simlayerkv")
class SimLayerKV(Scorer):
    """A layer of a batch row is lazy when its last ``n_last`` queries give more than ``lazy_threshold`` of their
    attention (averaged over the queries and every head) to the first ``n_initial`` and last ``n_recent`` valid
    entries; those entries are then protected (``+inf``) and the others score ``-1 - (valid entries after
    them)`` (the more recent the higher); in a layer that is not lazy every entry is protected. With the
    ``simlayerkv`` preset's ``Threshold(tau=0)`` a lazy layer keeps exactly its initial and recent entries and
    any other layer keeps everything: how much is evicted follows from the input (a ``compression_ratio`` only
    caps each head). Under any other allocator the protected entries come first, then the most recent.

    kvpress decides for the whole batch (the mean over its rows) and keeps ``n_recent - n_last`` recent entries;
    here each row decides alone (padding changes nothing) and keeps ``n_recent``."""

    name: Literal["simlayerkv"] = "simlayerkv"
    lazy_threshold: float = Field(0.9, ge=0.0, le=1.0, description="attention share above which a layer is lazy "
                                                                   "(1: never lazy)")
    n_last: int = Field(1, ge=1, description="last queries whose attention decides")
    n_recent: int = Field(1024, ge=0, description="recent entries a lazy layer keeps")
    n_initial: int = Field(4, ge=0, description="initial entries (sinks) a lazy layer keeps")

    def query_window(self) -> int:
        return self.n_last

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.n_initial + self.n_recent)

    def score(self, obs: Observation) -> torch.Tensor:
        B, H, L = obs.keys.shape[:3]
        rank = obs.key_mask.long().cumsum(-1)  # 1-based among the valid entries
        after = obs.key_mask.sum(-1, keepdim=True) - rank  # valid entries after this one
        kept = obs.key_mask & ((rank <= self.n_initial) | (after < self.n_recent))  # [B, L]
        w = min(self.n_last, obs.queries.shape[2])
        attn = window_attention(obs, w)  # [B, H, G, w, L]
        queries = obs.key_mask[:, L - w:].sum(-1).clamp(min=1)  # the window's valid queries per row
        per_head = attn.sum(3).mean(2)  # [B, H, L]
        if obs.shard is not None and H == obs.shard.n_local:  # tensor parallelism: every rank's heads decide
            per_head = obs.shard.gather(per_head)
        share = per_head.mean(1) / queries[:, None]  # [B, L]: mean over heads and queries
        lazy = (share * kept).sum(-1) > self.lazy_threshold  # [B]
        scores = torch.where(kept | ~lazy[:, None], float("inf"), _DROPPABLE - after.float())
        return scores[:, None, :].expand(B, H, L).clone()
