"""FINCH (Corallo and Papotti, TACL 2024): the prompt's question queries vote for the context keys, each query's
attention normalised by how many keys it sees."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..observation import Observation
from .attention import window_attention
from .base import WindowScorer, protect_last, register_scorer


@register_scorer("finch")
class Finch(WindowScorer):
    """Attention of the last ``window`` queries (the question, when the prompt ends with it), each query's
    weights multiplied by the number of valid keys it attends to (``normalize``: a query that sees fewer keys
    no longer weighs more), averaged over the window's valid queries and the query group; no pooling; the window
    itself is kept. The ``finch`` preset adds key re-rotation (``TopK(rerotate=True)``), as FINCH does.

    kvpress's ``FinchPress`` finds the question with a delimiter token it adds to the vocabulary (resizing the
    embeddings) and multiplies by the query's index (the keys it sees but one); here the window is a fixed
    number of trailing queries and the count is exact. Its optional per-chunk top-k is not reproduced: with
    ``prefill_chunk`` the window is each chunk's last queries, as for SnapKV."""

    name: Literal["finch"] = "finch"
    window: int = Field(64, ge=1, description="observation window (trailing queries: the question)")
    normalize: bool = Field(True, description="weight each query's attention by the number of keys it sees")

    def score(self, obs: Observation) -> torch.Tensor:
        attn = window_attention(obs, self.window)  # [B, H_kv, G, w, L]
        w = attn.shape[3]
        if self.normalize:
            seen = obs.key_mask.long().cumsum(-1)[:, -w:].to(attn.dtype)  # valid keys each window query sees
            attn = attn * seen[:, None, None, :, None]
        count = obs.key_mask[:, -w:].sum(-1).clamp(min=1).to(attn.dtype)  # the window's valid queries
        scores = (attn.sum(dim=3) / count[:, None, None, None]).mean(dim=2)
        return protect_last(scores, self.window)
