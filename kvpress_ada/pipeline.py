"""Pipeline: scorer x layer schedule x head allocator x evictor, declared as one pydantic config."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ConfigDict, Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from .allocators import ALLOCATORS, LAYER_SCHEDULES, HeadAllocator, LayerSchedule, UniformHead, UniformLayer
from .components import OneLineErrors
from .evictors import EVICTORS, Evictor, TopK
from .observation import Observation
from .presses import SCORERS, Scorer

_REGISTRIES = {"scorer": SCORERS, "allocator": ALLOCATORS, "layers": LAYER_SCHEDULES, "evictor": EVICTORS}


class Pipeline(OneLineErrors):
    """A press: ``Pipeline(scorer=SnapKV(), allocator=AdaHead(alpha=0.2), compression_ratio=0.5)``.

    Prefill compression: at most one of ``compression_ratio`` (fraction of the context's KV entries
    evicted, ``0 <= r < 1``) or ``budget`` (average tokens kept per kv head). ``with press(model): ...``
    compresses every layer right after its prefill attention, so the full cache of all layers is
    never held.

    Decode compression: ``decode_budget=B, decode_interval=K`` (both or neither): while generating,
    every ``K`` appended tokens each layer is re-scored (window = the most recent generated queries),
    re-split across heads by the allocator and compacted in place back to ``B`` tokens per kv head
    on average (see :mod:`kvpress_ada.integration.decode_compression` for the exact bound). Prefill
    and decode compression compose; either may be given alone (a decode-only pipeline keeps the
    whole prompt until its first compaction).

    ``prefill_chunk=N`` (chunked prefill, :mod:`kvpress_ada.integration.chunked_prefill`): a forward
    that brings a context of ``L > N`` tokens into an empty cache under the press runs the model
    chunk by chunk instead of in one pass. Chunks are aligned on the *end* of the context (the last
    chunk always holds ``N`` tokens, the first ``L - (k - 1) N``), so every row of a left-padded
    batch is cut exactly as it would be alone. Each chunk's queries attend to the layer's
    compressed cache plus the chunk itself (causal, true RoPE positions: positions continue from the
    tokens seen, never from the compressed length), then that layer is compressed back to its
    *final* budget: the budget the one-shot press keeps for the whole context (``compression_ratio``
    is relative to the whole context's length, known when the model is called with it), clipped to
    the tokens seen so far. The cache thus never holds more than ``budget + N`` entries per kv head
    on average over the heads of a layer (per head with a uniform allocator), and the final cache
    holds exactly what the one-shot press would keep in total per layer and row. Entries kept
    earlier are re-scored with every chunk (the scorer sees the kept entries plus the chunk, with the
    chunk's queries: see each scorer's docstring). The forward returns the logits the caller asked
    for (``logits_to_keep``, all positions by default, gathered over the chunks), so ``model(ids)``,
    ``model.generate(ids)`` and :func:`kvpress_ada.generate` work unchanged. A context of ``L <= N``
    tokens runs exactly as without ``prefill_chunk``. Refused (one-line error at construction):
    presses that evict at the end of prefill (model-scope layer schedules such as ``AdaLayer``,
    scorers with their own model pass such as ``KVzip``) and scorers declaring
    ``supports_chunked_prefill = False``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    scorer: SerializeAsAny[Scorer]
    allocator: SerializeAsAny[HeadAllocator] = Field(default_factory=UniformHead)
    layers: SerializeAsAny[LayerSchedule] = Field(default_factory=UniformLayer)
    evictor: SerializeAsAny[Evictor] = Field(default_factory=TopK)
    compression_ratio: float | None = Field(None, ge=0.0, lt=1.0)
    budget: int | None = Field(None, ge=1)
    prefill_chunk: int | None = Field(None, ge=1, description="prefill the context in chunks of this many tokens, "
                                                                "compressing after each chunk (None: one pass)")
    decode_budget: int | None = Field(None, ge=1, description="average tokens per kv head kept while generating")
    decode_interval: int | None = Field(None, ge=1, description="generated tokens between two decode compactions")

    @field_validator("scorer", "allocator", "layers", "evictor", mode="before")
    @classmethod
    def _build_component(cls, value: Any, info: ValidationInfo) -> Any:
        """Accept instances, registered names or dicts with a ``name`` (JSON/YAML configs)."""
        return _REGISTRIES[str(info.field_name)].build(value)

    @model_validator(mode="after")
    def _exactly_one_budget(self) -> "Pipeline":
        both = self.compression_ratio is not None and self.budget is not None
        if both or (self.compression_ratio is None and self.budget is None and self.decode_budget is None):
            raise ValueError(
                "give exactly one of compression_ratio (0 <= r < 1, fraction evicted) or budget "
                "(>= 1 tokens kept per kv head) for prefill compression, or neither with decode_budget and "
                f"decode_interval for decode-only compression; got compression_ratio={self.compression_ratio}, "
                f"budget={self.budget}, decode_budget={self.decode_budget}")
        if (self.decode_budget is None) != (self.decode_interval is None):
            raise ValueError("decode_budget (tokens kept per kv head while generating) and decode_interval "
                             "(generated tokens between compactions) go together: give both or neither; got "
                             f"decode_budget={self.decode_budget}, decode_interval={self.decode_interval}")
        if self.decode_budget is not None:
            from .integration.decode_compression import check_decode_support

            check_decode_support(self)
        return self

    @model_validator(mode="after")
    def _chunked_prefill_supported(self) -> "Pipeline":
        if self.prefill_chunk is None:
            return self
        scorer = type(self.scorer)
        if scorer.needs_model_pass:
            reason = f"scorer {scorer.__name__} scores with its own model pass over the whole context"
        elif type(self.layers).needs_all_layers:
            reason = (f"layer schedule {type(self.layers).__name__} splits the budget across layers from every "
                      "layer's scores of the whole context")
        elif not scorer.supports_chunked_prefill:
            reason = f"scorer {scorer.__name__} does not support chunked prefill"
        else:
            return self
        raise ValueError(f"prefill_chunk={self.prefill_chunk} is not supported: {reason}; "
                         "use prefill_chunk=None (one-shot prefill)")

    # ----------------------------------------------------------------- policy
    @property
    def is_noop(self) -> bool:
        """Ratio 0 without chunked prefill or decode compression keeps every entry: the press leaves the
        model untouched. (With ``prefill_chunk`` the press still runs the prefill chunk by chunk.)"""
        return self.compression_ratio == 0.0 and self.prefill_chunk is None and self.decode_budget is None

    @property
    def compresses_prefill(self) -> bool:
        """Whether the prefill is compressed (a ``budget``, or a ``compression_ratio`` above 0)."""
        return self.budget is not None or bool(self.compression_ratio)

    @property
    def compresses_decode(self) -> bool:
        """Whether the cache is compacted while generating (``decode_budget``/``decode_interval``)."""
        return self.decode_budget is not None

    def chunks(self, length: int) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` of a chunked prefill of ``length`` tokens, aligned on the end:
        every chunk but the first holds ``prefill_chunk`` tokens (one chunk without chunking)."""
        n = self.prefill_chunk
        if n is None or length <= n:
            return [(0, length)]
        bounds = list(range(length, 0, -n))[::-1]
        starts = [0] + bounds[:-1]
        return list(zip(starts, bounds))

    def average_budget(self, lengths: torch.Tensor) -> torch.Tensor:
        """Average tokens kept per kv head for rows with ``lengths`` valid tokens, ``[B]`` long."""
        if self.budget is not None:
            return torch.clamp(torch.full_like(lengths, self.budget), max=lengths).clamp(min=1)
        if self.compression_ratio is None:  # decode-only pipeline: the prefill keeps everything
            return lengths.clone()
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
        budget = self.layers.layer_budget(self.average_budget(lengths), obs.layer_idx, obs.n_layers, lengths,
                                          self.scorer.protected(lengths))
        return scores, self._allocate(scores, budget, obs.layer_idx, obs.shard)

    def _allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int, shard: Any = None,
                  all_heads: torch.Tensor | None = None) -> torch.Tensor:
        """Counts of the heads in ``scores``. Under tensor parallelism (``shard``) an allocator that compares
        heads runs on every head's scores (``all_heads``, else all-gathered) and this rank keeps its own."""
        comparable = type(self.scorer).comparable_across_heads
        if shard is None or type(self.allocator).head_local:
            return self.allocator.allocate_layer(scores, budget, layer_idx, comparable=comparable)
        full = shard.gather(scores) if all_heads is None else all_heads
        return shard.local(self.allocator.allocate_layer(full, budget, layer_idx, comparable=comparable))

    def check_model(self, model: Any) -> None:
        """Raise ``ValueError`` when a component cannot serve ``model`` (a calibration made for another
        model, no tokenizer for a model pass); called once when the press meets the model (``with press(model)``,
        fan-out)."""
        for component in (self.scorer, self.layers, self.allocator, self.evictor):
            component.check_model(model.config)
        if type(self.scorer).needs_model_pass:  # its tokenizer, before any prefill
            from .integration.model_pass import check_pass_inputs

            check_pass_inputs(model, self.scorer)

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
                budgets = self.layers.floored_budgets(avg, len(scores), lengths, self.scorer.protected(lengths))
            return [self.evictor.select(s, self._allocate(s, budgets[:, i], obs.layer_idx, shard,
                                                          everyone[i] if across else None))
                    for i, (s, obs) in enumerate(zip(scores, observations))]

    # ------------------------------------------------------------ integration
    def __call__(self, model, compile: bool | None = None):
        """Context manager applying this press to ``model`` (see :mod:`kvpress_ada.integration`).

        ``compile``: compiled decode steps over the compressed cache (default: on CUDA, off on CPU;
        ``$KVPRESS_ADA_COMPILE=0`` turns the default off; see :mod:`kvpress_ada.integration.compiled`)."""
        from .integration import apply_press

        return apply_press(self, model, compile=compile)
