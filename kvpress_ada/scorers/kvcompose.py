"""KVCompose (Akulov et al., 2025, arXiv 2509.05165, "Efficient Structured KV Cache Compression with Composite
Tokens"): a context entry matters by the attention it receives when the model reads its context a second time.

After the prefill the context's own ids are fed again after it (one model pass, no prompt: NVIDIA kvpress's
``KVComposePress`` with no question, commit 8bb29b9); with ``a_g(j, i)`` the attention of query head ``g`` at pass
token ``j`` on context entry ``i`` (softmax over the context and the pass's tokens up to ``j``, as the model
attends)::

    s_h(i) = agg_group over the query heads g of kv head h of ( agg_task over pass tokens j of a_g(j, i) )
    s_h(i) <- s_h(i) * ||v_h(i)||          (add_v_norm)
    s_h(i) <- s_h(i) + mean_h' s_h'(i)     (add_mean_across_heads: the layer's kv heads)

(defaults: ``agg_task="max"``, ``agg_group="mean"``, mean across heads added, no value norm, as kvpress).
The paper's structured allocation (composite tokens: one count per layer, each kv head keeping its own best) is
the layer schedule :class:`~kvpress_ada.allocators.composite.CompositeLayer` with ``UniformHead`` (the ``kvcompose``
preset); its unstructured variant is one top-k over every layer and head (``AdaLayer(0)`` with ``AdaHead(0)``).

Differs from kvpress: a left-padded batch is scored row by row as alone (kvpress's aggregator also takes the max
over the batch, and it runs batch 1); the pass's entries are cropped off the cache again after scoring (kvpress
keeps the cache it scored with and slices the context's entries back out). Like kvpress the pass holds the context
twice for its duration. Chunked prefill and decode compression are refused (the pass reads the whole context).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from ..kernels.model_pass.pass_attention import QUERY_BLOCK, max_received_attention, own_tokens_lse
from ..observation import Observation
from .base import PassChunk, PassScorer, register_scorer


@register_scorer("kvcompose")
class KVCompose(PassScorer):
    """Attention received from a second reading of the context, aggregated over its tokens and the query
    group, plus the layer's mean over kv heads (see the module docstring)."""

    name: Literal["kvcompose"] = "kvcompose"
    agg_task: Literal["max", "mean"] = Field("max", description="aggregation over the pass's tokens")
    agg_group: Literal["max", "mean"] = Field("mean", description="aggregation over the query heads of a kv head")
    add_v_norm: bool = Field(False, description="multiply each entry's score by its value's norm")
    add_mean_across_heads: bool = Field(True, description="add the layer's mean score over kv heads to each head's")

    comparable_across_heads: ClassVar[bool] = True  # attention probabilities, one scale in every head and layer
    pass_reads_text: ClassVar[bool] = False

    def pass_chunks(self, context_ids: torch.Tensor, key_mask: torch.Tensor, tokenizer: Any) -> list[PassChunk]:
        """One pass: the context itself, left-padded as it is, scoring and seeing every valid context entry."""
        return [PassChunk(ids=context_ids, mask=key_mask, scored=key_mask, visible=key_mask, whole_context=True)]

    def pass_scores(self, query: torch.Tensor, key: torch.Tensor, chunk: PassChunk, scaling: float,
                    value: torch.Tensor | None = None, output_weight: torch.Tensor | None = None,
                    hidden_norm: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    lse_own: torch.Tensor | None = None, output_grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H_kv, L]``: ``agg_group`` over the query group of ``agg_task`` over the pass's valid tokens of the
        attention each context entry receives (0 on padding)."""
        L = key.shape[2] - query.shape[2]
        if self.agg_task == "max":
            per_head, columns = max_received_attention(query, key, chunk.mask, chunk.visible, scaling, lse=lse,
                                                       lse_own=lse_own)
            if columns.numel() != L:
                per_head = torch.zeros(*per_head.shape[:3], L, device=key.device).index_copy_(3, columns, per_head)
        else:
            per_head = mean_received_attention(query, key, chunk.mask, chunk.visible, scaling, lse=lse,
                                               lse_own=lse_own)
        scores = per_head.amax(dim=2) if self.agg_group == "max" else per_head.mean(dim=2)
        return scores.masked_fill(~chunk.scored[:, None, :], 0.0)

    def score(self, obs: Observation) -> torch.Tensor:
        scores = self.measured(obs).float()
        if self.add_v_norm:
            scores = scores * torch.linalg.vector_norm(obs.values.float(), dim=-1)
        if self.add_mean_across_heads:
            every = scores if obs.shard is None else obs.shard.gather(scores)  # the whole layer's kv heads
            scores = scores + every.mean(dim=1, keepdim=True)
        return scores


def mean_received_attention(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, visible: torch.Tensor,
                            scaling: float, lse: torch.Tensor | None = None,
                            lse_own: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H_kv, G, L]``: the mean over the pass's valid tokens ``j`` (``mask [B, T]``) of the attention
    ``exp(scaling * q_{g,j} . k_i - lse_j)`` of query head ``g`` on context entry ``i`` (0 where ``visible [B, L]``
    is False). ``lse [B, H_q, T]``: the normaliser over the visible context and the pass's tokens up to ``j`` when the
    caller has it; else computed here (with ``lse_own``, the part over the pass's own tokens). Query blocks of
    ``QUERY_BLOCK`` bound the memory."""
    B, Hq, T, D = query.shape
    Hkv, L = key.shape[1], key.shape[2] - T
    G = Hq // Hkv
    queries = query.float().reshape(B, Hkv, G, T, D)
    keys = key[:, :, :L].float()
    hidden = ~visible[:, None, None, None, :]  # [B, 1, 1, 1, L]
    if lse is None and lse_own is None:
        lse_own = own_tokens_lse(query, key[:, :, L:], mask, scaling)
    total = torch.zeros(B, Hkv, G, L, device=key.device)
    for start in range(0, T, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, T)
        logits = torch.einsum("bhgtd,bhld->bhgtl", queries[:, :, :, start:stop], keys) * scaling
        logits = logits.masked_fill(hidden, float("-inf"))
        if lse is not None:
            norm = lse.float()[:, :, start:stop].reshape(B, Hkv, G, stop - start)
        else:
            assert lse_own is not None
            own = lse_own.float()[:, :, start:stop].reshape(B, Hkv, G, stop - start)
            norm = torch.logaddexp(torch.logsumexp(logits, dim=-1), own)
        voting = mask[:, None, None, start:stop, None]
        total += torch.where(voting, (logits - norm[..., None]).exp(), 0.0).sum(dim=3)
    return total / mask.sum(-1).clamp(min=1).float()[:, None, None, None]
