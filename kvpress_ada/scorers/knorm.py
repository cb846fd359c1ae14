"""KNorm (Devoto et al., 2024): keys with a small L2 norm attract attention; keep them."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from ..observation import Observation
from .base import Scorer, register_scorer


@register_scorer("knorm")
class KNorm(Scorer):
    """Score = negative key norm (no queries needed).

    Chunked prefill: scores do not depend on the other entries, so with a uniform allocator the
    chunked press keeps the top-scored entries of everything seen (in the first layer exactly the one-shot
    press's entries, ties aside; deeper layers' keys differ since chunks attended to compressed caches)."""

    name: Literal["knorm"] = "knorm"
    comparable_across_heads: ClassVar[bool] = False

    def query_window(self) -> int:
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        return -obs.keys.float().norm(dim=-1)
