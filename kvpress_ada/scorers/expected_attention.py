"""Expected Attention (Devoto et al., 2025): score keys by the attention that *future* queries
are expected to pay them, modelling queries as a Gaussian and averaging RoPE over the next
``n_future`` positions; weighted by the value norm."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, protect_first_valid, register_scorer


@register_scorer("expected_attention")
class ExpectedAttention(Scorer):
    """Gaussian query model from the last ``window`` queries (``None``: every prefill query),
    rotated to the next ``n_future`` positions: ``logit = mu.k * s + 0.5 * s^2 * k^T Sigma k``,
    softmax over the context, times ``||v||``. The first ``sinks`` tokens are protected.
    Padding positions are left out of the query statistics.

    Chunked prefill: the query statistics come from the chunk's trailing queries and the future
    positions follow the chunk; kept entries are re-scored at every compression."""

    name: Literal["expected_attention"] = "expected_attention"
    window: int | None = Field(128, ge=2, description="trailing queries used to estimate the query statistics "
                                                      "(None: all of them)")
    n_future: int = Field(512, ge=1, description="future positions the expectation averages over")
    sinks: int = Field(4, ge=0, description="initial tokens always kept")
    use_covariance: bool = True
    use_vnorm: bool = True
    comparable_across_heads: ClassVar[bool] = False
    needs_rope: ClassVar[bool] = True

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks)

    def query_window(self) -> int | None:
        return self.window

    def min_context(self) -> int:
        return 2

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.rope_inv_freq is None:
            raise ValueError("ExpectedAttention needs the model's RoPE inverse frequencies (obs.rope_inv_freq)")
        q = obs.queries.float()  # [B, Hq, w, D] at positions L-w .. L-1
        B, Hq, w, D = q.shape
        Hkv, G = obs.n_kv_heads, obs.group_size
        q = rotate_to_future(q, obs.rope_inv_freq.float().to(q.device), self.n_future)
        q = q.view(B, Hkv, G, w, D)
        weight = obs.key_mask[:, -w:].to(q.dtype)[:, None, None, :, None]  # queries sit where the keys do
        count = weight.sum(dim=3).clamp(min=1.0)  # [B, 1, 1, 1]
        mean = (q * weight).sum(dim=3) / count  # [B, Hkv, G, D]
        cov = None
        if self.use_covariance:
            centred = (q - mean.unsqueeze(3)) * weight
            cov = torch.einsum("bhgwd,bhgwe->bhgde", centred, centred) / (count - 1).clamp(min=1.0)[..., None]
        scores = gaussian_scores(mean, cov, obs.keys.float(), obs.values, obs.key_mask[:, None, :], obs.scaling,
                                 self.use_vnorm)
        return protect_first_valid(scores, obs.key_mask, self.sinks)


def gaussian_scores(mean: torch.Tensor, cov: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
                    softmax_mask: torch.Tensor, scaling: float, use_vnorm: bool) -> torch.Tensor:
    """``[B, H_kv, L]``: Expected Attention's score of each key ``keys [B, H_kv, L, D]`` (float32) under future queries
    ``N(mean, cov)`` (``[B, H_kv, G, D]`` and ``[B, H_kv, G, D, D]``, already rotated to the future positions; ``cov``
    None: the mean alone): ``softmax(scaling mu.k + scaling^2 k^T Sigma k / 2)`` over the entries of ``softmax_mask
    [B, H_kv | 1, L]``, averaged over the query group, times ``||v||`` with ``use_vnorm``."""
    logits = torch.einsum("bhgd,bhld->bhgl", mean, keys) * scaling
    if cov is not None:
        quad = torch.einsum("bhld,bhgde,bhle->bhgl", keys, cov, keys)
        logits = logits + 0.5 * scaling**2 * quad
    logits = logits.masked_fill(~softmax_mask[:, :, None, :], float("-inf"))
    scores = torch.softmax(logits, dim=-1).mean(dim=2)
    if use_vnorm:
        scores = scores * values.float().norm(dim=-1)
    return scores


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE rotation (half-split layout) of ``x`` by angles given as ``cos``/``sin`` over the last dim (an averaged
    rotation ``diag(cos) + diag(sin) P`` too)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rotate_to_future(q: torch.Tensor, inv_freq: torch.Tensor, n_future: int) -> torch.Tensor:
    """Average rotation taking each post-RoPE query from its position to the next ``n_future``
    positions after the context. Query ``j`` of ``w`` sits ``w - j`` positions before the first
    future one, and RoPE is a rotation group, so ``mean_k R(w - j + k) q = M R(w - j) q`` with
    ``M = mean_k R(k)``: ``O((w + n_future) D)`` work, relative positions only (padding-safe)."""
    w = q.shape[2]
    shift = torch.arange(w, 0, -1, device=q.device, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [w, D/2]
    q = rotate(q, torch.cat([shift.cos()] * 2, dim=-1), torch.cat([shift.sin()] * 2, dim=-1))
    ahead = torch.arange(n_future, device=q.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return rotate(q, torch.cat([ahead.cos().mean(0)] * 2), torch.cat([ahead.sin().mean(0)] * 2))
