"""Shared math of the key-statistics scorers (leverage, CUR, Compactor, non-causal attention, CAP):
RoPE undone on keys, ridge leverage scores, per-row z-scores, valid entries packed to the front of a row.

Every function treats ``mask`` (``[B, L]`` or ``[B, H, L]`` bool, False on padding or on entries left
out) as if the masked entries were not there, so a batch row scores as it would alone.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch


def ranks(mask: torch.Tensor) -> torch.Tensor:
    """0-based rank of each entry among the row's valid entries (``mask`` True); -1 elsewhere."""
    rank = mask.long().cumsum(-1) - 1
    return rank.masked_fill(~mask, -1)


def unrotate(keys: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor | None,
             mask: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys (half-split layout) from post-RoPE ``keys [B, H, L, D]`` at ``positions [B, H, L]``
    (``None``: the valid entries of a row, ``mask [B, L]``, are consecutive tokens), each row and head
    un-rotated relative to its first valid entry. A constant offset per (row, head) only rotates the row's
    keys by one common orthogonal map, which changes no (unsketched) leverage score; counting from the first
    valid entry makes a padded row's keys exactly those of the row alone, sketch or not."""
    B, H, L = keys.shape[:3]
    valid = mask[:, None, :].expand(B, H, L)
    if positions is None:
        pos = ranks(valid).float()
    else:
        pos = positions.to(device=keys.device, dtype=torch.float32)
        first = pos.masked_fill(~valid, float("inf")).amin(dim=-1, keepdim=True)
        pos = torch.where(valid, pos - first.nan_to_num(0.0, posinf=0.0), torch.zeros_like(pos))
    angle = -pos[..., None] * inv_freq.to(device=keys.device, dtype=torch.float32)  # [B, H, L, D/2]
    cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
    half = keys.shape[-1] // 2
    x = keys.float()
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@functools.lru_cache(maxsize=16)
def gaussian_sketch(d: int, k: int, seed: int, device: str) -> torch.Tensor:
    """``[d, k]`` fp32 Gaussian matrix with entries ``N(0, 1/k)``, drawn from ``seed`` on the CPU (the same on
    every device and process)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(d, k, generator=gen) / math.sqrt(k)).to(device)


def ridge_leverage(x: torch.Tensor, mask: torch.Tensor, ridge: float, tries: int = 5) -> torch.Tensor:
    """``diag(X (X^T X + ridge I)^-1 X^T)`` of ``x [B, H, L, k]`` over the valid rows ``mask [B, H, L]``
    (rows centred over the valid ones first), clamped at 0, zero where not valid. The Cholesky factor is
    retried with the ridge multiplied by 10 (up to ``tries`` times) for each (row, head) whose Gram matrix
    is not numerically positive definite. Computed in float64 (a ``k x k`` system per head: cheap), so that
    equal scores (two tokens, or keys symmetric about their mean) stay equal to the last bit and a z-score
    of them is not amplified rounding; returned in float32."""
    x = x.double()
    m = mask[..., None].to(x.dtype)
    count = m.sum(dim=2, keepdim=True).clamp(min=1.0)
    x = (x - (x * m).sum(dim=2, keepdim=True) / count) * m
    xt = x.transpose(-1, -2)
    gram = xt @ x
    gram = 0.5 * (gram + gram.transpose(-1, -2))
    eye = torch.eye(gram.shape[-1], device=x.device, dtype=x.dtype)
    jitter = torch.full(gram.shape[:-2], float(ridge), device=x.device, dtype=x.dtype)
    factor, info = torch.linalg.cholesky_ex(gram + jitter[..., None, None] * eye)
    for _ in range(tries - 1):
        failed = info != 0
        if not bool(failed.any()):
            break
        jitter = torch.where(failed, (jitter * 10.0).clamp(min=1e-8), jitter)
        factor, info = torch.linalg.cholesky_ex(gram + jitter[..., None, None] * eye)
    if bool((info != 0).any()):
        raise ValueError("leverage scores: the keys' Gram matrix stays singular with ridge up to "
                         f"{float(jitter.max())}; raise the ridge")
    solved = torch.cholesky_solve(xt, factor)  # (X^T X + ridge I)^-1 X^T, [B, H, k, L]
    return ((x * solved.transpose(-1, -2)).sum(dim=-1).clamp(min=0.0) * m[..., 0]).float()


def row_zscore(scores: torch.Tensor, mask: torch.Tensor, floor: float = 1e-6, shard: Any = None) -> torch.Tensor:
    """``(s - mean) / max(std, floor)`` per batch row over every head's valid entries (``mask [B, H, L]``;
    unbiased std, as ``torch.std``), zero where not valid; the sums in float64, so that where the padding
    sits changes no bit of a row's float32 result. Under tensor parallelism (``shard``: this rank's block of
    the layer's kv heads) the statistics span every rank's heads, as in one process."""
    x = scores.double()
    m = mask.to(x.dtype)

    def over_heads(per_head: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, 1, 1], every head of the layer
        if shard is not None:
            per_head = shard.gather(per_head)
        return per_head.sum(dim=1)[:, None, None]

    n = over_heads(m.sum(-1))
    mean = over_heads((x * m).sum(-1)) / n.clamp(min=1.0)
    var = over_heads((((x - mean) * m) ** 2).sum(-1)) / (n - 1).clamp(min=1.0)
    return ((x - mean) / var.sqrt().clamp(min=floor) * m).float()


def pack_order(mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` long: slot indices that move each row's valid entries (``mask [B, L]``) to its front, in order
    (the rest after them): ``x.gather(-1, order)`` packs, ``scatter(-1, order, packed)`` unpacks."""
    return torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices


def sum_pool3(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each entry and its two neighbours along the last axis, counting a masked or missing neighbour
    as 0 (``F.avg_pool1d(kernel_size=3, padding=1)`` of a row alone, its edges zero-padded); zero where
    ``mask [B, H, L]`` is False."""
    s = scores * mask.to(scores.dtype)
    pooled = s.clone()
    pooled[..., 1:] += s[..., :-1]
    pooled[..., :-1] += s[..., 1:]
    return pooled / 3.0 * mask.to(scores.dtype)
