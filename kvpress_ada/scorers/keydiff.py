"""KeyDiff (Park et al., 2025, arXiv 2504.15364): keep the keys least similar to the mean key."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from ..observation import Observation
from .base import Scorer, register_scorer


@register_scorer("keydiff")
class KeyDiff(Scorer):
    """Score = ``-cos(k_i, anchor)`` per kv head, with the anchor the mean of the L2-normalised keys
    (the paper's ``mu(K_hat) = 1/n sum_i k_i / ||k_i||``; NVIDIA kvpress's ``KeyDiffPress``,
    ``kvpress/presses/keydiff_press.py`` commit 08a43bf, averages the normalised keys over the whole
    sequence of its single, unpadded row). Here the mean runs over the row's valid keys only, so
    left padding changes nothing; no sinks, no window (neither source has them), no queries.

    Across heads: cosine similarity is scale-free and bounded in ``[-1, 1]`` with the same meaning
    in every head (how redundant a key is among its head's keys), so raw scores are compared; Ada
    then gives fewer tokens to heads whose keys all point the same way, in line with the paper's
    aim of keeping a diverse cache.

    Chunked prefill: the anchor is the mean over the kept entries and the chunk (the running cache),
    so kept entries are re-scored against it at every compression."""

    name: Literal["keydiff"] = "keydiff"
    comparable_across_heads: ClassVar[bool] = True

    def query_window(self) -> int:
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        keys = obs.keys.float()
        valid = obs.key_mask[:, None, :, None]
        unit = torch.where(valid, F.normalize(keys, p=2, dim=-1), torch.zeros_like(keys))
        anchor = unit.sum(dim=2, keepdim=True) / obs.valid_lengths().clamp(min=1)[:, None, None, None]
        return -F.cosine_similarity(keys, anchor, dim=-1)
