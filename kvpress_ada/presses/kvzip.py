"""KVzip (Kim et al., NeurIPS 2025, "Query-Agnostic KV Cache Compression with Context
Reconstruction"): after the prefill, the model is asked to repeat its context; a context entry
matters by the largest attention it receives from the reconstruction's queries.

Facts taken from the paper and its public implementations (the authors' repository and NVIDIA
kvpress's ``KVzipPress``): the context is reconstructed in chunks of 2,048 tokens, each pass fed
``"\\n\\nRepeat the previous context exactly."`` (later chunks: ``"...the part of the previous
context exactly, starting with"`` and the last 8 tokens of the previous chunk), the chat template's
end-of-user/start-of-assistant text, then the chunk itself. A pass's queries attend (softmax) over
the first ``sinks`` context tokens (from the second chunk on), the chunk's own context entries and
the pass's tokens (causal); an entry's score is the maximum of that attention over the pass's
queries and the query heads of its kv group. The first ``sinks`` tokens are always kept. The
selection is one top-k over all layers and heads (presets ``kvzip``, ``kvzip_plus``, ``ada_kvzip``), or per layer
(``kvzip_layerwise``).

Here the whole prefill is the context that is repeated (the chat prefix included), and rows of a
left-padded batch are chunked by their own valid tokens, so a row scores exactly as it would alone.

KVzip+ (``plus=True``, preset ``kvzip_plus``): the normalisation introduced with KVzap (Jégou and
Jeblick, NVIDIA 2026, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", arXiv 2601.07891) on
top of KVzip's scoring, as NVIDIA kvpress computes it (``KVzipPress(kvzip_plus_normalization=True)``,
kvpress 0.5.x). Each attention weight is turned into the size of what the entry writes into the
query token's output, relative to that token's hidden state::

    s_i = max over pass tokens j and query heads g of the kv group of
          a_g(j, i) * ||W_O^g v_i|| / ||h_j||

``a_g(j, i)``: KVzip's softmax attention of query head ``g`` at pass token ``j`` on entry ``i``;
``v_i``: the entry's value (the kv head's, shared by the group); ``W_O^g``: the ``head_dim`` columns
of ``o_proj.weight`` that head ``g`` feeds (``[:, g * D:(g + 1) * D]``, query heads numbered
``kv_head * group + g``), so each query head of a GQA group weighs the shared value with its own
slice; ``h_j``: pass token ``j``'s hidden state as the attention module receives it, i.e. after the
decoder layer's input RMSNorm (kvpress reads the attention module's ``hidden_states`` argument),
not the raw residual stream. The scores remain one scale for every head and layer (a contribution
relative to the hidden state it is added to), so the global top-k of the presets stays meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from ..kernels.lse_attention import attention_with_lse
from ..observation import Observation
from .base import Scorer, protect_first_valid, register_scorer

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
_SEPARATOR = "\n####kvpress_ada####"


@dataclass(frozen=True)
class PassChunk:
    """One reconstruction pass over a left-padded batch.

    ``ids``/``mask``: ``[B, T]`` the pass's input (left padding False); ``scored``: ``[B, L]`` the
    context entries this pass scores; ``visible``: ``[B, L]`` the context entries its scoring
    softmax spans (``scored`` plus the sinks); ``whole_context``: whether ``visible`` is every valid
    context entry (one pass covers the context), so the softmax is the model's own attention's.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    scored: torch.Tensor
    visible: torch.Tensor
    whole_context: bool = False


@register_scorer("kvzip")
class KVzip(Scorer):
    """Max attention received while the model reconstructs the context (see the module docstring);
    ``plus=True`` is KVzip+ (attention times ``||W_O v|| / ||h||``)."""

    name: Literal["kvzip"] = "kvzip"
    chunk: int = Field(2048, ge=1, description="context tokens reconstructed per pass")
    sinks: int = Field(4, ge=0, description="initial tokens always kept")
    overlap: int = Field(8, ge=0, description="tokens of the previous chunk quoted in a later pass's prompt")
    plus: bool = Field(False, description="KVzip+: weigh each attention by ||W_O v|| / ||h|| (module docstring)")
    needs_model_pass: ClassVar[bool] = True
    supports_chunked_prefill: ClassVar[bool] = False  # the reconstruction repeats the whole context
    _QUERY_BLOCK: ClassVar[int] = 64

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks)

    def query_window(self) -> int:
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.pass_scores is None:
            raise ValueError("KVzip scores come from its reconstruction pass (obs.pass_scores); run the press "
                             "through `with press(model)` or fan-out, which run that pass")
        return protect_first_valid(obs.pass_scores.float(), obs.key_mask, self.sinks)

    # ------------------------------------------------------------ the model pass
    def pass_prompt_ids(self, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids of the text every pass adds to the context: the first pass's prompt, a later
        pass's prompt, the chat template's assistant prefix (checked against the model's vocabulary
        when the press meets the model)."""
        return (_encode(tokenizer, FIRST_PROMPT), _encode(tokenizer, NEXT_PROMPT),
                _encode(tokenizer, _assistant_suffix(tokenizer)))

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
            ids, mask = _left_pad(rows)
            visible = scored | (sink if c > 0 else torch.zeros_like(sink))
            chunks.append(PassChunk(ids=ids, mask=mask, scored=scored, visible=visible,
                                    whole_context=bool(torch.equal(visible, key_mask))))
        return chunks

    def pass_reads_hidden_states(self) -> bool:
        """Whether :meth:`pass_scores` needs ``hidden_norm`` (KVzip+ does)."""
        return self.plus

    def pass_scores(self, query: torch.Tensor, key: torch.Tensor, chunk: PassChunk, scaling: float,
                    value: torch.Tensor | None = None, output_weight: torch.Tensor | None = None,
                    hidden_norm: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    lse_own: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H_kv, L]``: the largest attention each scored context entry gets from this pass.

        ``query [B, H_q, T, D]`` are the pass's post-RoPE queries; ``key [B, H_kv, L + T, D]`` the
        layer's keys (context then the pass's own tokens). KVzip+ also reads ``value`` (same shape
        as ``key``), the layer's ``output_weight`` (``o_proj.weight``, ``[hidden, H_q * D]``) and
        ``hidden_norm [B, T]``, the norm of each pass token's hidden state entering the attention.
        ``lse [B, H_q, T]``: the log-sum-exp of each query's logits over :meth:`pass_mask` when the
        caller already has it (the pass's own attention, when it sees exactly that). Otherwise it is
        computed here from the same query-key products as the scores, plus ``lse_own [B, H_q, T]``,
        the log-sum-exp over the pass's own tokens (causal), taken from the caller when it has it.

        Only the context entries some row's softmax spans (``chunk.visible``) are multiplied. Since
        ``exp`` is monotonic, ``max_j exp(s_ji - lse_j) = exp(max_j (s_ji - lse_j))``: the logits
        are shifted by each query's ``lse`` (plus ``log ||h_j||`` for KVzip+) and reduced by a max
        over the pass's queries before a single ``exp`` per entry.
        """
        B, Hq, T, D = query.shape
        Hkv, L = key.shape[1], key.shape[2] - T
        G = Hq // Hkv
        if self.plus and (value is None or output_weight is None or hidden_norm is None):
            raise ValueError("KVzip+ (plus=True) needs the pass's values, the layer's o_proj weight and the "
                             "hidden-state norms of the pass's tokens")
        columns = chunk.visible.any(0).nonzero().flatten()  # the context entries some row's softmax spans
        V = columns.numel()
        whole = V == L
        visible = chunk.visible if whole else chunk.visible[:, columns]  # [B, V]
        if lse is None and lse_own is None:
            own = key[:, :, L:].float()
            lse_own = attention_with_lse(query.float(), own, own, self.pass_mask(chunk)[..., L:], scaling)[1]
        extra = torch.zeros(B, 1, T, device=key.device)
        if self.plus:
            assert hidden_norm is not None
            extra = extra + hidden_norm.float().log()[:, None, :]  # dividing by ||h_j||
        voting = chunk.mask[:, None, :].expand(B, Hkv, T).reshape(B * Hkv, 1, T)  # padded queries do not vote
        extra = extra.expand(B, Hq, T).reshape(B * Hkv, G, T)
        known = None if lse is None else (lse.float().reshape(B * Hkv, G, T) + extra).masked_fill(~voting, float("inf"))
        own_lse = None if lse_own is None else lse_own.float().reshape(B * Hkv, G, T)
        hidden_out = None  # [B * H_kv, 1, V]: columns a row's softmax does not span, when some do not
        if not bool(visible.all()):
            hidden_out = ~visible[:, None, None, :].expand(B, Hkv, 1, V).reshape(B * Hkv, 1, V)
        queries = query.float().reshape(B * Hkv, G, T, D)
        keys = key[:, :, :L] if whole else key[:, :, columns]
        keys_t = keys.float().transpose(-1, -2).reshape(B * Hkv, D, V)
        best = torch.full((B * Hkv, G, V), float("-inf"), device=key.device)
        # query blocks bound memory to G x block x V; one buffer serves every block (a fresh
        # multi-MB tensor per block costs more in page faults than the product itself on CPU)
        buffer = torch.empty(B * Hkv * G * min(self._QUERY_BLOCK, T) * V, device=key.device)
        block_max = torch.empty_like(best)
        for start in range(0, T, self._QUERY_BLOCK):
            stop = min(start + self._QUERY_BLOCK, T)
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
        best = best.view(B, Hkv, G, V).exp_()
        if self.plus:
            assert value is not None and output_weight is not None
            values = value[:, :, :L] if whole else value[:, :, columns]
            best = best * output_norms(values, output_weight)  # ||W_O^g v_i|| does not depend on j
        scores = best.amax(dim=2)
        if not whole:
            scores = torch.zeros(B, Hkv, L, device=key.device).index_copy_(2, columns, scores)
        return scores.masked_fill(~chunk.scored[:, None, :], 0.0)

    @staticmethod
    def pass_mask(chunk: PassChunk) -> torch.Tensor:
        """``[B, 1, T, L + T]``: what a pass query's scoring softmax spans: the chunk's visible context
        entries and the pass's own valid tokens up to itself (causal)."""
        T = chunk.ids.shape[1]
        own = torch.ones(T, T, dtype=torch.bool, device=chunk.mask.device).tril()[None] & chunk.mask[:, None, :]
        context = chunk.visible[:, None, :].expand(-1, T, -1)
        return torch.cat([context, own], dim=-1)[:, None]


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

def _encode(tokenizer: Any, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids[0].long()


def _assistant_suffix(tokenizer: Any) -> str:
    """The chat template's text between a user message's content and the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x" + _SEPARATOR}], tokenize=False,
                                             add_generation_prompt=True)
    return str(rendered).split(_SEPARATOR, 1)[1]


def _left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros(len(rows), T, dtype=torch.bool, device=rows[0].device)
    for b, row in enumerate(rows):
        ids[b, T - row.numel():] = row
        mask[b, T - row.numel():] = True
    return ids, mask
