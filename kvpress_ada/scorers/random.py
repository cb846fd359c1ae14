"""Random eviction: the floor every method must beat."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, register_scorer

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow (16-bit halves of ``c``)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (``lowbias32``, C. Wellons) on int64 tensors holding values < 2**32."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@register_scorer("random")
class RandomScorer(Scorer):
    """Uniform random scores in ``[0, 1)``, a fixed function of ``(seed, layer, kv head, index of
    the token among the valid ones)``: reproducible (also under tensor parallelism: the
    kv head's global index), identical on every device and independent of
    the left padding and of the other rows of the batch.

    Chunked prefill: the index is the entry's rank in the layer's running cache (kept entries, then
    the chunk), so kept entries are redrawn at every compression; the final kept set is still a
    random subset, but older tokens face more draws than with a one-shot prefill."""

    name: Literal["random"] = "random"
    seed: int = Field(0, ge=0)

    def query_window(self) -> int:
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        B, H, L = obs.keys.shape[:3]
        device = obs.keys.device
        index = obs.key_mask.long().cumsum(-1) - 1  # [B, L] rank among valid tokens
        base = hash32(torch.tensor([self.seed], dtype=torch.long, device=device))
        base = hash32(base ^ obs.layer_idx)
        first = obs.global_head_offset
        heads = torch.arange(first, first + H, dtype=torch.long, device=device)  # global
        head = hash32(base ^ heads)  # [H]
        bits = hash32(head[None, :, None] ^ hash32(index.clamp(min=0)[:, None, :] + 0x9E3779B9))
        return (bits >> 8).float() / float(1 << 24)  # 24 random bits: exact in fp32, in [0, 1)
