"""LagKV (Liang et al., 2025, arXiv 2504.04704): a partition's keys and values, min/max-normalised by
the next partition, are scored by their spread over channels; attention free."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, register_scorer


@register_scorer("lagkv")
class LagKV(Scorer):
    """Lag-relative scores, as the paper and NVIDIA kvpress's ``LagKVPress``
    (``kvpress/presses/lagkv_press.py``, commit 08a43bf) define them.

    The valid tokens of a row after its first ``sinks`` are cut into partitions of ``lag`` tokens.
    Partition ``p`` is normalised per channel by the min/max over the tokens of partition ``p + 1``
    (``(x - min) / (max - min)``), separately for keys and values; a token's spread is the standard
    deviation of its normalised vector over the channels (unbiased, as ``torch.std``); the spreads
    of a partition go through a softmax over its tokens, and the key and value softmaxes are
    averaged (the paper sums them: same order). By default (``cross_scoring=False``) the score is
    the token's rank within its partition divided by ``lag`` (kvpress: ``argsort().argsort() / lag``),
    so every partition contributes the same fraction of its tokens, as the paper's per-partition
    top-k does; ``cross_scoring=True`` keeps the averaged softmax itself (kvpress's option "useful
    with AdaKVPress"), a token's share of its partition, so partitions and heads compete.

    Always kept: the sinks (``+inf``), and the last full partition together with the incomplete
    remainder (they have no reference partition; kvpress's ``tail_len = lag + remainder``), scored
    ``TAIL``, above every partition score but below the sinks. kvpress scores both 1 and lets
    ``topk`` break the tie; when a budget is smaller than sinks + tail (r = 0.75 at 1k tokens with
    the defaults: 4 + 253 > 256), ours keeps the sinks, then the most recent tail tokens, instead of
    dropping the first sink (a protected-only tie goes to the more recent token).
    Short contexts, fewer than ``sinks + 2 * lag`` valid tokens (no partition has a reference): the
    paper does not compress; kvpress, which must still meet the ratio, keeps the sinks and scores
    the rest by recency, ``i / (n - sinks)``; so do we. Partitions start at each row's first valid
    token: ranks among valid tokens, never absolute positions, so left padding changes nothing.
    A reference channel with no range (``max == min``, where kvpress divides by zero) contributes 0.

    Across heads: rank scores are the same ``{0, 1/lag, ..., (lag-1)/lag}`` in every head and
    partition (same scale, but no information for Ada, which then stays near uniform);
    ``cross_scoring`` scores are shares of a partition's mass (sum 1 per partition in every head),
    which Ada can compare; ``ada_lagkv`` uses them.

    Chunked prefill: partitions are cut over the running cache (kept entries, then the chunk), so a
    kept entry is re-scored against its neighbours in the compacted cache; the chunk's tail partition
    is protected at every compression."""

    name: Literal["lagkv"] = "lagkv"
    comparable_across_heads: ClassVar[bool] = True
    TAIL: ClassVar[float] = 2.0  # > every rank (< 1), share (<= 1) and recency (< 1) score
    lag: int = Field(128, ge=1, description="partition size (kvpress lag_size)")
    sinks: int = Field(4, ge=0, description="initial tokens always kept (kvpress n_sink)")
    cross_scoring: bool = Field(False, description="keep the softmax shares instead of ranks within partitions")

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks)

    def query_window(self) -> int:
        return 0

    def partition_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``[B, H, P, lag, D]`` partitions -> ``[B, H, P - 1, lag]`` scores of all but the last."""
        share = (_lag_relative_spread(keys) + _lag_relative_spread(values)) / 2
        if self.cross_scoring:
            return share
        return share.argsort(dim=-1, stable=True).argsort(dim=-1).float() / self.lag

    def score(self, obs: Observation) -> torch.Tensor:
        keys, values, mask = obs.keys.float(), obs.values.float(), obs.key_mask
        B, H, L, D = keys.shape
        S, lag = self.sinks, self.lag
        # valid tokens first, in order: aligned position j is the row's j-th valid token
        order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True)  # [B, L]
        gather = order[:, None, :, None].expand(B, H, L, D)
        keys, values = keys.gather(2, gather), values.gather(2, gather)

        n = mask.sum(-1)[:, None, None]  # [B, 1, 1] valid tokens
        n_parts = torch.div(n - S, lag, rounding_mode="floor").clamp(min=0)  # full partitions per row
        j = torch.arange(L, device=keys.device)[None, None, :]
        part = torch.div(j - S, lag, rounding_mode="floor")

        lag_scores = torch.zeros(B, H, L, device=keys.device)
        p_max = max(0, (L - S) // lag)
        if p_max >= 2:
            span = slice(S, S + p_max * lag)
            scored = self.partition_scores(keys[:, :, span].reshape(B, H, p_max, lag, D),
                                           values[:, :, span].reshape(B, H, p_max, lag, D))
            lag_scores[:, :, S:S + (p_max - 1) * lag] = scored.reshape(B, H, -1)
        recency = (j - S).float() / (n - S).clamp(min=1).float()  # short contexts: kvpress's fallback
        inf = torch.full_like(lag_scores, float("inf"))
        tail = torch.full_like(lag_scores, self.TAIL)
        long_scores = torch.where(part < n_parts - 1, lag_scores, tail)  # tail: last partition + remainder
        aligned = torch.where(n_parts >= 2, long_scores, recency.expand(B, H, L))
        aligned = torch.where(j < S, inf, aligned)
        aligned = torch.where(j < n, aligned, torch.zeros_like(aligned))  # padding (masked by the pipeline)
        return torch.empty_like(aligned).scatter_(2, order[:, None, :].expand(B, H, L), aligned)


def _lag_relative_spread(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, P, lag, D]`` -> ``[B, H, P - 1, lag]``: softmax over each partition's tokens of the
    channel std of its states normalised by the next partition's per-channel min/max."""
    ref, cur = x[:, :, 1:], x[:, :, :-1]
    low = ref.amin(dim=-2, keepdim=True)
    rng = ref.amax(dim=-2, keepdim=True) - low
    flat = rng == 0
    normed = torch.where(flat, torch.zeros_like(cur), (cur - low) / rng.masked_fill(flat, 1.0))
    spread = normed.std(dim=-1, correction=1 if x.shape[-1] > 1 else 0)
    return spread.softmax(dim=-1)
