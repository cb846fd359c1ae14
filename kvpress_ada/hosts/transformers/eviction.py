"""Eviction of the layers of one forward, written once for every mode that evicts.

A handler hands each layer's view to :meth:`Eviction.layer` right after that layer's attention. When
the press decides layer by layer, the layer keeps what :meth:`Pipeline.keep <kvpress_ada.Pipeline.keep>`
selects at once; when the eviction waits for every layer (``waits``: the runtime's
:meth:`Schedule.waits <kvpress_ada.runtime.Schedule.waits>`) the view waits in an
:class:`~kvpress_ada.runtime.EndOfStep` collector, and :meth:`Eviction.every_layer` runs one ``keep`` over
every layer's view when the forward ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...observation import Budget, LayerView
from ...runtime import EndOfStep
from .press_cache import HeldEntries, PressCache

if TYPE_CHECKING:
    from ...pipeline import Pipeline


@dataclass
class Eviction:
    """Evicts the layers of ``cache`` under ``press`` (``spare``: free slots per row after each eviction,
    ``None``: the cache's default)."""

    press: Pipeline
    cache: PressCache
    waits: bool
    spare: int | None = None
    pending: EndOfStep[tuple[LayerView, HeldEntries]] = field(init=False)

    def __post_init__(self) -> None:
        self.pending = EndOfStep(self.cache.state.scope)

    def layer(self, layer_idx: int, view: LayerView, held: HeldEntries, budget: Callable[[], Budget]) -> bool:
        """Layer ``layer_idx``'s ``view`` of what it ``held``: keep its selection now (``True``), or wait for
        :meth:`every_layer` (``False``). ``budget`` is only called when the layer is evicted now."""
        if self.waits:
            self.pending.wait(layer_idx, (view, held))
            return False
        keep = self.press.keep([view], budget())[0]
        if self.press.rewrites_kept:  # merge the dropped values, prune key channels
            held = self.press.rewrite(view, keep, held)
        self.cache.retain(layer_idx, keep, held, self.spare)
        return True

    def every_layer(self, output: Any, budget: Callable[[], Budget],
                    prepare: Callable[[list[LayerView]], Sequence[LayerView]] | None = None) -> list[int]:
        """End of the forward: one ``keep`` over every waiting layer's view, then each layer keeps its mask;
        returns the layers evicted. Nothing runs when no layer waited or the forward raised (``output`` is
        ``None``). ``prepare`` may replace the views (a scorer's model pass re-reads the cache; it gets the
        only list of the views and may empty it to let their tensors go); the layers are then viewed again
        when they keep their masks."""
        if output is None or not self.pending:
            self.pending.clear()
            return []
        [waiting] = self.pending.drain()
        n = len(waiting)
        held: list[HeldEntries | None] = [None] * n if prepare is not None else [h for _, h in waiting]
        views: Sequence[LayerView] = [v for v, _ in waiting]
        del waiting
        if prepare is not None:  # nothing here holds the layers' tensors while it runs
            views = prepare(views)  # type: ignore[arg-type]
        layers = [v.layer_idx for v in views]
        for i, (layer_idx, keep) in enumerate(zip(layers, self.press.keep(views, budget()))):
            entries = held[i]
            if self.press.rewrites_kept:  # merge the dropped values, prune key channels
                entries = self.press.rewrite(views[i], keep, self.cache.view(layer_idx) if entries is None else entries)
            self.cache.retain(layer_idx, keep, entries, self.spare)
        return layers
