"""End-of-step evictions: what waits for every layer of a step before one :meth:`Pipeline.keep
<kvpress_ada.Pipeline.keep>` over all of them (a layer schedule comparing layers, a scorer's own model pass)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class EndOfStep(Generic[T]):
    """Collects what each of ``layers`` (the layers a press compresses; an ``int`` n: layers ``0..n-1``) evicts at
    the end of the step, in order: the ``g``-th item every layer queued forms group ``g`` (the same sequences, due
    together in every layer); :meth:`drain` hands each group's items in layer order once the step ends."""

    def __init__(self, layers: int | Sequence[int]):
        self.layers = tuple(range(layers)) if isinstance(layers, int) else tuple(layers)
        self._waiting: dict[int, list[T]] = {}

    def wait(self, layer_idx: int, item: T) -> None:
        """Layer ``layer_idx``'s next ``item`` waits for the end of the step."""
        self._waiting.setdefault(layer_idx, []).append(item)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def drain(self) -> list[list[T]]:
        """Every group's items in layer order, emptying the collector; raises when a layer missed a group (an
        eviction across layers must see every layer)."""
        waiting, self._waiting = self._waiting, {}
        if not waiting:
            return []
        groups = {len(items) for items in waiting.values()}
        if set(waiting) != set(self.layers) or len(groups) != 1:
            raise RuntimeError(f"an eviction across layers saw layers {sorted(waiting)} of {list(self.layers)}")
        return [[waiting[i][g] for i in self.layers] for g in range(groups.pop())]

    def clear(self) -> None:
        """Drop what waits (the step raised)."""
        self._waiting = {}
