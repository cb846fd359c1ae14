"""Pipeline: scorer x layer schedule x head allocator x evictor, declared as one pydantic config."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from .allocators import ALLOCATORS, LAYER_SCHEDULES, HeadAllocator, LayerSchedule, UniformHead, UniformLayer
from .allocators.heads import fit_to_valid
from .channels import KEY_CHANNELS, KeyChannels, zero_channels
from .components import OneLineErrors
from .evictors import EVICTORS, Evictor, TopK
from .hosts.base import host_for
from .observation import Budget, LayerView, Observation
from .readers import READERS, Reader
from .scorers import SCORERS, Scorer
from .storage import STORAGES, FullPrecision, Storage

MAX_BUDGET = 2**31 - 1  # tokens per kv head: the ragged cache's offsets are int32
_REGISTRIES = {"scorer": SCORERS, "allocator": ALLOCATORS, "layers": LAYER_SCHEDULES, "evictor": EVICTORS,
               "storage": STORAGES, "key_channels": KEY_CHANNELS, "reader": READERS}


class Pipeline(OneLineErrors):
    """A press: ``Pipeline(scorer=SnapKV(), allocator=AdaHead(alpha=0.2), compression_ratio=0.5)``.

    Prefill compression: at most one of ``compression_ratio`` (fraction of the context's entries
    evicted, ``0 <= r < 1``) or ``budget`` (average tokens kept per kv head). ``prefill_chunk=N``:
    a longer prompt is prefilled and compressed chunk by chunk (end-aligned chunks; the final cache
    holds the one-shot totals). ``decode_budget=B, decode_interval=K``: every ``K`` generated tokens each
    layer is compacted back to ``B`` tokens per kv head on average; ``decode_ratio=r`` instead of
    ``decode_budget``: back to ``(1 - r)`` of the tokens each row has seen (prompt and generated). An
    allocator that sets its own budget (``Threshold``) needs none of these: a budget then caps each head.
    ``reader=TopPages(budget=b)``: each decode step reads the kept entries of selected pages only
    (:mod:`kvpress_ada.readers`); with no budget at all the press evicts nothing and only reads sparsely (Quest).
    :meth:`keep` is the whole selection policy; ``with press(model):`` applies it (modes and their
    semantics: ``docs/design.md``). Impossible combinations are refused at construction, in one line.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    scorer: SerializeAsAny[Scorer]
    allocator: SerializeAsAny[HeadAllocator] = Field(default_factory=UniformHead)
    layers: SerializeAsAny[LayerSchedule] = Field(default_factory=UniformLayer)
    evictor: SerializeAsAny[Evictor] = Field(default_factory=TopK)
    storage: SerializeAsAny[Storage] = Field(default_factory=FullPrecision)
    key_channels: SerializeAsAny[KeyChannels] | None = Field(
        None, description="prune channels of the kept keys at the end of the prompt (ThinK); None: keep them all")
    compression_ratio: float | None = Field(None, ge=0.0, lt=1.0)
    budget: int | None = Field(None, ge=1, le=MAX_BUDGET)
    prefill_chunk: int | None = Field(None, ge=1, description="prefill the context in chunks of this many tokens, "
                                                                "compressing after each chunk (None: one pass)")
    decode_budget: int | None = Field(None, ge=1, le=MAX_BUDGET,
                                      description="average tokens per kv head kept while generating")
    decode_interval: int | None = Field(None, ge=1, description="generated tokens between two decode compactions")
    decode_ratio: float | None = Field(None, ge=0.0, lt=1.0,
                                       description="fraction of the tokens seen so far (prompt and generated) "
                                                   "evicted at each decode compaction (instead of decode_budget)")
    reader: SerializeAsAny[Reader] | None = Field(
        None, description="the pages of the kept cache each decode step reads (kvpress_ada.readers, e.g. "
                          "top_pages); None: every kept entry. With no budget at all nothing is evicted")

    @field_validator("scorer", "allocator", "layers", "evictor", "storage", "key_channels", "reader", mode="before")
    @classmethod
    def _build_component(cls, value: Any, info: ValidationInfo) -> Any:
        """Accept instances, registered names or dicts with a ``name`` (JSON/YAML configs)."""
        if value is None and info.field_name in ("key_channels", "reader"):
            return None
        return _REGISTRIES[str(info.field_name)].build(value)

    @model_validator(mode="after")
    def _merge_supported(self) -> "Pipeline":
        """A quantized layer moves its records unchanged once compressed: merging cannot rewrite their values."""
        if self.evictor.merge is not None and self.storage.quantized and (self.prefill_chunk is not None
                                                                          or self.compresses_decode):
            raise ValueError(f"storage={self.storage.label!r} moves a compressed layer's entries as stored, so the "
                             f"evictor's merge ({type(self.evictor.merge).__name__}) cannot rewrite their values at a "
                             "later chunk or decode compaction: use full-precision storage or compress once")
        return self

    @model_validator(mode="after")
    def _key_channels_supported(self) -> "Pipeline":
        """Channels are pruned once, at the end of the prompt, from the scorer's window queries (``channels``)."""
        if self.key_channels is None:
            return self
        name = type(self.key_channels).__name__
        if self.prefill_chunk is not None:
            raise ValueError(f"key_channels={name} prunes key channels once, at the end of the prompt; chunked prefill "
                             f"(prefill_chunk={self.prefill_chunk}) would choose them again over pruned keys: use "
                             "prefill_chunk=None")
        if self.compresses_decode:
            raise ValueError(f"key_channels={name} prunes key channels once, at the end of the prompt; decode "
                             "compression would choose them again over pruned keys: drop decode_budget/decode_ratio")
        if type(self.key_channels).reads_queries and self.scorer.query_window() == 0:
            raise ValueError(f"key_channels={name} scores channels with the scorer's window queries, and scorer "
                             f"{type(self.scorer).__name__} reads none (query_window 0): use a scorer that reads "
                             "queries (e.g. snapkv)")
        return self

    @model_validator(mode="after")
    def _reader_supported(self) -> "Pipeline":
        """A reader reads pages of the ragged cache (full precision or records: its summaries bound the keys as
        they read back)."""
        if self.reader is None:
            return self
        name = type(self.reader).__name__
        if not type(self.evictor).frees_memory:
            raise ValueError(f"reader {name} reads pages of the ragged cache, but the evictor "
                             f"{type(self.evictor).__name__} keeps the dense cache: use evictor='topk' with a reader")
        return self

    @model_validator(mode="after")
    def _exactly_one_budget(self) -> "Pipeline":
        both = self.compression_ratio is not None and self.budget is not None
        thresholded = type(self.allocator).sets_budget
        if both or (self.compression_ratio is None and self.budget is None and not self.compresses_decode
                    and not thresholded and self.reader is None):
            raise ValueError(
                "give exactly one of compression_ratio (0 <= r < 1, fraction evicted) or budget "
                "(>= 1 tokens kept per kv head) for prefill compression, or neither with decode_budget (or "
                "decode_ratio) and decode_interval for decode-only compression, or neither with a reader (no "
                "eviction, sparse reads); got compression_ratio="
                f"{self.compression_ratio}, budget={self.budget}, decode_budget={self.decode_budget}")
        if self.decode_budget is not None and self.decode_ratio is not None:
            raise ValueError("give at most one of decode_budget (tokens kept per kv head while generating) and "
                             "decode_ratio (fraction of the tokens seen evicted while generating); got "
                             f"decode_budget={self.decode_budget}, decode_ratio={self.decode_ratio}")
        if self.compresses_decode != (self.decode_interval is not None):
            raise ValueError("decode_budget or decode_ratio (what is kept while generating) and decode_interval "
                             "(generated tokens between compactions) go together: give both or neither; got "
                             f"decode_budget={self.decode_budget}, decode_ratio={self.decode_ratio}, "
                             f"decode_interval={self.decode_interval}")
        if self.compresses_decode:
            self._check_decode_support()
        if self.storage.quantized and not type(self.evictor).frees_memory:
            raise ValueError(f"storage={self.storage.label!r} stores the kept entries quantized, but the evictor "
                             f"{type(self.evictor).__name__} keeps the dense full-precision cache and hides entries: "
                             "use evictor='topk' with a quantized storage")
        if thresholded and type(self.layers).needs_all_layers:
            raise ValueError(f"the allocator {type(self.allocator).__name__} keeps what clears its threshold, so the "
                             f"layer schedule {type(self.layers).__name__} has no budget to split across layers: use "
                             "the uniform layer schedule (a compression_ratio or budget then caps each head)")
        return self

    def _check_decode_support(self) -> None:
        """Raise a one-line ``ValueError`` when this press cannot re-score the cache while generating."""
        name = type(self.scorer).__name__
        if type(self.scorer).needs_model_pass:
            raise ValueError(f"{name} scores from a model pass over the prefill and cannot re-score the cache while "
                             "generating: drop decode_budget/decode_interval or use a windowed scorer (e.g. snapkv)")
        if self.scorer.query_window() is None:
            raise ValueError(f"{name} reads every query since the start (query_window None) but decode compression "
                             "keeps only a window of recent queries: use a scorer with a finite window")

    @model_validator(mode="after")
    def _chunked_prefill_supported(self) -> "Pipeline":
        if self.prefill_chunk is None:
            return self
        scorer = self.scorer  # capabilities read from the instance: a wrapping scorer (ChunkKV) carries its own
        if scorer.needs_model_pass:
            reason = f"scorer {type(scorer).__name__} scores with its own model pass over the whole context"
        elif not scorer.supports_chunked_prefill:
            reason = f"scorer {type(scorer).__name__} does not support chunked prefill"
        else:
            return self
        raise ValueError(f"prefill_chunk={self.prefill_chunk} is not supported: {reason}; "
                         "use prefill_chunk=None (one-shot prefill)")

    @model_validator(mode="after")
    def _rerotation_supported(self) -> "Pipeline":
        if self.evictor.rerotate and self.storage.quantized and (self.prefill_chunk is not None
                                                                 or self.compresses_decode):
            raise ValueError(f"storage={self.storage.label!r} moves the kept records unchanged when it compresses "
                             "again (chunked prefill, decode compaction), so it cannot re-rotate their keys "
                             "(evictor rerotate=True): use full-precision storage or compress once")
        if self.evictor.rerotate and self.key_channels is not None:
            raise ValueError(f"key_channels={type(self.key_channels).__name__} zeroes key channels that re-rotation "
                             "(evictor rerotate=True) would mix back in (RoPE rotates channel pairs): use one of them")
        return self

    def replace(self, **changes: Any) -> "Pipeline":
        """A validated copy with ``changes`` (field names; components as instances, names or dicts): every check
        of construction runs again, and an unknown field or a bad value is refused in one line (``ConfigError``)."""
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return type(self)(**{**fields, **changes})

    # ------------------------------------------------------------ capabilities
    @property
    def is_noop(self) -> bool:
        """Ratio 0 without chunked prefill or decode compression keeps every entry: the press leaves the
        model untouched. (With ``prefill_chunk`` the press still runs the prefill chunk by chunk.)"""
        return not self.compresses_prefill and self.prefill_chunk is None and not self.compresses_decode

    @property
    def compresses_prefill(self) -> bool:
        """Whether the prefill is compressed (a ``budget``, a ``compression_ratio`` above 0, an
        allocator that keeps what clears a threshold, a quantized storage: at ratio 0 it keeps every
        entry, quantized, or key channels pruned; a reader: every kept entry laid out ragged, read by pages)."""
        return (self.budget is not None or bool(self.compression_ratio) or type(self.allocator).sets_budget
                or self.storage.quantized or self.key_channels is not None or self.reader is not None)

    @property
    def compresses_decode(self) -> bool:
        """Whether the cache is compacted while generating (``decode_budget`` or ``decode_ratio``, with
        ``decode_interval``)."""
        return self.decode_budget is not None or self.decode_ratio is not None

    def check_context(self, min_length: int) -> None:
        """Raise a clear error when the shortest row is too short for the scorer."""
        need = self.scorer.min_context()
        if min_length < need:
            raise ValueError(
                f"context of {min_length} tokens is shorter than {type(self.scorer).__name__} needs "
                f"({need} tokens, e.g. its observation window); use a longer context or a smaller window"
            )

    def check_config(self, config: Any) -> None:
        """Raise ``ValueError`` when a component of this press cannot serve a model with this ``config``
        (a calibration or surrogate made for another model, a storage that cannot hold its entries); a
        host calls it once when the press meets a model, with its own checks."""
        for component in (self.scorer, self.layers, self.allocator, self.evictor, self.storage, self.reader):
            if component is not None:
                component.check_model(config)

    # ------------------------------------------------------------------ budgets
    def average_budget(self, lengths: torch.Tensor) -> torch.Tensor:
        """Average tokens kept per kv head for rows with ``lengths`` valid tokens, ``[B]`` long."""
        if self.budget is not None:
            return torch.clamp(torch.full_like(lengths, self.budget), max=lengths).clamp(min=1)
        if self.compression_ratio is None:  # decode-only pipeline: the prefill keeps everything
            return lengths.clone()
        kept = torch.round((1.0 - self.compression_ratio) * lengths.double()).long()
        return torch.minimum(kept.clamp(min=1), lengths)

    def prefill_budget(self, lengths: torch.Tensor, seen: torch.Tensor | None = None) -> Budget:
        """The budget of a prefill whose rows hold ``lengths [B]`` real tokens; ``seen [B]``: the
        tokens a chunked prefill has brought so far (each layer then keeps at most that many per head;
        a model-scope schedule splits ``n_layers * min(average, seen)`` across the layers)."""
        if seen is not None and type(self.layers).needs_all_layers:
            return Budget(average=self.average_budget(lengths), lengths=seen, cap=seen)
        return Budget(average=self.average_budget(lengths), lengths=lengths, cap=seen)

    def decode_budget_for(self, seen: torch.Tensor) -> Budget:
        """The budget of a decode compaction of rows that have seen ``seen [B]`` real tokens (prompt and
        generated, padding not counted): ``decode_budget``, or ``round((1 - decode_ratio) * seen)`` (at least 1)
        tokens per kv head on average."""
        if self.decode_ratio is not None:
            kept = torch.round((1.0 - self.decode_ratio) * seen.double()).long().clamp(min=1)
            return Budget(average=torch.minimum(kept, seen.long().clamp(min=1)), lengths=seen)
        if self.decode_budget is None:
            raise ValueError("this press has no decode_budget or decode_ratio: it does not compact while generating")
        return Budget(average=torch.full_like(seen, self.decode_budget), lengths=seen)

    # ------------------------------------------------------------------- policy
    def keep(self, views: Sequence[LayerView], budget: Budget) -> list[torch.Tensor]:
        """The selection policy, whole: the bool keep mask ``[B, H_kv, L]`` over each layer's view.

        Score each layer (:meth:`LayerView.observations`: the whole layer, or head by head when its
        heads hold different entries); give each layer its per-head budget ``b_l`` (the layer schedule;
        a model-scope schedule needs every layer's view in one call), clipped to ``budget.cap``; split
        ``H_kv * b_l`` across kv heads (head allocator); fit the counts to what each head holds (the
        excess of a head goes to the best remaining entries of its row's other heads); select (evictor).
        Each row of layer ``l`` keeps exactly ``min(H_kv * b_l, valid entries)`` entries; padding never.
        Every mode that evicts (one-shot, end of prefill, chunked prefill, decode compaction, fan-out)
        calls this and nothing else.
        """
        if not views:
            return []
        if type(self.layers).needs_all_layers and len(views) != views[0].rank[1]:
            raise ValueError(f"the layer schedule {type(self.layers).__name__} splits the budget across layers: "
                             f"keep() needs every layer's view at once ({views[0].rank[1]}), got {len(views)}")
        if type(self.scorer).needs_model_pass and any(v.pass_scores is None for v in views):
            raise ValueError(f"{type(self.scorer).__name__} scores from its own model pass: run it through "
                             "`with press(model)` or fan-out (capture_prefill), which run that pass")
        with torch.no_grad():
            if type(self.layers).needs_all_layers:
                return self._keep_model_scope(views, budget)
            protected = self.scorer.protected(budget.lengths)
            return [self._keep_layer(v, self._cap(self.layers.layer_budget(
                budget.average, *v.rank, budget.lengths, protected), budget)) for v in views]

    @property
    def rewrites_kept(self) -> bool:
        """Whether an eviction rewrites the entries it keeps (:meth:`rewrite`): the evictor merges the dropped
        entries into them, or key channels are pruned."""
        return self.evictor.merge is not None or self.key_channels is not None

    def rewrite(self, view: LayerView, keep: torch.Tensor, held: Any) -> Any:
        """``held`` (a host's :class:`~kvpress_ada.runtime.views.HeldEntries` of the layer ``view`` shows, same
        columns) as the layer should keep it after the selection ``keep``: the evictor's ``merge`` folds the dropped
        entries' values into kept ones, then :attr:`key_channels` zeroes the pruned channels of the keys; unchanged
        when neither is set. Hosts call it at every eviction, before the layer keeps ``keep``."""
        if not self.rewrites_kept:
            return held
        with torch.no_grad():
            merge = self.evictor.merge
            if merge is not None:
                scores = self._scores(view) if type(merge).needs_scores else None
                values = merge.merge(held.keys, held.values, held.valid, keep.to(held.valid.device), scores)
                held = replace(held, values=values, rewritten=True)
            if self.key_channels is not None:
                channels = self.key_channels.channel_keep(view, keep)
                held = replace(held, keys=zero_channels(held.keys, channels.to(held.keys.device)), rewritten=True)
        return held

    def _keep_layer(self, view: LayerView, budget: torch.Tensor) -> torch.Tensor:
        """Keep mask of one layer with per-head budget ``budget [B]``. Rows whose valid entries all fit
        keep them without being scored (a chunked prefill's first chunks may hold only padding); while
        torch.compile traces, every row is scored (no host sync: the same masks for rows with entries)."""
        H = view.keys.shape[1]
        keep = view.valid.clone()
        rows = None
        if not torch.compiler.is_compiling() and not type(self.allocator).sets_budget:
            evict = view.valid.sum((-1, -2)) > H * budget
            if not bool(evict.any()):  # one host sync per layer
                return keep
            rows = None if bool(evict.all()) else evict.nonzero()[:, 0]
        part = view if rows is None else view.rows(rows)
        selected = self._select(self._scores(part), budget if rows is None else budget[rows], part)
        if rows is None:
            return selected
        keep[rows] = selected
        return keep

    def _keep_model_scope(self, views: Sequence[LayerView], budget: Budget) -> list[torch.Tensor]:
        """Keep masks of every layer under a layer schedule that compares the layers' scores."""
        scores = [self._scores(v) for v in views]
        shard = views[0].shard  # tensor parallelism: decisions across heads see every head's scores
        everyone = [shard.gather(s) for s in scores] if shard is not None else scores
        width = max(s.shape[-1] for s in everyone)  # layers of a chunked or decoding cache hold different widths
        table = self.layers.layer_budgets(  # type: ignore[attr-defined]
            [F.pad(s, (width - s.shape[-1], 0), value=float("-inf")) for s in everyone], budget.average,
            budget.lengths, comparable=self.scorer.comparable_across_heads)
        return [self._select(s, self._cap(table[:, i], budget), v, full)
                for i, (s, v, full) in enumerate(zip(scores, views, everyone))]

    def _select(self, scores: torch.Tensor, budget: torch.Tensor, view: LayerView,
                all_heads: torch.Tensor | None = None) -> torch.Tensor:
        """Allocate ``budget [B]`` per head across the view's heads, fit the counts to what each head
        holds, select: the keep mask of one layer (never padding)."""
        counts = self._allocate(scores, budget, view.layer_idx, view.shard, all_heads)
        counts = fit_to_valid(scores, counts, view.valid, self.evictor.select)
        return self.evictor.select(scores, counts) & view.valid

    @staticmethod
    def _cap(layer_budget: torch.Tensor, budget: Budget) -> torch.Tensor:
        return layer_budget if budget.cap is None else torch.minimum(layer_budget, budget.cap.to(layer_budget.device))

    def select(self, obs: Observation) -> torch.Tensor:
        """:meth:`keep` of one layer's prefill observation (every kv head holds the observation's
        tokens): the bool keep mask ``[B, H_kv, L]``. For scorer and allocator studies."""
        return self.keep([LayerView.of(obs)], self.prefill_budget(obs.valid_lengths()))[0]

    def _scores(self, view: LayerView) -> torch.Tensor:
        """The scorer's checked fp32 scores ``[B, H_kv, L]`` of one view, ``-inf`` where not valid."""
        parts = []
        for obs in view.observations():
            # inference tensors track no version; while torch.compile traces, nothing is checked (no graph break)
            read = [] if torch.compiler.is_compiling() else [
                t for t in (obs.keys, obs.values, obs.queries) if isinstance(t, torch.Tensor) and not t.is_inference()]
            versions = [t._version for t in read]
            scores = self.scorer.score(obs)
            if versions != [t._version for t in read]:
                raise RuntimeError(f"scorer {type(self.scorer).__name__} modified its observation's keys, values or "
                                   "queries in place (they are the cache's own tensors); compute on copies")
            self._check_scores(scores, obs)
            parts.append(scores.float())
        scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return scores.masked_fill(~view.valid, float("-inf"))

    def _allocate(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int, shard: Any = None,
                  all_heads: torch.Tensor | None = None) -> torch.Tensor:
        """Counts of the heads in ``scores``. Under tensor parallelism (``shard``) an allocator that compares
        heads runs on every head's scores (``all_heads``, else all-gathered) and this rank keeps its own."""
        comparable = self.scorer.comparable_across_heads
        if shard is None or type(self.allocator).head_local:
            return self.allocator.allocate_layer(scores, budget, layer_idx, comparable=comparable)
        full = shard.gather(scores) if all_heads is None else all_heads
        return shard.local(self.allocator.allocate_layer(full, budget, layer_idx, comparable=comparable))

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

    # ------------------------------------------------------------------- hosts
    def __call__(self, model: Any, **options: Any) -> Any:
        """Context manager applying this press to ``model`` inside the ``with`` block, through the host that
        runs it (:func:`kvpress_ada.hosts.base.host_for`; a transformers model: :mod:`kvpress_ada.hosts.transformers`,
        whose option ``compile`` turns compiled decode steps on or off)."""
        return host_for(model).apply(self, model, **options)
