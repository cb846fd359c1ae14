"""Named presets reproducing published methods as Pipeline configurations."""

from __future__ import annotations

from typing import Callable

from .allocators import AdaHead, PyramidLayer, UniformHead, UniformLayer
from .pipeline import Pipeline
from .presses import TOVA, CriticalKV, ExpectedAttention, KNorm, ObservedAttention, RandomScorer, SnapKV, StreamingLLM

ADA_ALPHA = 0.2  # the paper's safeguard default

_PRESETS: dict[str, Callable[[], dict]] = {
    "snapkv": lambda: dict(scorer=SnapKV()),
    "pyramidkv": lambda: dict(scorer=SnapKV(), layers=PyramidLayer()),
    "ada_snapkv": lambda: dict(scorer=SnapKV(), allocator=AdaHead(alpha=ADA_ALPHA)),
    "ada_pyramidkv": lambda: dict(scorer=SnapKV(), allocator=AdaHead(alpha=ADA_ALPHA), layers=PyramidLayer()),
    "streamingllm": lambda: dict(scorer=StreamingLLM()),
    "h2o": lambda: dict(scorer=ObservedAttention()),
    "tova": lambda: dict(scorer=TOVA()),
    "knorm": lambda: dict(scorer=KNorm()),
    "expected_attention": lambda: dict(scorer=ExpectedAttention()),
    "ada_expected_attention": lambda: dict(scorer=ExpectedAttention(), allocator=AdaHead(alpha=ADA_ALPHA)),
    "criticalkv": lambda: dict(scorer=CriticalKV()),
    "ada_criticalkv": lambda: dict(scorer=CriticalKV(), allocator=AdaHead(alpha=ADA_ALPHA)),
    "random": lambda: dict(scorer=RandomScorer()),
}


def preset_names() -> list[str]:
    return list(_PRESETS)


def register_preset(name: str, factory: Callable[[], dict]) -> None:
    """Add a preset: ``factory()`` returns Pipeline fields (scorer, allocator, layers, evictor)."""
    if name in _PRESETS:
        raise ValueError(f"a preset named {name!r} already exists")
    _PRESETS[name] = factory


def preset(name: str, compression_ratio: float | None = None, budget: int | None = None, **overrides) -> Pipeline:
    """Build a named preset, e.g. ``preset("ada_snapkv", compression_ratio=0.75)``.

    ``overrides`` replace components (``evictor=Mask()``, ``allocator=AdaHead(alpha=0.5)``).
    """
    try:
        fields = _PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(_PRESETS)}") from None
    fields.update(overrides)
    fields.setdefault("allocator", UniformHead())
    fields.setdefault("layers", UniformLayer())
    return Pipeline(**fields, compression_ratio=compression_ratio, budget=budget)
