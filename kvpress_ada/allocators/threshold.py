"""Threshold budgets: keep every entry whose score clears ``tau`` instead of a fixed share.

As in DMS-style thresholding (KVzap, Jégou and Jeblick 2026, arXiv 2601.07891, with kvpress's
``DMSPress``): the cache is as small as each input allows, ragged per head and per layer. The
pipeline's budget, when it has one (``compression_ratio`` or ``budget``; the layer schedule's
per-head budget in each layer), is a cap per head; without one nothing caps the heads.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .heads import HeadAllocator, register_allocator


@register_allocator("threshold")
class Threshold(HeadAllocator):
    """Each kv head keeps its entries scored ``>= tau`` (protected ``+inf`` entries always clear it),
    at least ``floor`` entries (its best ones, or all it holds when fewer), at most the layer's
    per-head budget: ``counts = min(max(#{s >= tau}, min(floor, valid)), budget)``. Counts of a head
    depend on its own scores only. Scores must share one scale across heads and layers for one
    ``tau`` to mean the same everywhere (e.g. a surrogate's log scores)."""

    name: Literal["threshold"] = "threshold"
    tau: float = Field(allow_inf_nan=False, description="keep every entry whose score is at least this (finite)")
    floor: int = Field(1, ge=0, description="entries each kv head keeps at least (its best ones)")

    head_local: ClassVar[bool] = True
    sets_budget: ClassVar[bool] = True  # the scores decide how much is kept; a pipeline budget only caps

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, comparable: bool = True) -> torch.Tensor:
        valid = (scores > float("-inf")).sum(-1)
        above = (scores >= self.tau).sum(-1)
        counts = torch.maximum(above, torch.minimum(valid, torch.full_like(valid, self.floor)))
        return torch.minimum(counts, budget.long()[:, None].to(counts.device))
