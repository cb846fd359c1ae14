"""Shared attention math for scorers: window queries against all keys, GQA without repeat_kv."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..observation import Observation


def window_attention(obs: Observation, window: int, queries: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of the last ``window`` queries over all keys.

    Returns ``[B, H_kv, G, w, L]`` fp32 probabilities, causal inside the window, zero on padding.
    The query group of each kv head is folded into the matmul, so keys are read once per group.
    """
    q = obs.queries[:, :, -window:] if queries is None else queries
    keys = obs.keys
    B, Hq, w, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    logits = torch.matmul(q.reshape(B, Hkv, G * w, D).float(), keys.float().transpose(-1, -2)) * obs.scaling
    logits = logits.view(B, Hkv, G, w, L)
    q_pos = torch.arange(L - w, L, device=keys.device)
    k_pos = torch.arange(L, device=keys.device)
    visible = (k_pos[None, :] <= q_pos[:, None])[None, None, None] & obs.key_mask[:, None, None, None, :]
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """1-D average pooling along the token axis with an odd or even ``kernel`` (SnapKV clustering)."""
    if kernel <= 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    pooled = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return pooled[..., : shape[-1]].reshape(shape)
