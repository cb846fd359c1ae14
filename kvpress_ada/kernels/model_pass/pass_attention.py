"""The largest softmax attention each context entry receives from a model pass's queries.

For queries ``q_j`` of a pass (``[B, H_q, T, D]``) over the keys ``[B, H_kv, L + T, D]`` (the
context, then the pass's own tokens), with softmax normaliser ``lse_j`` over what query ``j`` sees:

    best[g, i] = max_j exp(scaling * q_{g,j} . k_i - lse_j - log_weight_j)

for every context entry ``i`` some row's softmax spans (``visible``) and every query head ``g`` of
its kv group. Since ``exp`` is monotonic this is one ``exp`` per entry after a max of shifted logits.
``lse`` is taken from the caller when it has it (the pass's own attention saw exactly ``visible``);
otherwise it comes from the same products plus ``lse_own``, the log-sum-exp over the pass's own
tokens (causal), itself computed here when not given. Queries of padded pass tokens never vote.
Memory is bounded by query blocks of ``QUERY_BLOCK`` (one reused buffer).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .lse_attention import attention_with_lse

QUERY_BLOCK = 64


def own_tokens_lse(query: Tensor, own_keys: Tensor, mask: Tensor, scaling: float) -> Tensor:
    """``[B, H_q, T]`` log-sum-exp of each pass query over the pass's own valid tokens up to itself."""
    T = query.shape[2]
    allowed = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()[None] & mask[:, None, :]
    keys = own_keys.float()
    return attention_with_lse(query.float(), keys, keys, allowed[:, None], scaling)[1]


def max_received_attention(query: Tensor, key: Tensor, mask: Tensor, visible: Tensor, scaling: float,
                           lse: Tensor | None = None, lse_own: Tensor | None = None,
                           log_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(best [B, H_kv, G, V], columns [V])``: see the module docstring.

    ``mask [B, T]``: the pass's real tokens; ``visible [B, L]``: the context entries each row's
    softmax spans; ``columns``: the context entries some row's softmax spans (``V`` of them, in
    order), the only ones multiplied; ``log_weight [B, T]``: subtracted from every logit of query
    ``j`` (``log ||h_j||`` for KVzip+); ``lse``/``lse_own`` ``[B, H_q, T]`` as in the module docstring.
    """
    B, Hq, T, D = query.shape
    Hkv, L = key.shape[1], key.shape[2] - T
    G = Hq // Hkv
    columns = visible.any(0).nonzero().flatten()
    V = columns.numel()
    whole = V == L
    seen = visible if whole else visible[:, columns]  # [B, V]
    if lse is None and lse_own is None:
        lse_own = own_tokens_lse(query, key[:, :, L:], mask, scaling)
    extra = torch.zeros(B, 1, T, device=key.device)
    if log_weight is not None:
        extra = extra + log_weight.float()[:, None, :]
    voting = mask[:, None, :].expand(B, Hkv, T).reshape(B * Hkv, 1, T)  # padded queries do not vote
    extra = extra.expand(B, Hq, T).reshape(B * Hkv, G, T)
    known = None if lse is None else (lse.float().reshape(B * Hkv, G, T) + extra).masked_fill(~voting, float("inf"))
    own_lse = None if lse_own is None else lse_own.float().reshape(B * Hkv, G, T)
    hidden_out = None  # [B * H_kv, 1, V]: columns a row's softmax does not span, when some do not
    if not bool(seen.all()):
        hidden_out = ~seen[:, None, None, :].expand(B, Hkv, 1, V).reshape(B * Hkv, 1, V)
    queries = query.float().reshape(B * Hkv, G, T, D)
    keys = key[:, :, :L] if whole else key[:, :, columns]
    keys_t = keys.float().transpose(-1, -2).reshape(B * Hkv, D, V)
    best = torch.full((B * Hkv, G, V), float("-inf"), device=key.device)
    # one buffer serves every block (a fresh multi-MB tensor per block costs more in page faults
    # than the product itself on CPU)
    buffer = torch.empty(B * Hkv * G * min(QUERY_BLOCK, T) * V, device=key.device)
    block_max = torch.empty_like(best)
    for start in range(0, T, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, T)
        n = stop - start
        block = buffer[:B * Hkv * G * n * V].view(B * Hkv, G * n, V)
        rows = queries[:, :, start:stop].reshape(B * Hkv, G * n, D)
        if known is not None:
            torch.baddbmm(-known[:, :, start:stop].reshape(B * Hkv, G * n, 1), rows, keys_t, alpha=scaling,
                          out=block)
        else:
            assert own_lse is not None
            torch.bmm(rows, keys_t, out=block).mul_(scaling)
            if hidden_out is not None:
                block.masked_fill_(hidden_out, float("-inf"))
            context_lse = torch.logsumexp(block.view(B * Hkv, G, n, V), dim=-1)
            shift = torch.logaddexp(context_lse, own_lse[:, :, start:stop]) + extra[:, :, start:stop]
            shift = shift.masked_fill(~voting[:, :, start:stop], float("inf"))
            block.view(B * Hkv, G, n, V).sub_(shift[..., None])
        torch.amax(block.view(B * Hkv, G, n, V), dim=2, out=block_max)
        torch.maximum(best, block_max, out=best)
    return best.view(B, Hkv, G, V).exp_(), columns
