"""The contract every cache a press compresses into follows, and the one base class they share.

An :class:`~kvpress_ada.evictors.Evictor` builds its cache with ``new_cache(config)``; the cache is
a transformers ``Cache`` made of :class:`PressLayer` objects. A layer is dense while its prefill
is in flight, then :meth:`PressLayer.compress` drops (or hides) the unselected entries, and
:meth:`PressLayer.attend` computes attention over what is left. A new cache kind (quantized,
paged, offloaded) is one layer class, one cache class and one registered evictor.

A compressed layer is only correct under the ``"kvpress_ada"`` attention function (inside
``with press(model)`` or after :func:`kvpress_ada.attach`), so :meth:`PressCache.update` refuses
a compressed layer when the model was called without that routing, with one line saying what to
do, instead of failing deep inside transformers or, for the masked cache, attending to evicted
entries.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from transformers.cache_utils import Cache

DenseAttention = Callable[..., tuple[torch.Tensor, Any]]


class PressLayer(Protocol):
    """One layer of a press cache."""

    compressed: bool

    def compress(self, keep: torch.Tensor) -> None:
        """Keep the entries where ``keep [B, H_kv, L]`` is True (the layer's dense prefill)."""

    def head_lengths(self) -> torch.Tensor:
        """Entries each (batch, kv head) attends to, ``LongTensor[B, H_kv]``."""

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded per-head view ``(keys, values [B, H_kv, Lv, D], lengths [B, H_kv])`` of the
        entries each row attends to, in position order (chunked prefill re-scores them)."""

    def keep_entries(self, keep: torch.Tensor, view: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Keep the entries of :meth:`entries`'s view where ``keep [B, H_kv, Lv]`` is True."""

    def nbytes(self) -> int:
        """Bytes held for keys and values."""

    def decode_view(self, key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ``(keys, values, valid)`` view of the entries attended to (decode compression)."""

    def decode_compact(self, keep: torch.Tensor, spare: int, key_mask: torch.Tensor | None = None) -> None:
        """Keep the :meth:`decode_view` entries where ``keep`` is True (decode compression)."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float, dense_fn: DenseAttention, module: torch.nn.Module,
               **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Attention output ``[B, Q, H_q, D]`` of ``query`` over this layer (after ``update``)."""


class PressCache(Cache):
    """A ``Cache`` of :class:`PressLayer` objects; see the module docstring."""

    def __init__(self, layers: list[Any]):
        super().__init__(layers=layers)
        self.routed = False  # set by the press routing for the duration of one forward
        self.decode_state: Any = None  # decode compression's per-cache state (decode_compression.py)

    def _layer(self, layer_idx: int) -> PressLayer:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} out of range: this cache has layers 0..{len(self.layers) - 1}")
        layer: PressLayer = self.layers[layer_idx]  # type: ignore[assignment]
        return layer

    def is_compressed(self, layer_idx: int) -> bool:
        return self._layer(layer_idx).compressed

    def compress_layer(self, layer_idx: int, keep: torch.Tensor) -> None:
        self._layer(layer_idx).compress(keep)

    def dense(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense keys and values ``[B, H_kv, L, D]`` of a layer not compressed yet."""
        layer = self.layers[layer_idx]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if self.is_compressed(layer_idx) or keys is None or values is None:
            raise ValueError(f"layer {layer_idx} holds no dense prefill (already compressed or empty)")
        return keys, values

    def head_lengths(self, layer_idx: int) -> torch.Tensor:
        """Entries each (batch, kv head) of layer ``layer_idx`` attends to, ``LongTensor[B, H_kv]``."""
        return self._layer(layer_idx).head_lengths()

    def nbytes(self) -> int:
        """Bytes held for keys and values of all layers."""
        return sum(self._layer(i).nbytes() for i in range(len(self.layers)))

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, dense_fn: DenseAttention, module: torch.nn.Module,
               **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Attention of ``query`` over layer ``layer_idx`` (dense until the layer is compressed)."""
        return self._layer(layer_idx).attend(query, key, value, attention_mask, scaling, dense_fn, module, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.routed and self.is_compressed(layer_idx):
            raise RuntimeError(
                f"this {type(self).__name__} was compressed by a kvpress_ada press and needs its attention: call "
                "the model with it inside `with press(model):`, or once `kvpress_ada.attach(model)` has run")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
