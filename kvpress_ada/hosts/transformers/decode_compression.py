"""Decode handler: attention over a press cache after its prefill, and, for a press with
``decode_budget=B, decode_interval=K`` (or ``decode_ratio=r``: ``B`` is then ``(1 - r)`` of the row's tokens
seen so far), compaction of each layer while generating.

Every layer counts the tokens appended to it since its last compaction; in the forward where that
count reaches ``K``, right after the layer's attention, the layer's view (what each kv head holds,
left-padded) and its ``query_window()`` most recent generated queries go through
:meth:`Pipeline.keep <kvpress_ada.Pipeline.keep>` with the budget ``B`` and the layer keeps what it
selects, with ``K`` free slots per row for the next steps; under a model-scope layer schedule every
layer's view goes through one ``keep`` at the end of that forward (``n_layers * B`` entries per row
at most, split across the layers). A scorer reading hidden states scores every new token as it
arrives, so those forwards are never traced. See ``docs/design.md`` for the bound on the bytes held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...observation import Budget
from ...runtime import Schedule, Step, Trigger
from .attention import Handler, dense_attention, layer_view, record_entry_scores
from .eviction import Eviction
from .press_cache import PressCache

if TYPE_CHECKING:
    from ...pipeline import Pipeline


@dataclass
class DecodeRun(Handler):
    """The handler of a forward on a cache that is not a prefill under a press (decode steps, a
    question appended to a compressed context, a cache used after :func:`~kvpress_ada.attach`).
    ``press``: the press whose decode compression runs in this forward (``None``: attend only);
    ``hidden_scorer``: a scorer reading hidden states that scores this forward's tokens."""

    cache: PressCache
    model: torch.nn.Module
    press: Pipeline | None = None
    hidden_scorer: Any = None
    steps: list[Step] = field(default_factory=list)  # what this forward brings each layer (the schedule's)
    eviction: Eviction | None = field(init=False)

    def __post_init__(self) -> None:
        press = self.press
        self.eviction = None if press is None else Eviction(
            press, self.cache, waits=Schedule(press).waits(Trigger.DECODE), spare=press.decode_interval)

    @classmethod
    def for_step(cls, cache: PressCache, model: torch.nn.Module, press: Pipeline, tokens: int) -> "DecodeRun":
        """The handler of a decode forward of ``tokens`` tokens under a press that compacts while
        generating. Every layer's clock counts them here (eagerly, before the forward: the runtime's
        :class:`~kvpress_ada.runtime.Schedule`); the forward keeps its queries only when a compaction may read
        them, and compacts where one is due. A forward that does neither attends only (``press=None``), so a
        compiled step can run it (see :mod:`.compiled`)."""
        steps = cache.state.advance(Schedule(press), tokens)
        busy = any(step.due is not None or step.keeps_queries for step in steps)
        return cls(cache=cache, model=model, press=press if busy else None, hidden_scorer=hidden_scorer(press),
                   steps=steps)

    def record_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """The forward's hidden states entering layer ``layer_idx``'s attention."""
        if self.hidden_scorer is not None:
            record_entry_scores(self.cache.state, self.hidden_scorer, layer_idx, hidden)

    def handles_prefill(self, layer_idx: int) -> bool:
        return False

    def after_prefill(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float) -> None:  # pragma: no cover - handles_prefill is False
        raise RuntimeError("DecodeRun attends through the cache")

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        out = self.cache.attend(layer_idx, query, key, value, attention_mask, scaling, dense_attention, module,
                                **kwargs)
        if self.press is not None:
            self._after_attention(module, query, scaling)
        return out

    @property
    def traceable(self) -> bool:
        """Whether this forward only attends (no host-side work: a compiled step may run it)."""
        return self.press is None and self.hidden_scorer is None

    def after_forward(self, output: Any) -> Any:
        """End of the forward: under a model-scope layer schedule every layer compacts here, at once."""
        self.cache.routed = False
        if self.eviction is not None:
            self.eviction.every_layer(output, lambda: self._budget(self.cache.state.scope[0]))
        return output

    def _budget(self, layer_idx: int) -> Budget:
        """The decode budget of layer ``layer_idx``'s rows, which have seen its ``get_seq_length`` tokens less
        their prefill's left padding."""
        assert self.press is not None
        rows = self.cache.head_lengths(layer_idx)
        seen = torch.full((rows.shape[0],), self.cache.get_seq_length(layer_idx), dtype=torch.long, device=rows.device)
        key_mask = self.cache.state.key_mask
        if key_mask is not None and key_mask.shape[0] == seen.shape[0]:
            seen = seen - (~key_mask).sum(-1).to(seen.device)
        return Schedule(self.press).budget(Trigger.DECODE, seen, seen)

    def _after_attention(self, module: torch.nn.Module, query: torch.Tensor, scaling: float) -> None:
        """Keep the layer's queries and compact it where the schedule says so (counted by :meth:`for_step`)."""
        press, state = self.press, self.cache.state
        assert press is not None
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        step = self.steps[layer_idx]
        window = press.scorer.query_window()
        assert window is not None  # refused at Pipeline construction
        if step.keeps_queries:
            held = state.queries[layer_idx]
            grown = query.detach() if held is None else torch.cat([held, query.detach()], dim=2)
            state.queries[layer_idx] = grown[:, :, grown.shape[2] - min(window, grown.shape[2]):]
            state.recorded[layer_idx] += query.shape[2]
        recent = state.queries[layer_idx]
        if step.due is None or recent is None:
            return
        assert self.eviction is not None
        with torch.no_grad():
            entries = self.cache.view(layer_idx)
            view = layer_view(press.scorer, self.model, module, len(self.cache.layers), entries, recent, scaling,
                              state=state)
            self.eviction.layer(layer_idx, view, entries, lambda: self._budget(layer_idx))
        state.recorded[layer_idx] = 0
        state.compactions[layer_idx] += 1


def hidden_scorer(press: Pipeline | None) -> Any:
    """The scorer of ``press`` when it reads hidden states and compacts while generating (every token
    the cache takes then needs its score), else ``None``."""
    if press is None or not press.compresses_decode or not press.scorer.reads_hidden_states:
        return None
    return press.scorer
