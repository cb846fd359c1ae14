"""Dense attention that also returns each query's log-sum-exp (the softmax normaliser).

KVzip's reconstruction pass needs, for every pass token, both the attention output (the model runs
on) and the log-sum-exp of its attention logits (the score of an entry is ``exp(logit - lse)``).
Getting the second from the same kernel as the first avoids materialising and normalising the
whole ``[T, L + T]`` attention matrix a second time.

:func:`attention_with_lse` takes any mask:

* CPU: PyTorch's fused flash-attention kernel for CPU
  (``aten::_scaled_dot_product_flash_attention_for_cpu``), which returns the log-sum-exp;
* elsewhere, or when that op is missing or refuses the inputs: :func:`attention_with_lse_ref`,
  plain torch in query blocks (memory ``block x S`` per head).

:func:`prefix_then_causal_parts` is the faster CPU entry point for the one mask an unpadded pass
has, "all of a prefix, then causal" (:func:`full_prefix_then_causal` recognises it): two mask-free
calls of the same kernel merged by their log-sum-exps, which skip the masked half of the causal
block and the per-call float mask, and also give the log-sum-exp over the last ``T`` keys alone.

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
    if query.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        key, value = _per_query_head(key, value, query.shape[1])
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


def full_prefix_then_causal(allowed: Tensor) -> int | None:
    """``P`` when ``allowed [B | 1, H | 1, T, P + T]`` lets every query see all of the first ``P`` keys
    and the last ``T`` keys causally (KVzip's pass over an unpadded context, no padded pass tokens);
    ``None`` otherwise."""
    T, S = allowed.shape[-2], allowed.shape[-1]
    P = S - T
    if P < 1 or T < 1:
        return None
    causal = torch.ones(T, T, dtype=torch.bool, device=allowed.device).tril()
    if bool(allowed[..., :P].all()) and bool((allowed[..., P:] == causal).all()):
        return P
    return None


def prefix_then_causal_parts(query: Tensor, key: Tensor, value: Tensor, prefix: int,
                             scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, lse, lse_own)`` for the mask :func:`full_prefix_then_causal` recognises, on CPU, as two
    mask-free fused calls merged by their log-sum-exps: the prefix with no mask at all (grouped query
    heads folded into the query length, so the shared keys are not copied per head) and the last
    ``T`` keys with the kernel's own causal mask (which skips most blocks above the diagonal). The
    general path builds a float ``[T, P + T]`` mask per call and computes the masked half of the
    causal block. ``lse_own [B, H, T]``: the log-sum-exp over the last ``T`` keys alone.

    Raises ``RuntimeError`` where PyTorch's CPU kernel is missing or refuses the inputs."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or query.device.type != "cpu":
        raise RuntimeError("PyTorch's fused CPU attention kernel is not available here")
    B, H, T, D = query.shape
    Hkv = key.shape[1]
    group = H // Hkv
    folded = query.reshape(B, Hkv, group * T, D)  # query head kv * group + g -> rows g * T + t
    out_p, lse_p = flash(folded, key[:, :, :prefix], value[:, :, :prefix], 0.0, False, scale=scaling)[:2]
    own_k, own_v = _per_query_head(key[:, :, prefix:], value[:, :, prefix:], H)
    out_o, lse_o = flash(query, own_k, own_v, 0.0, True, scale=scaling)[:2]
    lse_p = lse_p.reshape(B, H, T).float()
    lse_o = lse_o.reshape(B, H, T).float()
    lse = torch.logaddexp(lse_p, lse_o)
    out = (out_p.reshape(B, H, T, -1).float() * (lse_p - lse).exp_().unsqueeze(-1)
           + out_o.float() * (lse_o - lse).exp_().unsqueeze(-1))
    return out.to(query.dtype), lse, lse_o


def attention_with_lse_ref(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor,
                           scaling: float) -> tuple[Tensor, Tensor]:
    """Plain-torch :func:`attention_with_lse` (same heads in query, key and value, or grouped)."""
    key, value = _per_query_head(key, value, query.shape[1])
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


def _per_query_head(key: Tensor, value: Tensor, query_heads: int) -> tuple[Tensor, Tensor]:
    """Grouped-query attention: each kv head repeated for the ``query_heads / H_kv`` heads it serves."""
    group = query_heads // key.shape[1]
    if group == 1:
        return key, value
    return key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
