"""ChunkKV (Liu et al., 2025, arXiv 2502.00299): semantic chunks of consecutive tokens are kept or evicted whole."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, SerializeAsAny, field_validator

from ..observation import Observation
from .base import SCORERS, Scorer, register_scorer
from .snapkv import SnapKV

#: what a wrapped scorer declares and ChunkKV declares in its place (read from the instance, as every host does)
_FORWARDED = ("comparable_across_heads", "needs_output_weight", "needs_rope", "supports_chunked_prefill",
              "reads_hidden_states")


@register_scorer("chunkkv")
class ChunkKV(Scorer):
    """Wraps any scorer: every entry gets the mean of the wrapped scorer's scores over its chunk of ``length``
    consecutive entries, so a top-k keeps whole chunks (the boundary chunk keeps its most recent entries, as
    ties go to the recent). ``shared``: one ranking per layer, the kv heads' scores summed before the mean (the
    paper's and kvpress's choice); ``False``: each kv head ranks its own chunks (what Ada can compare).

    Entries the wrapped scorer protects (``+inf``) stay protected one by one; a chunk's mean runs over its other
    valid entries. Chunks are counted from each row's most recent entry (the first chunk may be short), so left
    padding changes nothing; kvpress counts them from the first token and keeps ``int(chunks * (1 - r))`` whole
    chunks, where the pipeline keeps exactly its budget. Under chunked prefill or decode compression a chunk is
    a run of consecutive entries the head holds. What the wrapped scorer reads (window, output weight, RoPE,
    hidden states), protects and whether Ada may compare its scores across heads are ChunkKV's too; a scorer
    with a model pass of its own (KVzip) is refused."""

    name: Literal["chunkkv"] = "chunkkv"
    scorer: SerializeAsAny[Scorer] = Field(default_factory=SnapKV, description="the scorer whose scores are pooled")
    length: int = Field(20, ge=1, description="entries per chunk")
    shared: bool = Field(True, description="one chunk ranking for all kv heads of a layer (their scores summed)")

    @field_validator("scorer", mode="before")
    @classmethod
    def _build_scorer(cls, value: Any) -> Any:
        return SCORERS.build(value)

    @field_validator("scorer")
    @classmethod
    def _no_model_pass(cls, value: Scorer) -> Scorer:
        if value.needs_model_pass:
            raise ValueError(f"ChunkKV pools per-entry scores of one layer; {type(value).__name__} scores from a "
                             "model pass of its own: wrap a scorer without one (e.g. snapkv)")
        return value

    def model_post_init(self, context: Any) -> None:
        for flag in _FORWARDED:  # frozen model: the wrapped scorer's capabilities, set once on the instance
            object.__setattr__(self, flag, getattr(self.scorer, flag))

    def query_window(self) -> int | None:
        return self.scorer.query_window()

    def min_context(self) -> int:
        return self.scorer.min_context()

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return self.scorer.protected(lengths)

    def check_model(self, config: Any) -> None:
        self.scorer.check_model(config)

    def entry_scores(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.scorer.entry_scores(hidden, layer_idx)

    def score(self, obs: Observation) -> torch.Tensor:
        whole = obs.shard is not None and obs.n_kv_heads == obs.shard.n_local  # the layer's heads span ranks
        return chunk_means(self.scorer.score(obs).float(), obs.key_mask, self.length, self.shared,
                           obs.shard if whole else None)


def chunk_means(scores: torch.Tensor, key_mask: torch.Tensor, length: int, shared: bool,
                shard: Any = None) -> torch.Tensor:
    """``[B, H, L]``: each valid, unprotected entry of ``scores [B, H, L]`` replaced by the mean of the
    unprotected entries of its chunk (``length`` consecutive valid entries of ``key_mask [B, L]``, counted from
    the row's last; with ``shared`` the mean runs over every head's entries of the chunk, one ranking for all
    heads; ``shard``: under tensor parallelism, the mean also runs over the other ranks' heads); ``+inf`` entries
    and padding keep their scores."""
    B, H, L = scores.shape
    from_end = key_mask.long().flip(-1).cumsum(-1).flip(-1) - 1  # [B, L] valid entries after this one
    chunk = (from_end.clamp(min=0) // length)[:, None, :].expand(B, H, L)
    counted = key_mask[:, None, :] & torch.isfinite(scores)
    values = torch.where(counted, scores, torch.zeros_like(scores))
    weights = counted.to(values.dtype)
    if shared:  # the heads of a row hold the same entries here: one mean over every head's entries of a chunk
        if shard is not None:
            values, weights = shard.gather(values), shard.gather(weights)
        values, weights = values.sum(1, keepdim=True).expand(B, H, L), weights.sum(1, keepdim=True).expand(B, H, L)
    n_chunks = L // length + 1
    total = values.new_zeros(B, H, n_chunks).scatter_add_(2, chunk, values)
    count = values.new_zeros(B, H, n_chunks).scatter_add_(2, chunk, weights)
    means = (total / count.clamp(min=1)).gather(2, chunk)
    return torch.where(counted, means, scores)
