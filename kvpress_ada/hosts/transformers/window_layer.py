"""The layer of a press cache that a press leaves to its sliding window (the hybrid rule,
:func:`~kvpress_ada.runtime.compressed_layers`): a sliding-window layer of a model that also has global layers.

It is transformers' own ``DynamicSlidingWindowLayer`` (the last ``sliding_window - 1`` tokens kept after each
forward; the model's sliding mask says what each query sees) with the press-layer contract around it: never
compressed, attention through the model's dense attention, its entries and bytes counted like every layer's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from ...families import family_for
from ...runtime import HeldEntries, held_windows
from .press_cache import DenseAttention, layer_count


class WindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer inside a press cache (see the module docstring). While :attr:`record_past` is set
    (a scorer's model pass, which is cropped off afterwards) it keeps every token fed, so :meth:`crop` can
    restore the window the pass pushed out."""

    compressed = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a forward's keys and values; return what its queries see (the window before it and the
        forward's own tokens); keep the last ``sliding_window - 1`` (every token while recording)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        held_keys, held_values = self._held()
        keys = torch.cat([held_keys, key_states.detach()], dim=-2)
        values = torch.cat([held_values, value_states.detach()], dim=-2)
        visible = self.sliding_window - 1 + key_states.shape[-2]
        if self.record_past:
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = keys[:, :, -self.sliding_window + 1:], values[:, :, -self.sliding_window + 1:]
        return keys[:, :, -visible:], values[:, :, -visible:]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative count, as the press caches take it), then keep
        the window (what a recording forward kept comes back); refused in one line when the window no longer holds
        the tokens before them."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if not self.is_initialized:
            return
        keys, values = self._held()
        if keys.shape[-2] - n < min(self.cumulative_length - n, self.sliding_window - 1):
            raise ValueError(f"cannot crop {n} tokens from a sliding-window layer: the window has let the tokens "
                             "before them go; continue a copy of the cache instead (copy.deepcopy)")
        if n:
            keys, values = keys[:, :, :-n], values[:, :, :-n]
            self.cumulative_length -= n
        keep = -self.sliding_window + 1
        self.keys, self.values = keys[:, :, keep:], values[:, :, keep:]

    def _held(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def view(self, key_mask: torch.Tensor | None = None) -> HeldEntries:
        raise RuntimeError("a sliding-window layer of a hybrid model holds its window and is not compressed; "
                           "nothing should ask for its view")

    def retain(self, keep: torch.Tensor, held: HeldEntries, spare: int | None = None) -> None:
        raise RuntimeError("a sliding-window layer of a hybrid model holds its window and is not compressed")

    def head_lengths(self) -> torch.Tensor:
        """Entries each (batch, kv head) holds: the window's tokens (at most ``sliding_window - 1`` between
        forwards)."""
        if not self.is_initialized or self.keys is None:
            return torch.zeros(0, 0, dtype=torch.long)
        B, H, L, _ = self._held()[0].shape
        return torch.full((B, H), L, dtype=torch.long, device=self.keys.device)

    def nbytes(self) -> int:
        """Bytes held for keys and values."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def batch_nbytes(self) -> list[int]:
        """Bytes each batch row holds."""
        if not self.is_initialized or self.keys is None:
            return []
        keys, values = self._held()
        return [keys[0].nbytes + values[0].nbytes] * keys.shape[0]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float, dense_fn: DenseAttention, module: torch.nn.Module,
               **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """The model's dense attention over the window (``key``/``value``: what :meth:`update` returned)."""
        return dense_fn(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


@contextmanager
def recording_windows(cache: Any) -> Iterator[None]:
    """Inside the block, the sliding-window layers of ``cache`` keep every token fed (a model pass that is cropped
    off afterwards must find the window it pushed out)."""
    layers = [layer for layer in cache.layers if isinstance(layer, WindowLayer)]
    for layer in layers:
        layer.record_past = True
    try:
        yield
    finally:
        for layer in layers:
            layer.record_past = False
            layer.crop(0)


def press_layers(config: Any, num_layers: int | None, make: Callable[[], Any]) -> list[Any]:
    """The layers of a press cache for a model with ``config`` (or ``num_layers`` layers): ``make()`` for each layer
    the press compresses, a :class:`WindowLayer` for each sliding-window layer of a hybrid model."""
    n = layer_count(config, num_layers)
    held: tuple[int, ...] = ()
    window = None
    if config is not None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        try:
            family = family_for(text)
        except ValueError:  # a model type no family serves is refused where a press meets the model
            family = None
        if family is not None and family.n_layers == n:
            held, window = held_windows(family), family.sliding_window
    return [WindowLayer(sliding_window=int(window or 0)) if i in held else make() for i in range(n)]
