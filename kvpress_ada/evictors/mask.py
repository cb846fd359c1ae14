"""Mask eviction: the reference and compatibility path (kvpress-style, no memory freed)."""

from __future__ import annotations

from typing import ClassVar, Literal

from .base import Evictor, register_evictor


@register_evictor("mask")
class Mask(Evictor):
    """Keeps the dense cache and hides evicted entries from attention. Selects exactly what
    :class:`TopK` selects; useful as a reference and where a dense cache is required."""

    name: Literal["mask"] = "mask"
    frees_memory: ClassVar[bool] = False
