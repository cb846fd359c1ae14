"""StreamingLLM (Xiao et al., 2024): attention sinks plus the most recent tokens."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, protect_first_valid, register_scorer


@register_scorer("streamingllm", aliases=("streaming_llm",))
class StreamingLLM(Scorer):
    """Keeps the first ``sinks`` tokens and then the most recent ones (score = position among the
    valid tokens, so left padding changes nothing). Registered as ``streamingllm`` (the old name
    ``streaming_llm`` still loads).

    Chunked prefill: ranks in the running cache keep the order of positions and the sinks are
    protected, so the chunked press keeps the same positions as the one-shot press (sinks and most recent tokens)."""

    name: Literal["streamingllm"] = "streamingllm"
    sinks: int = Field(4, ge=0, description="number of initial tokens always kept")

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks)

    def query_window(self) -> int:
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        B, H, L = obs.keys.shape[:3]
        position = obs.key_mask.long().cumsum(-1).sub(1).clamp(min=0).float()  # rank among valid tokens
        scores = position[:, None, :].expand(B, H, L).clone()
        return protect_first_valid(scores, obs.key_mask, self.sinks)
