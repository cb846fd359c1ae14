"""Presses in sequence (kvpress's ``ComposedPress``): each stage scores only what the stages before it kept."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, SerializeAsAny, field_validator, model_validator

from ..observation import Observation
from ..ranking import top_k
from .base import SCORERS, Scorer, register_scorer
from .knorm import KNorm
from .snapkv import SnapKV

_Keep = Annotated[float, Field(gt=0.0, le=1.0)]
_DEFAULT_KEEP: list[float | None] = [0.75]  # the default stages: KNorm keeps 3/4 of each head's entries


@register_scorer("composed")
class Composed(Scorer):
    """``stages[0]`` keeps ``keep[0]`` of each head's valid entries (its best, ties to the recent), ``stages[1]``
    scores only those (an observation whose ``key_mask`` is the survivors, one per kv head when heads kept
    different entries) and keeps ``keep[1]`` of them, ..., the last stage's scores rank the last survivors for the
    pipeline's budget; every other entry scores ``-inf`` (kept only when the budget exceeds the survivors).
    ``keep[i] = None``: stage ``i`` keeps exactly the entries it protects (``+inf``: a threshold stage such as
    SimLayerKV or DuoAttention). kvpress's ``ComposedPress([A(r_a), B(r_b)])`` is
    ``Pipeline(scorer=Composed(stages=[A, B], keep=[1 - r_a]), compression_ratio=1 - (1 - r_a) * (1 - r_b))``;
    a channel press after a token press (kvpress's SnapKV + ThinK example) is ``Pipeline(key_channels=...)``.

    Reads what any stage reads (the longest query window; the output weight or RoPE when a stage does; hidden
    states for at most one stage); Ada compares the last stage's scores when it may; chunked prefill when every
    stage supports it; a stage with a model pass of its own (KVzip) is refused, as kvpress refuses it. A stage's
    window queries are the prompt's last ones even where an earlier stage evicted their own entries."""

    name: Literal["composed"] = "composed"
    stages: list[SerializeAsAny[Scorer]] = Field(default_factory=lambda: [KNorm(), SnapKV()], min_length=2,
                                                 description="scorers in the order they prune")
    keep: list[_Keep | None] = Field(default_factory=lambda: _DEFAULT_KEEP.copy(),
                                     description="fraction of each head's entries every stage but the last keeps "
                                                 "(None: the entries it protects)")

    @field_validator("stages", mode="before")
    @classmethod
    def _build_stages(cls, value: Any) -> Any:
        return [SCORERS.build(v) for v in value] if isinstance(value, (list, tuple)) else value

    @model_validator(mode="after")
    def _check(self) -> "Composed":
        if len(self.keep) != len(self.stages) - 1:
            raise ValueError(f"keep needs one fraction per stage but the last ({len(self.stages) - 1}), "
                             f"got {len(self.keep)}")
        for stage in self.stages:
            if stage.needs_model_pass:
                raise ValueError(f"{type(stage).__name__} scores from a model pass of its own over the whole context: "
                                 "compose one-pass scorers")
        if sum(stage.reads_hidden_states for stage in self.stages) > 1:
            raise ValueError("at most one stage may score entries from hidden states (the host records one score "
                             "per entry)")
        return self

    def model_post_init(self, context: Any) -> None:
        # frozen model: what the stages read, set once on the instance (hosts read capabilities from it)
        flags = dict(comparable_across_heads=self.stages[-1].comparable_across_heads,
                     needs_output_weight=any(s.needs_output_weight for s in self.stages),
                     needs_rope=any(s.needs_rope for s in self.stages),
                     reads_hidden_states=any(s.reads_hidden_states for s in self.stages),
                     supports_chunked_prefill=all(s.supports_chunked_prefill for s in self.stages))
        for flag, value in flags.items():
            object.__setattr__(self, flag, value)

    def query_window(self) -> int | None:
        windows = [s.query_window() for s in self.stages]
        return None if any(w is None for w in windows) else max(w for w in windows if w is not None)

    def min_context(self) -> int:
        return max(s.min_context() for s in self.stages)

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return self.stages[-1].protected(lengths)

    def check_model(self, config: Any) -> None:
        for stage in self.stages:
            stage.check_model(config)

    def entry_scores(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return next(s for s in self.stages if s.reads_hidden_states).entry_scores(hidden, layer_idx)

    def score(self, obs: Observation) -> torch.Tensor:
        B, H, L = obs.keys.shape[:3]
        survivors = obs.key_mask[:, None, :].expand(B, H, L)
        for i, stage in enumerate(self.stages):
            scores = _stage_scores(stage, obs, survivors)
            if i == len(self.stages) - 1:
                return torch.where(survivors, scores, float("-inf"))
            fraction = self.keep[i]
            if fraction is None:  # a threshold stage: what it protects
                survivors = survivors & torch.isposinf(scores)
            else:
                count = torch.round(fraction * survivors.sum(-1).double()).long().clamp(min=1)
                survivors = top_k(scores.float().masked_fill(~survivors, float("-inf")), count, recent_first=True)
        raise AssertionError("unreachable: a composed scorer has at least two stages")  # pragma: no cover


def _stage_scores(stage: Scorer, obs: Observation, survivors: torch.Tensor) -> torch.Tensor:
    """``stage``'s ``[B, H, L]`` scores of ``obs`` restricted to ``survivors [B, H, L]`` (its window of queries, its
    hidden-state scores only when it reads them): one observation when every head of a row holds the same
    survivors, else one per kv head."""
    window = stage.query_window()
    n = obs.queries.shape[2] if window is None else min(window, obs.queries.shape[2])
    view = replace(obs, queries=obs.queries[:, :, obs.queries.shape[2] - n:],
                   entry_scores=obs.entry_scores if stage.reads_hidden_states else None)
    if bool((survivors == survivors[:, :1]).all()):
        return stage.score(replace(view, key_mask=survivors[:, 0])).float()
    H = obs.keys.shape[1]
    G = obs.queries.shape[1] // H
    D = obs.queries.shape[-1]

    def head(t: torch.Tensor | None, h: int) -> torch.Tensor | None:
        return None if t is None else t[:, h:h + 1]

    parts = []
    for h in range(H):
        weight = None if view.output_weight is None else view.output_weight[:, h * G * D:(h + 1) * G * D]
        parts.append(stage.score(replace(
            view, keys=view.keys[:, h:h + 1], values=view.values[:, h:h + 1],
            queries=view.queries[:, h * G:(h + 1) * G], key_mask=survivors[:, h], output_weight=weight,
            head_offset=view.head_offset + h, entry_scores=head(view.entry_scores, h),
            positions=head(view.positions, h))).float())
    return torch.cat(parts, dim=1)
