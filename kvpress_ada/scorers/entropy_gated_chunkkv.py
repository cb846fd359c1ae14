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

kvpress walks that order until its budget is spent; here the walk is written as scores that never rise along it,
so a top-k of any size keeps that walk's entries and the pipeline keeps its exact budget. An entry taken with its
chunk scores the chunk's mean (ChunkKV's score: what an Ada allocator compares across heads), a spiky chunk's
other entry its own score; wherever the walk orders two entries by more than the top-k's tie tolerance (1e-5,
relative) the later one scores lower by a relative step of 2e-5, so the top-k keeps exactly the walk's order; a
float tie (two scores, two chunk means, a mean or an entropy at the median, within that tolerance) stays a tie,
decided by position alike whatever rounding produced it (a padded row, another process's heads): there the kept set
may differ from kvpress's, which decides it by the rounding. Entries the wrapped scorer protects (``+inf``) stay
protected; in a chunk's statistics each counts as the ranking's largest finite score (kvpress's SnapKV gives its
window the largest score plus one).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from ..observation import Observation
from ..ranking import TIE_RTOL
from .base import register_scorer
from .chunkkv import ChunkKV

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
    [B, H, L]`` over the valid entries of ``key_mask [B, L]``; ``+inf`` entries, padding and entries scored ``-inf``
    or NaN keep their scores."""
    B, H, L = scores.shape
    s = scores.float()  # the walk's statistics in float32, as kvpress computes them
    protected = key_mask[:, None, :] & (s == math.inf)
    usable = key_mask[:, None, :] & (torch.isfinite(s) | protected)
    finite = torch.where(usable & ~protected, s, torch.full_like(s, -math.inf))
    if shared:  # one ranking per row: protected entries count as the row's best score, heads summed
        best = finite.amax(dim=(1, 2), keepdim=True)
        best = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
        rows = torch.where(protected, best, torch.where(usable, s, torch.zeros_like(s))).sum(1)  # [B, L]
        mask, kept = usable.all(1) & key_mask, protected.all(1)
        chunk_mask = key_mask
    else:
        best = finite.amax(dim=2, keepdim=True)
        best = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
        rows = torch.where(protected, best, torch.where(usable, s, torch.zeros_like(s))).reshape(B * H, L)
        mask, kept = usable.reshape(B * H, L), protected.reshape(B * H, L)
        chunk_mask = key_mask[:, None, :].expand(B, H, L).reshape(B * H, L)
    placed = mask & ~kept  # protected entries keep +inf: the others are placed after them, in the walk's order
    group = 1 if shared else H
    values = _walk_scores(rows, mask, placed, chunk_mask, length, low)  # [B * group, L]
    out = values.view(B, group, L).expand(B, H, L)
    return torch.where(placed.view(B, group, L) & usable & ~protected, out.float(), s)


def _walk_scores(y: torch.Tensor, mask: torch.Tensor, placed: torch.Tensor, chunk_mask: torch.Tensor, length: int,
                 low: int) -> torch.Tensor:
    """``[R, L]`` float64: the score of each ``placed`` entry of rows ``y [R, L]`` (rankings over the entries of
    ``mask``), from its place in the gated walk (module docstring)."""
    R, L = y.shape
    from_end = chunk_mask.long().flip(-1).cumsum(-1).flip(-1) - 1
    n_chunks = L // length + 1
    chunk = (from_end.clamp(min=0) // length).masked_fill(~mask, n_chunks)  # entries left out: a chunk of their own
    at = chunk.clamp(max=n_chunks - 1)

    def per_chunk(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(R, n_chunks + 1).scatter_add_(1, chunk, x)[:, :n_chunks]

    count = per_chunk(mask.to(y.dtype))
    real = count > 0
    mean = per_chunk(torch.where(mask, y, torch.zeros_like(y))) / count.clamp(min=1)
    lowest = torch.where(mask, y, torch.full_like(y, math.inf))
    low_point = y.new_zeros(R, n_chunks + 1).scatter_reduce(1, chunk, lowest, "amin", include_self=False)[:, :n_chunks]
    shift = low_point.clamp(max=0.0).nan_to_num(0.0, posinf=0.0)
    shifted = torch.where(mask, y - shift.gather(1, at), torch.zeros_like(y))
    p = shifted / (per_chunk(shifted) + EPSILON).gather(1, at)
    entropy = per_chunk(torch.where(mask, -p * (p + EPSILON).log(), torch.zeros_like(p)))
    entropy = torch.where(count > 1, entropy / count.clamp(min=2).log(), torch.zeros_like(entropy)).clamp(0.0, 1.0)
    # the gate, with the top-k's tie tolerance: a mean within it of the median counts as at the median, an entropy
    # within it of the median as not below (float noise never flips a chunk)
    mean_median, entropy_median = _lower_median(mean, real), _lower_median(entropy, real)
    spiky = (real & (mean >= mean_median - TIE_RTOL * mean_median.abs())
             & (entropy < entropy_median - TIE_RTOL * entropy_median.abs()))

    rank = _descending_rank(y, mask)  # over the row, ties to the most recent
    grouped = torch.argsort(chunk * (L + 1) + rank, dim=1)  # by chunk, then by decreasing score
    slot = torch.empty_like(grouped).scatter_(1, grouped, torch.arange(L, device=y.device).expand(R, L))
    within = slot - (torch.cumsum(count, 1) - count).long().gather(1, at)  # place within its chunk
    chunk_order = torch.argsort(torch.where(real, -mean, torch.full_like(mean, math.inf)), dim=1, stable=True)
    chunk_place = torch.empty_like(chunk_order).scatter_(1, chunk_order, torch.arange(n_chunks, device=y.device)
                                                         .expand(R, n_chunks))
    taken = mask & (~spiky.gather(1, at) | (within < low))  # with its chunk; the others: kvpress's top-up
    first = chunk_place.gather(1, at) * (length + 1) + within
    later = (n_chunks + 1) * (length + 1) + rank
    key = torch.where(taken, first, later).masked_fill(~placed, 4 * (n_chunks + 2) * (L + 1))
    order = torch.argsort(key, dim=1)  # the placed entries in the walk's order, then the others

    # along the walk: an entry taken with its chunk is worth the chunk's mean, a spiky chunk's other entry its own
    # score; the scores fall by a step above the tie tolerance wherever the walk orders two entries by more than it
    # (within a chunk or among the others, by their scores; into the others, always)
    walked = lambda x: x.gather(1, order)  # noqa: E731
    w_taken, w_chunk, w_y, w_placed = walked(taken), walked(chunk), walked(y).double(), walked(placed)
    worth = torch.where(w_taken, mean.double().gather(1, w_chunk.clamp(max=n_chunks - 1)), w_y)
    prev_taken, prev_chunk, prev_y = w_taken.roll(1, 1), w_chunk.roll(1, 1), w_y.roll(1, 1)
    apart = prev_y - w_y > TIE_RTOL * torch.maximum(prev_y.abs(), w_y.abs())
    step = torch.where(w_taken, prev_taken & (prev_chunk == w_chunk) & apart, prev_taken | apart)
    step[:, 0] = False
    values = _falling(worth, w_placed, step)
    return torch.empty_like(values).scatter_(1, order, values)


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


def _falling(worth: torch.Tensor, placed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``[R, L]``: along each row's places (``placed`` first, in order), ``v_j = min(worth_j, v_{j-1} - g_j |v_{j-1}|)``
    with ``g_j = _GAP`` where ``step`` (else 0): multiplicative steps, so the scores keep ``worth``'s units (no shift:
    Ada compares them across heads as they are). Sign by sign, in the log domain: a positive candidate ``worth_k``
    shrinks by ``(1 - g)`` per step after it, a non-positive one grows by ``(1 + g)`` in magnitude, and any
    non-positive candidate so far is below every positive one."""
    worth = torch.where(placed, worth, torch.zeros_like(worth))
    steps = torch.cumsum(step.double(), dim=1)
    shrink, grow = math.log1p(-_GAP), math.log1p(_GAP)
    positive = worth > 0
    up = torch.where(positive, worth.abs().clamp(min=1e-300).log() - steps * shrink, torch.full_like(worth, math.inf))
    best_up = (torch.cummin(up, dim=1).values + steps * shrink).exp()
    down = torch.where(positive, torch.full_like(worth, -math.inf), worth.abs().clamp(min=1e-300).log() - steps * grow)
    down = torch.where(~positive & (worth == 0), torch.full_like(worth, -math.inf), down)
    best_down = -(torch.cummax(down, dim=1).values + steps * grow).exp()
    below = torch.cummax((~positive).long(), dim=1).values.bool()  # a non-positive candidate so far
    return torch.where(below, best_down, best_up)
