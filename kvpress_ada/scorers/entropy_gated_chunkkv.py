"""Entropy-gated ChunkKV (NVIDIA kvpress's ``EntropyGatedChunkKVPress``, after ChunkKV: Liu et al., 2025, arXiv
2502.00299): chunks are taken in decreasing order of their mean score, but an important chunk whose score sits on a
few tokens keeps only those, and the budget it frees goes to further chunks.

Per ranking (a batch row, its kv heads' scores summed with ``shared``; else each kv head), over chunks of
``length`` consecutive entries counted from the most recent (ChunkKV's chunks; the first may be short):

* a chunk's score is the mean of its entries' scores, its entropy the normalised entropy ``H(p) / log(n)`` of
  ``p_i = s'_i / (sum s' + 1e-8)`` with ``s' = s - min(min s, 0)`` (0 for a chunk of one entry);
* a chunk whose score is at least the median chunk score and whose entropy is below the median entropy (lower
  medians, as ``torch.median``) is *spiky*: only its ``low_entropy_length`` best entries are taken with it;
* the order kept: chunks by decreasing score, each chunk's (taken) entries by decreasing score, then the spiky
  chunks' other entries by decreasing score (kvpress's top-up).

kvpress walks that order until its budget is spent; here the order is written as scores (strictly decreasing
along it, more than the tie tolerance apart), so a top-k of any size keeps exactly that walk's entries and the
pipeline keeps its exact budget. The score at the ``j``-th place is the ``j``-th best chunk mean of the ranking
(ChunkKV's score of an entry), so an Ada allocator splits a layer's budget across heads as it would for
ChunkKV(shared=False), and each head keeps its gated walk of that size. Entries the wrapped scorer protects
(``+inf``) stay protected; in a chunk's statistics each counts as the ranking's largest finite score (kvpress's
SnapKV gives its window the largest score plus one).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from ..observation import Observation
from .base import register_scorer
from .chunkkv import ChunkKV, chunk_means

EPSILON = 1e-8  # kvpress's: in the shares' denominator and inside the entropy's log
#: relative gap between consecutive scores of the order: above the top-k's tie tolerance (1e-5)
_GAP = 2e-5


@register_scorer("entropy_gated_chunkkv")
class EntropyGatedChunkKV(ChunkKV):
    """ChunkKV whose spiky important chunks keep only their ``low_entropy_length`` best entries (see the module
    docstring); wraps any scorer without a model pass of its own (default SnapKV). ``shared``: one order for all
    kv heads of a layer (kvpress's); ``False``: each kv head its own (what Ada compares)."""

    name: Literal["entropy_gated_chunkkv"] = "entropy_gated_chunkkv"  # type: ignore[assignment]
    length: int = Field(10, ge=1, description="entries per chunk")
    low_entropy_length: int = Field(4, ge=1, description="entries a spiky important chunk keeps")

    @model_validator(mode="after")
    def _lengths(self) -> "EntropyGatedChunkKV":
        if not self.length > self.low_entropy_length >= 1:
            raise ValueError(f"EntropyGatedChunkKV needs length > low_entropy_length >= 1, got length={self.length}, "
                             f"low_entropy_length={self.low_entropy_length}")
        return self

    def score(self, obs: Observation) -> torch.Tensor:
        whole = obs.shard is not None and obs.n_kv_heads == obs.shard.n_local  # the layer's heads span ranks
        shard = obs.shard if whole else None
        scores = self.scorer.score(obs).float()
        if shard is not None:
            scores = shard.gather(scores)
        gated = gated_order_scores(scores, obs.key_mask, self.length, self.low_entropy_length, self.shared)
        return gated if shard is None else shard.local(gated)


def gated_order_scores(scores: torch.Tensor, key_mask: torch.Tensor, length: int, low: int,
                       shared: bool) -> torch.Tensor:
    """``[B, H, L]``: scores whose top-k of any size is the entropy-gated walk (module docstring) of ``scores
    [B, H, L]`` over the valid entries of ``key_mask [B, L]``, the ``j``-th place of a ranking scored by its
    ``j``-th best ChunkKV score; ``+inf`` entries, padding and entries scored ``-inf`` or NaN keep their scores."""
    B, H, L = scores.shape
    s = scores.float()  # the walk's statistics in float32, as kvpress computes them (a near tie then falls alike)
    protected = key_mask[:, None, :] & (s == math.inf)
    usable = key_mask[:, None, :] & (torch.isfinite(s) | protected)
    finite = torch.where(usable & ~protected, s, torch.full_like(s, -math.inf))
    means = chunk_means(s, key_mask, length, shared).double()  # ChunkKV's scores: the magnitudes
    means = torch.where(usable & ~protected, means, torch.full_like(means, -math.inf))
    if shared:  # one ranking per row: protected entries count as the row's best score, heads summed
        best = finite.amax(dim=(1, 2), keepdim=True)
        best = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
        rows = torch.where(protected, best, torch.where(usable, s, torch.zeros_like(s))).sum(1)  # [B, L]
        mask = usable.all(1) & key_mask
        means = means.amax(1)  # the row's shared mean (an entry protected in every head: -inf)
        chunk_mask = key_mask
    else:
        best = finite.amax(dim=2, keepdim=True)
        best = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
        rows = torch.where(protected, best, torch.where(usable, s, torch.zeros_like(s))).reshape(B * H, L)
        mask, means = usable.reshape(B * H, L), means.reshape(B * H, L)
        chunk_mask = key_mask[:, None, :].expand(B, H, L).reshape(B * H, L)
    place = _walk(rows, mask, chunk_mask, length, low)
    placed = mask & torch.isfinite(means)  # protected entries keep +inf: the others are placed after them
    order = torch.argsort(torch.where(placed, place, torch.full_like(place, 2 * L)), dim=1)
    place = torch.empty_like(order).scatter_(1, order, torch.arange(L, device=s.device).expand_as(order))
    base = torch.where(placed, means, torch.full_like(means, -math.inf)).sort(dim=1, descending=True).values
    group = 1 if shared else H
    values = _strictly_decreasing(base.view(B, group, L), placed.view(B, group, L)).view(B * group, L)
    out = torch.where(placed, values.gather(1, place.clamp(max=L - 1)), torch.zeros_like(values)).view(B, group, L)
    placed = placed.view(B, group, L)
    return torch.where(placed & usable & ~protected, out.expand(B, H, L).float(), s)


def _walk(y: torch.Tensor, mask: torch.Tensor, chunk_mask: torch.Tensor, length: int, low: int) -> torch.Tensor:
    """``[R, L]`` long: each entry's place in the gated walk of rows ``y [R, L]`` over the entries of
    ``mask``, chunks of ``length`` entries of ``chunk_mask`` counted from the end (entries outside ``mask`` last)."""
    R, L = y.shape
    from_end = chunk_mask.long().flip(-1).cumsum(-1).flip(-1) - 1
    n_chunks = L // length + 1
    chunk = (from_end.clamp(min=0) // length).masked_fill(~mask, n_chunks)  # entries left out: a chunk of their own
    weight = mask.to(y.dtype)
    values = torch.where(mask, y, torch.zeros_like(y))

    def per_chunk(x: torch.Tensor) -> torch.Tensor:
        return y.new_zeros(R, n_chunks + 1).scatter_add_(1, chunk, x)[:, :n_chunks]

    count = per_chunk(weight)
    real = count > 0
    mean = per_chunk(values) / count.clamp(min=1)
    lowest = torch.where(mask, y, torch.full_like(y, math.inf))
    low_point = y.new_zeros(R, n_chunks + 1).scatter_reduce(1, chunk, lowest, "amin", include_self=False)[:, :n_chunks]
    shift = low_point.clamp(max=0.0).nan_to_num(0.0, posinf=0.0)
    shifted = torch.where(mask, y - shift.gather(1, chunk.clamp(max=n_chunks - 1)), torch.zeros_like(y))
    p = shifted / (per_chunk(shifted) + EPSILON).gather(1, chunk.clamp(max=n_chunks - 1))
    entropy = per_chunk(torch.where(mask, -p * (p + EPSILON).log(), torch.zeros_like(p)))
    entropy = torch.where(count > 1, entropy / count.clamp(min=2).log(), torch.zeros_like(entropy)).clamp(0.0, 1.0)
    spiky = real & (mean >= _lower_median(mean, real)) & (entropy < _lower_median(entropy, real))

    rank = _descending_rank(y, mask)  # over the row, ties to the most recent
    # place within its chunk by decreasing score
    grouped = torch.argsort(chunk * (L + 1) + rank, dim=1)
    at = torch.empty_like(grouped).scatter_(1, grouped, torch.arange(L, device=y.device).expand(R, L))
    start = torch.cumsum(count, 1) - count  # entries of the chunks before (chunk 0 first)
    within = at - start.long().gather(1, chunk.clamp(max=n_chunks - 1))
    # chunks by decreasing mean, ties to the most recent (chunk 0 is the most recent)
    chunk_order = torch.argsort(torch.where(real, -mean, torch.full_like(mean, math.inf)), dim=1, stable=True)
    chunk_place = torch.empty_like(chunk_order).scatter_(1, chunk_order, torch.arange(n_chunks, device=y.device)
                                                         .expand(R, n_chunks))
    taken = mask & (~spiky.gather(1, chunk.clamp(max=n_chunks - 1)) | (within < low))
    first = chunk_place.gather(1, chunk.clamp(max=n_chunks - 1)) * (length + 1) + within
    later = (n_chunks + 1) * (length + 1) + rank
    key = torch.where(taken, first, torch.where(mask, later, torch.full_like(later, 4 * (n_chunks + 2) * (L + 1))))
    place = torch.empty_like(key).scatter_(1, torch.argsort(key, dim=1),
                                           torch.arange(L, device=y.device).expand(R, L))
    return place


def _lower_median(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``[R, 1]``: ``torch.median`` (the lower of two middle values) of each row's ``x`` where ``real``."""
    ordered = torch.where(real, x, torch.full_like(x, math.inf)).sort(dim=1).values
    k = ((real.sum(1, keepdim=True) - 1) // 2).clamp(min=0)
    return ordered.gather(1, k)


def _descending_rank(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[R, L]`` long: each entry's rank by decreasing ``y`` among ``mask`` (ties: the later entry first); entries
    outside ``mask`` after them."""
    L = y.shape[1]
    key = torch.where(mask, y, torch.full_like(y, -math.inf)).flip(1)
    order = torch.argsort(-key, dim=1, stable=True)  # in flipped positions: ties keep the later entry first
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(L, device=y.device).expand_as(order))
    return rank.flip(1)


def _strictly_decreasing(base: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, G, L]``: for each ranking's places ``0 .. n - 1`` (``n`` its entries of ``mask``), a positive score
    below the one before by a relative ``_GAP`` at least, equal to the sorted ``base [B, G, L]`` where that
    already holds; shifted by one amount per batch row (every ranking of a row compares alike after it)."""
    B, G, L = base.shape
    n = mask.sum(-1, keepdim=True)  # [B, G, 1]
    place = torch.arange(L, device=base.device, dtype=torch.float64)
    inside = place < n
    finite = torch.where(inside, base, torch.full_like(base, math.nan))
    lo = finite.nan_to_num(math.inf).amin(dim=(1, 2), keepdim=True)
    hi = finite.nan_to_num(-math.inf).amax(dim=(1, 2), keepdim=True)
    lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))
    hi = torch.where(torch.isfinite(hi), hi, torch.zeros_like(hi))
    floor = torch.maximum((hi - lo).abs(), torch.maximum(hi.abs(), lo.abs())).clamp(min=1e-30) * 1e-3
    positive = torch.where(inside, base - lo + floor, floor)
    logs = positive.log() + place * _GAP
    return (torch.cummin(logs, dim=-1).values - place * _GAP).exp()
