"""TOVA (Oren et al., 2024): keep the tokens the last query attends to most."""

from __future__ import annotations

from typing import Literal

import torch

from ..observation import Observation
from .attention import window_attention
from .base import Scorer, register_scorer


@register_scorer("tova")
class TOVA(Scorer):
    """Attention of the last query, averaged over the query group of each kv head.

    Chunked prefill: the last query of each chunk re-scores the kept entries and the chunk (TOVA's own
    streaming rule, applied once per chunk instead of once per token)."""

    name: Literal["tova"] = "tova"

    def query_window(self) -> int:
        return 1

    def score(self, obs: Observation) -> torch.Tensor:
        return window_attention(obs, 1)[:, :, :, 0].mean(dim=2)
