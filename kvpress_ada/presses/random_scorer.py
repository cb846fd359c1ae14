"""Random eviction: the floor every method must beat."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, register_scorer


@register_scorer("random")
class RandomScorer(Scorer):
    """Uniform random scores, seeded per layer so runs are reproducible."""

    name: Literal["random"] = "random"
    seed: int = Field(0, ge=0)

    def query_window(self) -> int:
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + obs.layer_idx)
        scores = torch.rand(obs.keys.shape[:3], generator=generator)
        return scores.to(obs.keys.device)
