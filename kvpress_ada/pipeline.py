"""Pipeline: scorer x layer schedule x head allocator x evictor, declared as one pydantic config."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from .allocators import ALLOCATORS, LAYER_SCHEDULES, HeadAllocator, LayerSchedule, UniformHead, UniformLayer
from .evictors import EVICTORS, Evictor, TopK
from .observation import Observation
from .presses import SCORERS, Scorer

_REGISTRIES = {"scorer": SCORERS, "allocator": ALLOCATORS, "layers": LAYER_SCHEDULES, "evictor": EVICTORS}


class Pipeline(BaseModel):
    """A press: ``Pipeline(scorer=SnapKV(), allocator=AdaHead(alpha=0.2), compression_ratio=0.5)``.

    Exactly one of ``compression_ratio`` (fraction of the context's KV entries evicted, ``0 <= r < 1``)
    or ``budget`` (average tokens kept per kv head) is given. ``with press(model): ...`` compresses
    every layer right after its prefill attention, so the full cache of all layers is never held.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    scorer: SerializeAsAny[Scorer]
    allocator: SerializeAsAny[HeadAllocator] = Field(default_factory=UniformHead)
    layers: SerializeAsAny[LayerSchedule] = Field(default_factory=UniformLayer)
    evictor: SerializeAsAny[Evictor] = Field(default_factory=TopK)
    compression_ratio: float | None = Field(None, ge=0.0, lt=1.0)
    budget: int | None = Field(None, ge=1)

    @field_validator("scorer", "allocator", "layers", "evictor", mode="before")
    @classmethod
    def _build_component(cls, value: Any, info: ValidationInfo) -> Any:
        """Accept instances, registered names or dicts with a ``name`` (JSON/YAML configs)."""
        return _REGISTRIES[str(info.field_name)].build(value)

    @model_validator(mode="after")
    def _exactly_one_budget(self) -> "Pipeline":
        if (self.compression_ratio is None) == (self.budget is None):
            raise ValueError(
                "give exactly one of compression_ratio (0 <= r < 1, fraction evicted) or budget "
                f"(>= 1 tokens kept per kv head); got compression_ratio={self.compression_ratio}, budget={self.budget}"
            )
        return self

    # ----------------------------------------------------------------- policy
    @property
    def is_noop(self) -> bool:
        """Ratio 0 keeps every entry: the press leaves the model untouched."""
        return self.compression_ratio == 0.0

    def average_budget(self, lengths: torch.Tensor) -> torch.Tensor:
        """Average tokens kept per kv head for rows with ``lengths`` valid tokens, ``[B]`` long."""
        if self.budget is not None:
            return torch.clamp(torch.full_like(lengths, self.budget), max=lengths).clamp(min=1)
        assert self.compression_ratio is not None  # exactly one is set (validated)
        kept = torch.round((1.0 - self.compression_ratio) * lengths.double()).long()
        return torch.minimum(kept.clamp(min=1), lengths)

    def check_context(self, min_length: int) -> None:
        """Raise a clear error when the shortest row is too short for the scorer."""
        need = self.scorer.min_context()
        if min_length < need:
            raise ValueError(
                f"context of {min_length} tokens is shorter than {type(self.scorer).__name__} needs "
                f"({need} tokens, e.g. its observation window); use a longer context or a smaller window"
            )

    @property
    def evicts_at_end(self) -> bool:
        """Whether eviction waits for every layer's scores (a model-scope layer schedule, or a
        scorer with a model pass of its own): the full cache of all layers is then held until the
        end of prefill. Otherwise each layer is evicted right after its own prefill attention."""
        return bool(type(self.layers).needs_all_layers or type(self.scorer).needs_model_pass)

    def scores(self, obs: Observation) -> torch.Tensor:
        """The scorer's checked ``[B, H_kv, L]`` fp32 scores for one layer, padding at ``-inf``."""
        scores = self.scorer.score(obs)
        self._check_scores(scores, obs)
        return scores.float().masked_fill(~obs.key_mask[:, None, :], float("-inf"))

    def counts(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (padding at ``-inf``) and the kept count per (batch, kv head) for one layer."""
        if self.evicts_at_end:
            raise ValueError("this press evicts at the end of prefill (a model-scope layer schedule or a scorer "
                             "with its own model pass): use select_all() with every layer's observation")
        scores = self.scores(obs)
        lengths = obs.valid_lengths()
        budget = self.layers.layer_budget(self.average_budget(lengths), obs.layer_idx, obs.n_layers, lengths)
        return scores, self._allocate(scores, budget, obs.shard)

    def _allocate(self, scores: torch.Tensor, budget: torch.Tensor, shard: Any = None,
                  all_heads: torch.Tensor | None = None) -> torch.Tensor:
        """Counts of the heads in ``scores``. Under tensor parallelism (``shard``) an allocator that compares
        heads runs on every head's scores (``all_heads``, else all-gathered) and this rank keeps its own."""
        comparable = type(self.scorer).comparable_across_heads
        if shard is None or type(self.allocator).head_local:
            return self.allocator.allocate(scores, budget, comparable=comparable)
        full = shard.gather(scores) if all_heads is None else all_heads
        return shard.local(self.allocator.allocate(full, budget, comparable=comparable))

    def _check_scores(self, scores: torch.Tensor, obs: Observation) -> None:
        """The scorer's output contract: a ``[B, H_kv, L]`` tensor without NaN (checked eagerly;
        the NaN check is a host sync per layer at prefill, skipped while torch.compile traces)."""
        name = type(self.scorer).__name__
        expected = tuple(obs.keys.shape[:3])
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != expected:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"scorer {name} returned scores of shape {got} in layer {obs.layer_idx}; "
                             f"expected [B, H_kv, L] = {expected}")
        if not torch.compiler.is_compiling() and bool(torch.isnan(scores).any()):
            raise ValueError(f"scorer {name} returned NaN scores in layer {obs.layer_idx}; "
                             "scores must be numbers (+inf protects a token, -inf drops it)")

    def select(self, obs: Observation) -> torch.Tensor:
        """Score -> allocate -> select for one layer: the bool keep mask ``[B, H_kv, L]``."""
        with torch.no_grad():
            scores, counts = self.counts(obs)
            return self.evictor.select(scores, counts)

    def select_all(self, observations: list[Observation]) -> list[torch.Tensor]:
        """Keep masks of every layer from all layers' observations at once (the end-of-prefill path;
        equal to :meth:`select` layer by layer for layer-local schedules)."""
        if not self.evicts_at_end:
            return [self.select(obs) for obs in observations]
        if type(self.scorer).needs_model_pass and any(obs.pass_scores is None for obs in observations):
            raise ValueError(f"{type(self.scorer).__name__} scores from its own model pass: run it through "
                             "`with press(model)` or fan-out (capture_prefill), which run that pass")
        with torch.no_grad():
            scores = [self.scores(obs) for obs in observations]
            shard = observations[0].shard  # tensor parallelism: decisions across heads see every head's scores
            across = type(self.layers).needs_all_layers or not type(self.allocator).head_local
            everyone = [shard.gather(s) for s in scores] if shard is not None and across else scores
            lengths = observations[0].valid_lengths()
            avg = self.average_budget(lengths)
            if type(self.layers).needs_all_layers:
                budgets = self.layers.layer_budgets(  # type: ignore[attr-defined]
                    everyone, avg, lengths, comparable=type(self.scorer).comparable_across_heads)
            else:
                budgets = self.layers.budgets(avg, len(scores), lengths)
            return [self.evictor.select(s, self._allocate(s, budgets[:, i], shard, everyone[i] if across else None))
                    for i, s in enumerate(scores)]

    # ------------------------------------------------------------ integration
    def __call__(self, model):
        """Context manager applying this press to ``model`` (see :mod:`kvpress_ada.integration`)."""
        from .integration import apply_press

        return apply_press(self, model)
