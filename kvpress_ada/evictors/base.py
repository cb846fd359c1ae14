"""Evictors: turn per-head counts into kept tokens and decide how the cache drops the rest."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from ..components import Component, Registry


class Evictor(Component):
    """``select(scores, counts) -> keep [B, H, L]`` bool; ``cache_kind`` names the cache that holds
    the result (``"ragged"``: evicted entries leave memory; ``"masked"``: shapes kept, entries hidden)."""

    kind: ClassVar[str] = "evictor"
    cache_kind: ClassVar[Literal["ragged", "masked"]] = "ragged"

    def select(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return topk_mask(scores, counts)


EVICTORS = Registry("evictor", Evictor)


def register_evictor(name: str, override: bool = False):
    return EVICTORS.register(name, override=override)


def topk_mask(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Keep the ``counts[b, h]`` best tokens of each head; ties go to the more recent token.

    Returns a bool mask ``[B, H, L]``; in position order it is the sorted, unique kept index set.
    """
    L = scores.shape[-1]
    reversed_scores = scores.flip(-1)
    order = reversed_scores.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1).flip(-1)  # rank of each original position
    return rank < counts[..., None]
