"""Shared attention math for scorers: window queries against all keys, GQA without repeat_kv.

Left padding never changes a valid token's score: padded keys get no attention, padded queries
(when a window reaches into the padding) attend to nothing and are left out of averages, and
pooling averages over valid neighbours only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..observation import Observation


def window_attention(obs: Observation, window: int) -> torch.Tensor:
    """Softmax attention of the last ``min(window, queries given)`` queries over all keys.

    Returns ``[B, H_kv, G, w, L]`` fp32 probabilities, causal inside the window, zero on padding
    (a query sitting on padding attends to nothing: its row is all zeros).
    The query group of each kv head is folded into the matmul, so keys are read once per group.
    """
    q = obs.queries[:, :, -window:]
    keys = obs.keys
    B, Hq, w, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    logits = torch.matmul(q.reshape(B, Hkv, G * w, D).float(), keys.float().transpose(-1, -2)) * obs.scaling
    logits = logits.view(B, Hkv, G, w, L)
    q_pos = torch.arange(L - w, L, device=keys.device)
    k_pos = torch.arange(L, device=keys.device)
    visible = (k_pos[None, :] <= q_pos[:, None])[None, None, None] & obs.key_mask[:, None, None, None, :]
    visible = visible & obs.key_mask[:, -w:][:, None, None, :, None]  # padded queries see nothing
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def mean_over_queries(attn: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """Average ``[B, H_kv, G, w, L]`` window attention over its valid (non-padding) queries."""
    w = attn.shape[3]
    count = key_mask[:, -w:].sum(-1).clamp(min=1).to(attn.dtype)  # [B]
    return attn.sum(dim=3) / count[:, None, None, None]


def pool_scores(scores: torch.Tensor, kernel: int, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """1-D average pooling along the token axis with an odd or even ``kernel`` (SnapKV clustering).

    With ``key_mask`` (``[B, L]``, False on padding; ``scores`` is ``[B, ..., L]``) the average runs
    over valid neighbours only, ``pool(scores * mask) / pool(mask)``, exactly as if the padding were
    not there; padded positions get 0.
    """
    if kernel <= 1:
        return scores
    shape = scores.shape

    def pool(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, 1, shape[-1])
        out = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2, count_include_pad=False)
        return out[..., : shape[-1]].reshape(shape)

    if key_mask is None:
        return pool(scores)
    mask = key_mask.reshape(shape[0], *([1] * (len(shape) - 2)), shape[-1]).to(scores.dtype).expand(shape)
    num = pool(scores * mask)
    den = pool(mask)
    return torch.where(mask.bool(), num / den.clamp(min=torch.finfo(den.dtype).tiny), torch.zeros_like(num))
