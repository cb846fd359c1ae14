"""End-of-step evictions: what waits for every layer of a step before one :meth:`Pipeline.keep
<kvpress_ada.Pipeline.keep>` over all of them (a layer schedule comparing layers, a scorer's own model pass)."""

from __future__ import annotations

from typing import Generic, Hashable, TypeVar

T = TypeVar("T")


class EndOfStep(Generic[T]):
    """Collects, per group (``key``: e.g. the requests due together), one item per layer of a model of
    ``n_layers`` layers; :meth:`drain` hands each group's items in layer order once the step ends."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self._waiting: dict[Hashable, dict[int, T]] = {}

    def wait(self, layer_idx: int, item: T, key: Hashable = None) -> None:
        """Layer ``layer_idx``'s ``item`` of group ``key`` waits for the end of the step."""
        self._waiting.setdefault(key, {})[layer_idx] = item

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def drain(self) -> list[tuple[Hashable, list[T]]]:
        """Every group's items in layer order (in the order groups first waited), emptying the collector;
        raises when a group missed a layer (an eviction across layers must see every layer)."""
        waiting, self._waiting = self._waiting, {}
        out = []
        for key, items in waiting.items():
            if len(items) != self.n_layers:
                raise RuntimeError(f"an eviction across layers saw {len(items)} of {self.n_layers} layers")
            out.append((key, [items[i] for i in range(self.n_layers)]))
        return out

    def clear(self) -> None:
        """Drop what waits (the step raised)."""
        self._waiting = {}
