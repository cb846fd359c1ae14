"""Evictors: turn per-head counts into kept tokens, and own the cache kind that drops the rest."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..components import Component, Registry
from ..ranking import top_k

if TYPE_CHECKING:
    from ..integration.press_cache import PressCache


class Evictor(Component):
    """``select(scores, counts) -> keep [B, H, L]`` bool, and ``new_cache(config)``: the cache that
    holds the result. A new cache kind (quantized, paged, offloaded) is one registered evictor."""

    kind: ClassVar[str] = "evictor"

    def select(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return topk_mask(scores, counts)

    def new_cache(self, config: Any) -> PressCache:  # pragma: no cover - abstract
        """An empty cache for a model with this ``config`` that this evictor compresses into."""
        raise NotImplementedError(f"{type(self).__name__} must implement new_cache(config)")


EVICTORS = Registry("evictor", Evictor)


def register_evictor(name: str, override: bool = False):
    return EVICTORS.register(name, override=override)


def topk_mask(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Keep the ``counts[b, h]`` best tokens of each head; ties (exact, or within the float noise
    ``kvpress_ada.ranking`` defines) go to the more recent token.

    Returns a bool mask ``[B, H, L]``; in position order it is the sorted, unique kept index set.
    """
    return top_k(scores, counts, recent_first=True)
