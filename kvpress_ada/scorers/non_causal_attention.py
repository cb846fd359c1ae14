"""Non-causal chunked attention (Chari and Van Durme, 2025, "Compactor", arXiv 2507.08143): every query of a
chunk of the context attends to every key of that chunk, before and after it; keys are scored by the attention
they receive, times their value's norm."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, register_scorer
from .statistics import pack_order, row_zscore, sum_pool3

_CHUNK_ELEMENTS = 1 << 26  # logits computed at once (fp32: 256 MiB), whole chunks at a time


def non_causal_scores(obs: Observation, mask: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, H_kv, L]``: the entries ``mask [B, L]`` cut into consecutive chunks of ``chunk_size`` (from the row's
    first; the last may be shorter); per chunk, the softmax over the chunk's keys of each of its queries' raw
    dot products (no ``1/sqrt(D)``, as Compactor), summed over the queries and averaged over the query group;
    times ``||v||``; averaged with both neighbours (zero past either end of ``mask``). Zero elsewhere. Reads one
    query per entry (``obs.queries`` holds the queries of every entry)."""
    keys, queries = obs.keys, obs.queries
    B, H, L, D = keys.shape
    if queries.shape[2] != L:
        raise ValueError(f"non-causal attention needs the query of every entry ({L}), got {queries.shape[2]}: "
                         "it scores a one-shot prefill only")
    Hq = queries.shape[1]
    G = Hq // H
    order = pack_order(mask)
    packed_valid = torch.arange(L, device=keys.device)[None, :] < mask.sum(-1, keepdim=True)
    n_chunks = -(-L // chunk_size)
    pad = n_chunks * chunk_size - L
    q = queries.float().gather(2, order[:, None, :, None].expand(B, Hq, L, D))
    k = keys.float().gather(2, order[:, None, :, None].expand(B, H, L, D))
    q = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(B, H, G, n_chunks, chunk_size, D)
    k = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(B, H, 1, n_chunks, chunk_size, D)
    valid = torch.nn.functional.pad(packed_valid, (0, pad)).view(B, 1, 1, n_chunks, chunk_size)
    step = max(1, _CHUNK_ELEMENTS // max(1, B * Hq * chunk_size * chunk_size))
    received = []
    for start in range(0, n_chunks, step):
        part = slice(start, start + step)
        logits = q[:, :, :, part] @ k[:, :, :, part].transpose(-1, -2)  # [B, H, G, n, c, c]
        logits = logits.masked_fill(~valid[:, :, :, part, None, :], float("-inf"))
        attn = torch.softmax(logits, dim=-1).nan_to_num(0.0) * valid[:, :, :, part, :, None]
        received.append(attn.sum(dim=-2).mean(dim=2))  # [B, H, n, c]
    packed = torch.cat(received, dim=2).reshape(B, H, -1)[..., :L]
    scores = torch.zeros(B, H, L, device=keys.device).scatter(-1, order[:, None, :].expand(B, H, L), packed)
    full = mask[:, None, :].expand(B, H, L)
    return sum_pool3(scores * obs.values.float().norm(dim=-1), full)


@register_scorer("non_causal_attention")
class NonCausalAttention(Scorer):
    """Score = :func:`non_causal_scores` over the row's valid entries, z-scored per row over every head's
    entries. The context must be read at once: the queries of every entry are needed (chunked prefill and
    decode compression are refused).

    Differs from NVIDIA kvpress's ``NonCausalAttnPress`` (``kvpress/presses/non_causal_attention_press.py``,
    0.5.5), which this follows: a last chunk shorter than ``chunk_size`` is a softmax over its own keys (kvpress
    pads it with zero keys that draw attention and zero queries that spread ``1/chunk_size`` over every key);
    chunks start at a row's first valid token and the z-score runs per row (kvpress: over the whole batch).

    Across heads: the attention a head's keys receive sums to its queries' count, but ``||v||`` has a scale of
    its own in every head, so raw scores are not compared (as Expected Attention's)."""

    name: Literal["non_causal_attention"] = "non_causal_attention"
    chunk_size: int = Field(256, ge=1, description="tokens per chunk of non-causal attention")
    comparable_across_heads: ClassVar[bool] = False
    supports_chunked_prefill: ClassVar[bool] = False

    def query_window(self) -> None:
        return None

    def score(self, obs: Observation) -> torch.Tensor:
        scores = non_causal_scores(obs, obs.key_mask, self.chunk_size)
        return row_zscore(scores, obs.key_mask[:, None, :].expand(scores.shape), shard=obs.shard)
