"""A dense fp64 oracle of ragged attention, shared by the kernel tests (not a test module).

Obviously correct rather than fast: pad every row, repeat kv for GQA, mask (bottom-right causal), then the
logit terms as transformers' eager attention applies them: Gemma 2's soft-cap ``softcap * tanh(l / softcap)``
before the mask, GPT-OSS's sink as one more column of each head's logits that the softmax spans and that is
dropped before the values are read.
"""

from __future__ import annotations

import torch


def dense_attention(q, k_flat, v_flat, row_offsets, row_lengths, scale, softcap=None, sinks=None):
    """``[B, H_q, Q, D]`` fp64 on CPU: ragged attention of ``q [B, H_q, Q, D]`` over rows ``r = b * H_kv + h`` of
    ``k_flat, v_flat [N, D]`` at ``row_offsets``, ``row_lengths`` long; a query that sees nothing gives 0."""
    B, H_q, Q, D = q.shape
    R = row_offsets.numel()
    H_kv = R // B
    G = H_q // H_kv
    lens = row_lengths.tolist()
    offs = row_offsets.tolist()
    Lmax = max(lens + [1])
    K = torch.zeros(R, Lmax, D, dtype=torch.float64)
    V = torch.zeros(R, Lmax, D, dtype=torch.float64)
    for r in range(R):
        K[r, : lens[r]] = k_flat[offs[r] : offs[r] + lens[r]].double().cpu()
        V[r, : lens[r]] = v_flat[offs[r] : offs[r] + lens[r]].double().cpu()
    K = K.view(B, H_kv, Lmax, D).repeat_interleave(G, dim=1)
    V = V.view(B, H_kv, Lmax, D).repeat_interleave(G, dim=1)
    n = torch.tensor(lens).view(B, H_kv).repeat_interleave(G, dim=1)  # [B, H_q]
    i = torch.arange(Q).view(1, 1, Q, 1)
    j = torch.arange(Lmax).view(1, 1, 1, Lmax)
    visible = j < (n.view(B, H_q, 1, 1) - (Q - 1 - i))  # [B, H_q, Q, Lmax]
    s = (q.double().cpu() @ K.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.double().cpu().view(1, H_q, 1, 1).expand(B, H_q, Q, 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked queries -> 0
    return p @ V
