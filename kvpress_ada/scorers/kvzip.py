"""KVzip (Kim et al., NeurIPS 2025, "Query-Agnostic KV Cache Compression with Context
Reconstruction"): after the prefill, the model is asked to repeat its context; a context entry
matters by the largest attention it receives from the reconstruction's queries.

As in the paper and its public implementations (the authors' repository, NVIDIA kvpress's
``KVzipPress``): chunks of ``chunk`` context tokens, each pass fed
``"\\n\\nRepeat the previous context exactly."`` (later chunks: ``"...the part of the previous
context exactly, starting with"`` and the last ``overlap`` tokens of the previous chunk) in the chat
format, then the chunk. A pass's queries attend over the first ``sinks`` context tokens (from the
second chunk on), the chunk's own entries and the pass's tokens (causal); an entry's score is the
maximum of that attention over the pass's queries and the query heads of its kv group; the sinks are
always kept. The whole prefill is the repeated context, and each row of a left-padded batch is
chunked by its own valid tokens. Design notes: ``docs/design.md`` (KVzip's model pass).

KVzip+ (``plus=True``): the normalisation of KVzap (Jégou and Jeblick, NVIDIA 2026, arXiv
2601.07891) as kvpress computes it (``KVzipPress(kvzip_plus_normalization=True)``)::

    s_i = max over pass tokens j and query heads g of the kv group of
          a_g(j, i) * ||W_O^g v_i|| / ||h_j||

``a_g(j, i)``: KVzip's attention of query head ``g`` at pass token ``j`` on entry ``i``; ``v_i``: the
entry's value; ``W_O^g``: the ``head_dim`` columns of the output projection weight that query head ``g`` feeds
(``[:, g * D:(g + 1) * D]``, query heads numbered ``kv_head * group + g``); ``h_j``: pass token
``j``'s hidden state entering the attention module (after the input RMSNorm).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from ..kernels.model_pass.pass_attention import max_received_attention
from ..observation import Observation
from ..tokens import encode, left_pad
from .base import PassChunk, PassScorer, protect_first_valid, register_scorer

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
_SEPARATOR = "\n####kvpress_ada####"


class ContextReplay(PassScorer):
    """The context reconstruction KVzip's pass runs (module docstring), shared by the scorers that read it: its
    chunks, prompts and protected sinks; a subclass says what it measures in each pass (:meth:`pass_scores`)."""

    name: str
    chunk: int = Field(2048, ge=1, description="context tokens reconstructed per pass")
    sinks: int = Field(4, ge=0, description="initial tokens always kept")
    overlap: int = Field(8, ge=0, description="tokens of the previous chunk quoted in a later pass's prompt")

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks)

    def score(self, obs: Observation) -> torch.Tensor:
        return protect_first_valid(self.measured(obs).float(), obs.key_mask, self.sinks)

    # ------------------------------------------------------------ the model pass
    def pass_prompt_ids(self, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids of the text every pass adds to the context: the first pass's prompt, a later
        pass's prompt, the chat template's assistant prefix (checked against the model's vocabulary
        when the press meets the model)."""
        return (encode(tokenizer, FIRST_PROMPT)[0], encode(tokenizer, NEXT_PROMPT)[0],
                encode(tokenizer, _assistant_suffix(tokenizer))[0])

    def pass_chunks(self, context_ids: torch.Tensor, key_mask: torch.Tensor, tokenizer: Any) -> list[PassChunk]:
        """The reconstruction passes for a left-padded ``context_ids [B, L]``."""
        first, later, suffix = self.pass_prompt_ids(tokenizer)
        B, L = context_ids.shape
        rank = key_mask.long().cumsum(-1) - 1  # index among valid tokens, [B, L]
        n_chunks = int((key_mask.sum(-1).max() + self.chunk - 1) // self.chunk)
        sink = key_mask & (rank < self.sinks)
        chunks = []
        for c in range(n_chunks):
            scored = key_mask & (rank >= c * self.chunk) & (rank < (c + 1) * self.chunk)
            rows = []
            for b in range(B):
                part = context_ids[b][scored[b]]
                if c == 0:
                    head = first
                else:
                    previous = context_ids[b][key_mask[b] & (rank[b] < c * self.chunk)]
                    head = torch.cat([later, previous[previous.numel() - min(self.overlap, previous.numel()):]])
                rows.append(torch.cat([head.to(context_ids.device), suffix.to(context_ids.device), part]))
            ids, mask = left_pad(rows)
            visible = scored | (sink if c > 0 else torch.zeros_like(sink))
            chunks.append(PassChunk(ids=ids, mask=mask, scored=scored, visible=visible,
                                    whole_context=bool(torch.equal(visible, key_mask))))
        return chunks

    @staticmethod
    def pass_mask(chunk: PassChunk) -> torch.Tensor:
        """``[B, 1, T, L + T]``: what a pass query's scoring softmax spans: the chunk's visible context
        entries and the pass's own valid tokens up to itself (causal)."""
        T = chunk.ids.shape[1]
        own = torch.ones(T, T, dtype=torch.bool, device=chunk.mask.device).tril()[None] & chunk.mask[:, None, :]
        context = chunk.visible[:, None, :].expand(-1, T, -1)
        return torch.cat([context, own], dim=-1)[:, None]


@register_scorer("kvzip")
class KVzip(ContextReplay):
    """Max attention received while the model reconstructs the context (see the module docstring);
    ``plus=True`` is KVzip+ (attention times ``||W_O v|| / ||h||``)."""

    name: Literal["kvzip"] = "kvzip"
    plus: bool = Field(False, description="KVzip+: weigh each attention by ||W_O v|| / ||h|| (module docstring)")

    def pass_reads_hidden_states(self) -> bool:
        """Whether :meth:`pass_scores` needs ``hidden_norm`` (KVzip+ does)."""
        return self.plus

    def pass_scores(self, query: torch.Tensor, key: torch.Tensor, chunk: PassChunk, scaling: float,
                    value: torch.Tensor | None = None, output_weight: torch.Tensor | None = None,
                    hidden_norm: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    lse_own: torch.Tensor | None = None, output_grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H_kv, L]``: the largest attention each scored context entry gets from this pass
        (:func:`~kvpress_ada.kernels.model_pass.pass_attention.max_received_attention` over the pass's queries and
        the query heads of the kv group; KVzip+ weighs it by ``||W_O^g v_i|| / ||h_j||``)."""
        if self.plus and (value is None or output_weight is None or hidden_norm is None):
            raise ValueError("KVzip+ (plus=True) needs the pass's values, the layer's output projection weight and the "
                             "hidden-state norms of the pass's tokens")
        log_weight = hidden_norm.float().log() if self.plus and hidden_norm is not None else None  # dividing by ||h_j||
        return replay_scores(query, key, chunk, scaling, log_weight=log_weight, value=value if self.plus else None,
                             output_weight=output_weight, lse=lse, lse_own=lse_own)


def replay_scores(query: torch.Tensor, key: torch.Tensor, chunk: PassChunk, scaling: float,
                  log_weight: torch.Tensor | None = None, value: torch.Tensor | None = None,
                  output_weight: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  lse_own: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H_kv, L]`` of one layer from one pass (0 on the entries it does not score): for each scored context
    entry ``i``, the largest over the pass's queries ``j`` and the query heads ``g`` of its kv group of
    ``a_g(j, i) / exp(log_weight_j)``, times ``||W_O^g v_i||`` when ``value`` is given (:func:`output_norms`);
    ``a``: KVzip's attention (:meth:`ContextReplay.pass_mask`)."""
    L = key.shape[2] - query.shape[2]
    best, columns = max_received_attention(query, key, chunk.mask, chunk.visible, scaling, lse=lse,
                                           lse_own=lse_own, log_weight=log_weight)
    whole = columns.numel() == L
    if value is not None:
        assert output_weight is not None
        values = value[:, :, :L] if whole else value[:, :, columns]
        best = best * output_norms(values, output_weight)  # ||W_O^g v_i|| does not depend on j
    scores = best.amax(dim=2)
    if not whole:
        scores = torch.zeros(*scores.shape[:2], L, device=key.device).index_copy_(2, columns, scores)
    return scores.masked_fill(~chunk.scored[:, None, :], 0.0)


def output_norms(values: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, G, L]``: ``||W_O^g v||`` for every value ``[B, H_kv, L, D]`` and every query head
    ``g`` of its group, ``W_O^g`` being the ``D`` columns of ``output_weight [hidden, H_q * D]`` that
    head ``kv_head * G + g`` feeds. Computed through each head's ``D x D`` Gram matrix
    ``W_O^g.T @ W_O^g`` so no ``[.., L, hidden]`` tensor is materialised."""
    B, Hkv, L, D = values.shape
    hidden = output_weight.shape[0]
    G = output_weight.shape[1] // (Hkv * D)
    w = output_weight.float().view(hidden, Hkv, G, D)
    gram = torch.einsum("ehgd,ehgf->hgdf", w, w)  # [Hkv, G, D, D]
    v = values.float()
    projected = torch.einsum("bhld,hgdf->bhglf", v, gram)  # [B, Hkv, G, L, D]
    squared = (projected * v[:, :, None]).sum(-1)
    return squared.clamp_min(0.0).sqrt()

def _assistant_suffix(tokenizer: Any) -> str:
    """The chat template's text between a user message's content and the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x" + _SEPARATOR}], tokenize=False,
                                             add_generation_prompt=True)
    return str(rendered).split(_SEPARATOR, 1)[1]
