"""Which layers of a model a press compresses: the hybrid rule, written once for every host.

A model whose layers mix sliding-window attention and global attention (Gemma-2, Gemma-3, GPT-OSS) already holds
at most its window in each sliding layer, so a press leaves those layers to their window and compresses the
global layers only: a layer schedule (uniform, Pyramid, model-scope Ada, calibrated) splits its budget across the
compressed layers, a compression ratio applies to them, and the bytes a cache reports cover every layer. A model
whose every layer slides (Mistral or Phi-3 with ``sliding_window``) has no global layer: a press compresses it like
a global one and refuses to grow it past the window (:func:`window_limit`).
"""

from __future__ import annotations

from typing import Any


def held_windows(family: Any) -> tuple[int, ...]:
    """The layers a press leaves to their sliding window (``family``: a :class:`~kvpress_ada.families.Family`):
    every sliding-window layer of a model that also has global layers; none otherwise."""
    sliding = tuple(family.sliding_window_layers)
    return sliding if sliding and len(sliding) < family.n_layers else ()


def compressed_layers(family: Any) -> tuple[int, ...]:
    """The layers a press compresses, in order: every layer but :func:`held_windows`."""
    held = set(held_windows(family))
    return tuple(i for i in range(family.n_layers) if i not in held)


def window_limit(family: Any) -> int | None:
    """The most tokens a compressed cache may hold: the window of a model whose every layer slides (its layers
    are compressed as global ones, which is exact only while the sequence fits the window); ``None`` otherwise."""
    sliding = tuple(family.sliding_window_layers)
    return family.sliding_window if sliding and len(sliding) == family.n_layers else None
