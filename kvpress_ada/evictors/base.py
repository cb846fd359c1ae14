"""Evictors: turn per-head counts into kept tokens, and say what becomes of the rest."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field, SerializeAsAny, field_validator

from ..components import Component, Registry
from ..ranking import top_k
from .merging import MERGES, Merge


class Evictor(Component):
    """``select(scores, counts) -> keep [B, H, L]`` bool. ``frees_memory``: whether the entries not kept
    leave memory (a host then compacts the kept ones into its storage, ragged or paged) or stay hidden
    in a dense cache. The host, not the evictor, picks the cache.

    ``rerotate``: the kept keys are re-rotated after each eviction so each head's entries sit at contiguous RoPE
    positions right before the next token's (kvpress's ``KeyRerotationPress``; :mod:`.rerotation`); the tokens
    that come next keep their true positions.

    ``merge``: the values of the entries not kept are folded into kept entries' values at each eviction
    (:mod:`.merging`: ``SimilarityMerge``, kvpress's ``MergingPress``; ``CaM``), ``None``: they are dropped."""

    kind: ClassVar[str] = "evictor"
    frees_memory: ClassVar[bool] = True

    rerotate: bool = Field(False, description="re-rotate the kept keys to contiguous positions after each eviction")
    merge: SerializeAsAny[Merge] | None = Field(None, description="fold the dropped entries' values into kept ones "
                                                                  "(similarity, cam); None: drop them")

    @field_validator("merge", mode="before")
    @classmethod
    def _build_merge(cls, value: Any) -> Any:
        """Accept a ``Merge``, a registered name or a dict with a ``name``."""
        return None if value is None else MERGES.build(value)

    def select(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return topk_mask(scores, counts)


EVICTORS = Registry("evictor", Evictor)


def register_evictor(name: str, override: bool = False):
    return EVICTORS.register(name, override=override)


def topk_mask(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Keep the ``counts[b, h]`` best tokens of each head; ties (exact, or within the float noise
    ``kvpress_ada.ranking`` defines) go to the more recent token.

    Returns a bool mask ``[B, H, L]``; in position order it is the sorted, unique kept index set.
    """
    return top_k(scores, counts, recent_first=True)
