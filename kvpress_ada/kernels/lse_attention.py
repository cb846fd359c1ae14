"""Dense attention that also returns each query's log-sum-exp (the softmax normaliser).

KVzip's reconstruction pass needs, for every pass token, both the attention output (the model runs
on) and the log-sum-exp of its attention logits (the score of an entry is ``exp(logit - lse)``).
Getting the second from the same kernel as the first avoids materialising and normalising the
whole ``[T, L + T]`` attention matrix a second time.

* CPU: PyTorch's fused flash-attention kernel for CPU
  (``aten::_scaled_dot_product_flash_attention_for_cpu``), which returns the log-sum-exp;
* elsewhere, or when that op is missing or refuses the inputs: :func:`attention_with_lse_ref`,
  plain torch in query blocks (memory ``block x S`` per head).

``allowed [B, 1 | H, T, S]`` (bool) says which keys each query may see; a query that sees none
gets a zero output and a log-sum-exp of ``-inf`` from both paths.
"""

from __future__ import annotations

import torch
from torch import Tensor

QUERY_BLOCK = 256


def attention_with_lse(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor,
                       scaling: float) -> tuple[Tensor, Tensor]:
    """``(out [B, H, T, D], lse [B, H, T] fp32)`` of softmax attention; ``key``/``value`` may have
    fewer heads than ``query`` (grouped-query attention: each serves ``H / H_kv`` query heads)."""
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    if query.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
        bias.masked_fill_(~allowed, float("-inf"))
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, False, attn_mask=bias, scale=scaling)
        except RuntimeError:  # e.g. a dtype or layout this build's kernel does not take
            return attention_with_lse_ref(query, key, value, allowed, scaling)
        seen = allowed.any(-1).expand(lse.shape)
        return out, lse.float().masked_fill(~seen, float("-inf"))
    return attention_with_lse_ref(query, key, value, allowed, scaling)


def attention_with_lse_ref(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor,
                           scaling: float) -> tuple[Tensor, Tensor]:
    """Plain-torch :func:`attention_with_lse` (same heads in query, key and value, or grouped)."""
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    B, H, T, D = query.shape
    out = torch.empty(B, H, T, value.shape[-1], dtype=query.dtype, device=query.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=query.device)
    keys_t = key.float().transpose(-1, -2)
    for start in range(0, T, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, T)
        logits = torch.matmul(query[:, :, start:stop].float(), keys_t) * scaling
        logits.masked_fill_(~allowed[:, :, start:stop], float("-inf"))
        norm = torch.logsumexp(logits, dim=-1)
        probs = (logits - norm.unsqueeze(-1)).exp().nan_to_num_(0.0)  # a row that sees nothing: all zero
        out[:, :, start:stop] = torch.matmul(probs, value.float()).to(query.dtype)
        lse[:, :, start:stop] = norm
    return out, lse
