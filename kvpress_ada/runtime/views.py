"""The one builder of the :class:`~kvpress_ada.observation.LayerView` a scorer reads, for every host and mode.

A host hands over what a layer holds (:class:`HeldEntries`, a dense left-padded view of its rows), the queries
the eviction scores with and, through :class:`LayerInputs`, the layer's weights a scorer may ask for; the
builder keeps only what the press's scorer declares it reads (the last ``query_window()`` queries, the output
projection's weight, the RoPE frequencies, the entries' hidden-state scores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from ..observation import LayerView


@dataclass(frozen=True)
class HeldEntries:
    """What one layer holds, as a dense left-padded view: ``keys``/``values`` ``[B, H_kv, L, D]``,
    row ``(b, h)``'s entries in position order at the end of its row; ``valid`` ``[B, H_kv, L]``
    (False on padding); ``positions`` ``[B, H_kv, L]`` each entry's index in the sequence fed to the
    cache (-1 on slots that hold nothing)."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    uniform: bool | None = None  # every kv head of a row holds the same entries (None: not known)
    rewritten: bool = False  # keys or values differ from what the layer stores (a merge, pruned key channels)


class LayerInputs(Protocol):
    """What a host gives of a layer besides its entries and queries (asked only when the scorer reads it)."""

    def output_weight(self, layer_idx: int) -> torch.Tensor:
        """The layer's output projection weight ``[hidden, H_q * D]`` (this process's columns)."""
        ...

    def rope_inv_freq(self, layer_idx: int) -> torch.Tensor:
        """The RoPE inverse frequencies ``[D // 2]`` of the layer."""
        ...


@dataclass(frozen=True)
class FixedInputs:
    """:class:`LayerInputs` from two callables (``None``: the host cannot give it, refused in one line)."""

    output_weight_of: Callable[[int], torch.Tensor] | None = None
    rope_inv_freq_of: Callable[[int], torch.Tensor] | None = None

    def output_weight(self, layer_idx: int) -> torch.Tensor:
        if self.output_weight_of is None:
            raise ValueError("this host gives no output projection weight, which this press's scorer reads")
        return self.output_weight_of(layer_idx)

    def rope_inv_freq(self, layer_idx: int) -> torch.Tensor:
        if self.rope_inv_freq_of is None:
            raise ValueError("this host gives no RoPE frequencies, which this press's scorer reads")
        return self.rope_inv_freq_of(layer_idx)


def window_of(scorer: Any, queries: int, entries: int) -> int:
    """How many of the last ``queries`` queries a scorer reads over ``entries`` entries per row: all without a
    window, else ``min(window, queries, entries)``."""
    window = scorer.query_window()
    return queries if window is None else min(window, queries, entries)


def layer_view(scorer: Any, held: HeldEntries, queries: torch.Tensor, *, layer_idx: int, n_layers: int,
               scaling: float, inputs: LayerInputs, shard: Any = None, pass_scores: torch.Tensor | None = None,
               entry_scores: torch.Tensor | None = None, scope: tuple[int, ...] | None = None) -> LayerView:
    """The view of one layer holding ``held`` scored with ``queries [B, H_q, T, D]`` (their last
    :func:`window_of` are kept), with only what ``scorer`` declares it reads."""
    n = window_of(scorer, queries.shape[2], held.keys.shape[2])
    return LayerView(
        keys=held.keys, values=held.values, valid=held.valid, positions=held.positions,
        queries=queries[:, :, queries.shape[2] - n:], layer_idx=layer_idx, n_layers=n_layers, scaling=scaling,
        output_weight=inputs.output_weight(layer_idx).detach() if scorer.needs_output_weight else None,
        rope_inv_freq=inputs.rope_inv_freq(layer_idx) if scorer.needs_rope else None, shard=shard,
        pass_scores=pass_scores, uniform=held.uniform, scope=scope,
        entry_scores=entry_scores if scorer.reads_hidden_states else None)
