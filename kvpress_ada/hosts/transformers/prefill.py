"""Prefill handler: compress each layer right after its dense prefill attention, or, when the
press evicts at the end of prefill (a model-scope layer schedule, a scorer with its own model pass),
keep every layer's view and evict all layers at once when the forward ends."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ...observation import Budget, LayerView
from ...runtime import Due, Schedule
from ...scorers.base import PassScorer
from .attention import Handler, dense_attention, layer_view, record_entry_scores
from .eviction import Eviction
from .model_pass import model_pass_scores
from .press_cache import PressCache
from .tensor_parallel import HeadShard

if TYPE_CHECKING:
    from ...pipeline import Pipeline


@dataclass
class PrefillRun(Handler):
    """The handler of one prefill forward under ``press`` (``key_mask [B, L]``: its real tokens; ``due``: the
    eviction the runtime's schedule makes due at the prompt's end)."""

    press: Pipeline
    cache: PressCache
    model: torch.nn.Module
    key_mask: torch.Tensor
    due: Due
    input_ids: torch.Tensor | None = None
    next_position: torch.Tensor | None = None  # [B] RoPE position after the prefill (model passes)
    shard: HeadShard | None = None  # tensor parallelism: this rank's kv heads
    eviction: Eviction = field(init=False)

    def __post_init__(self) -> None:
        self.eviction = Eviction(self.press, self.cache, waits=self.due.waits)

    def handles_prefill(self, layer_idx: int) -> bool:
        return not self.cache.is_compressed(layer_idx)

    @property
    def traceable(self) -> bool:
        return False

    def record_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """The hidden states entering layer ``layer_idx``'s attention (a scorer reading them scores here)."""
        if self.press.scorer.reads_hidden_states:
            record_entry_scores(self.cache.state, self.press.scorer, layer_idx, hidden, self.shard)

    def after_prefill(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float) -> None:
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        if layer_idx not in self.cache.state.scope:  # a hybrid model's sliding-window layer keeps its window
            return
        held = self.cache.view(layer_idx)
        view = layer_view(self.press.scorer, self.model, module, len(self.cache.layers), held, query, scaling,
                          self.shard, state=self.cache.state)
        if self.eviction.layer(layer_idx, view, held, self._budget):
            self._done(layer_idx)

    def _budget(self) -> Budget:
        return Schedule(self.press).budget(self.due, self.key_mask.sum(-1))

    def _done(self, layer_idx: int) -> None:
        """Layer ``layer_idx`` is compressed: its entries' hidden-state scores are needed only by
        later decode compactions."""
        if not self.press.compresses_decode:
            self.cache.state.entry_scores[layer_idx] = None

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        return self.cache.attend(int(module.layer_idx), query, key, value, attention_mask,  # type: ignore[arg-type]
                                 scaling, dense_attention, module, **kwargs)

    def after_forward(self, output: Any) -> Any:
        """End of the forward: evict every layer at once when the press waited for all of them (after the
        scorer's own model pass, for a scorer that has one)."""
        self.cache.routed = False
        prepare = self._with_pass_scores if isinstance(self.press.scorer, PassScorer) else None
        for i in self.eviction.every_layer(output, self._budget, prepare):
            self._done(i)
        return output

    def _with_pass_scores(self, views: list[LayerView]) -> list[LayerView]:
        """The views with what the scorer's model pass measured (the pass grows the cache, so the prefill's
        tensors are let go during it and re-read after)."""
        assert self.next_position is not None and isinstance(self.press.scorer, PassScorer)
        empty = torch.empty(0)
        views[:] = [replace(v, keys=empty, values=empty) for v in views]
        maps = model_pass_scores(self.model, self.press.scorer, self.cache, self.input_ids, self.key_mask,
                                 self.next_position, self.cache.state.scope)
        return [replace(v, keys=h.keys, values=h.values, pass_scores=m)
                for v, h, m in zip(views, (self.cache.view(v.layer_idx) for v in views), maps)]
