"""Eviction of the layers of one forward, written once for every mode that evicts.

A handler hands each layer's view to :meth:`Eviction.layer` right after that layer's attention. When
the press decides layer by layer, the layer keeps what :meth:`Pipeline.keep <kvpress_ada.Pipeline.keep>`
selects at once; when it decides across layers (``at_end``: a model-scope layer schedule, or a scorer
with its own model pass) the view waits, and :meth:`Eviction.every_layer` runs one ``keep`` over every
layer's view when the forward ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...observation import Budget, LayerView
from .press_cache import HeldEntries, PressCache

if TYPE_CHECKING:
    from ...pipeline import Pipeline


@dataclass
class Eviction:
    """Evicts the layers of ``cache`` under ``press`` (``spare``: free slots per row after each eviction,
    ``None``: the cache's default)."""

    press: Pipeline
    cache: PressCache
    at_end: bool
    spare: int | None = None
    pending: dict[int, tuple[LayerView, HeldEntries]] = field(default_factory=dict)

    def layer(self, layer_idx: int, view: LayerView, held: HeldEntries, budget: Callable[[], Budget]) -> bool:
        """Layer ``layer_idx``'s ``view`` of what it ``held``: keep its selection now (``True``), or wait for
        :meth:`every_layer` (``False``). ``budget`` is only called when the layer is evicted now."""
        if self.at_end:
            self.pending[layer_idx] = (view, held)
            return False
        keep = self.press.keep([view], budget())[0]
        self.cache.retain(layer_idx, keep, held, self.spare)
        return True

    def every_layer(self, output: Any, budget: Callable[[], Budget],
                    prepare: Callable[[list[LayerView]], Sequence[LayerView]] | None = None) -> list[int]:
        """End of the forward: one ``keep`` over every waiting layer's view, then each layer keeps its mask;
        returns the layers evicted. Nothing runs when no layer waited or the forward raised (``output`` is
        ``None``). ``prepare`` may replace the views (a scorer's model pass re-reads the cache; it gets the
        only list of the views and may empty it to let their tensors go); the layers are then viewed again
        when they keep their masks."""
        pending, self.pending = self.pending, {}
        if output is None or not pending:
            return []
        n = len(pending)
        if n != len(self.cache.layers):
            raise RuntimeError(f"an eviction across layers saw {n} of {len(self.cache.layers)} layers")
        held: list[HeldEntries | None] = [None] * n if prepare is not None else [pending[i][1] for i in range(n)]
        views: Sequence[LayerView] = [pending.pop(i)[0] for i in range(n)]
        if prepare is not None:  # nothing here holds the layers' tensors while it runs
            views = prepare(views)  # type: ignore[arg-type]
        for i, keep in enumerate(self.press.keep(views, budget())):
            self.cache.retain(i, keep, held[i], self.spare)
        return list(range(n))
