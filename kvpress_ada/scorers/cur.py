"""CurDKV (Sengupta et al., 2025, arXiv 2509.15038): keep the entries with the largest approximate CUR leverage
scores of the keys and values, squared row norms normalised within local windows."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, protect_first_valid, register_scorer
from .statistics import gaussian_sketch, ranks


def window_shares(x: torch.Tensor, mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """``x [B, H, L]`` (non-negative) divided by its sum over the entry's window: consecutive runs of ``window``
    valid entries (``mask [B, L]``) counted from the row's first (``None``: the whole row); zero where not valid."""
    B, H, L = x.shape
    m = mask[:, None, :].expand(B, H, L)
    x = x * m.to(x.dtype)
    if window is None:
        total = x.sum(dim=-1, keepdim=True)
    else:
        dump = L // window + 1  # segment of the padding
        seg = torch.where(m, ranks(m) // window, torch.full_like(m, dump, dtype=torch.long))
        total = torch.zeros(B, H, dump + 1, dtype=x.dtype, device=x.device).scatter_add_(-1, seg, x).gather(-1, seg)
    return x / total.clamp(min=torch.finfo(x.dtype).tiny)


@register_scorer("cur")
class CUR(Scorer):
    """Approximate leverage of each entry from squared row norms: ``k2 = ||k||^2`` and ``v2 = ||v||^2`` (after a
    seeded Gaussian projection to ``random_projection`` columns when set), each divided by its sum over a
    local window of ``local_window`` entries (``None``: left as they are); combined per ``leverage_type``
    (``kv_product``: ``k2 * v2``, ``kv_avg``: their mean, ``key`` or ``value`` alone), then divided by the
    head's sum. The first ``sinks`` tokens are protected.

    Differs from NVIDIA kvpress's ``CURPress`` (``kvpress/presses/cur_press.py``, 0.5.5), which this follows:
    windows start at a row's first valid token and padding is left out of every sum (kvpress: one unpadded
    row); the projection (kvpress: ``use_random_leverage``, 20 columns, a fresh draw per call) is drawn once
    from ``seed``; sinks get ``+inf`` where kvpress gives them 1.0, the largest share a token can have.

    Across heads: scores are shares of the head's total (they sum to 1 in every head), so raw scores are
    compared, as attention probabilities are.

    Chunked prefill and decode compression: windows and shares are recomputed over the kept entries and the new
    ones (windows of kept entries, no longer of consecutive tokens)."""

    name: Literal["cur"] = "cur"
    sinks: int = Field(4, ge=0, description="initial tokens always kept")
    leverage_type: Literal["key", "value", "kv_avg", "kv_product"] = "kv_product"
    local_window: int | None = Field(16, ge=1, description="entries per normalisation window (None: no "
                                                           "normalisation before combining)")
    random_projection: int | None = Field(None, ge=1, description="columns of a seeded Gaussian projection of keys "
                                                                  "and values before the norms (None: none)")
    seed: int = Field(0, ge=0, description="seed of the projection")
    comparable_across_heads: ClassVar[bool] = True

    def query_window(self) -> int:
        return 0

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks)

    def score(self, obs: Observation) -> torch.Tensor:
        keys, values = obs.keys.float(), obs.values.float()
        if self.random_projection is not None:
            proj = gaussian_sketch(keys.shape[-1], self.random_projection, self.seed, str(keys.device))
            keys, values = keys @ proj, values @ proj
        k2, v2 = keys.square().sum(-1), values.square().sum(-1)
        if self.local_window is not None:
            k2 = window_shares(k2, obs.key_mask, self.local_window)
            v2 = window_shares(v2, obs.key_mask, self.local_window)
        scores = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[self.leverage_type]
        scores = window_shares(scores, obs.key_mask, None)
        return protect_first_valid(scores, obs.key_mask, self.sinks)
