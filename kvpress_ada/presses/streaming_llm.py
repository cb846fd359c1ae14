"""StreamingLLM (Xiao et al., 2024): attention sinks plus the most recent tokens."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, protect_first_valid, register_scorer


@register_scorer("streaming_llm")
class StreamingLLM(Scorer):
    """Keeps the first ``sinks`` tokens and then the most recent ones (score = position)."""

    name: Literal["streaming_llm"] = "streaming_llm"
    sinks: int = Field(4, ge=0, description="number of initial tokens always kept")

    def query_window(self) -> int:
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        B, H, L = obs.keys.shape[:3]
        position = torch.arange(L, device=obs.keys.device, dtype=torch.float32)
        scores = position.expand(B, H, L).clone()
        return protect_first_valid(scores, obs.key_mask, self.sinks)
