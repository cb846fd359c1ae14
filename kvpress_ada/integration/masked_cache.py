"""MaskedCache: the reference/compatibility path. Shapes stay dense; evicted entries are hidden."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from .entries import masked_view, prefill_visible, visible_view
from .press_cache import DenseAttention, PressCache


class MaskedLayer(DynamicLayer):
    """A ``DynamicLayer`` that remembers which prefix entries each kv head keeps.

    Nothing is freed (like NVIDIA kvpress); tokens appended after compression are visible.
    """

    def __init__(self) -> None:
        super().__init__()
        self.keep: torch.Tensor | None = None

    @property
    def compressed(self) -> bool:
        return self.keep is not None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``DynamicLayer.update``, storing detached tensors (same storage): the cache never pins the
        forward's autograd graph."""
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.keys, self.values = keys.detach(), values.detach()
        return keys, values

    def _dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None or self.keys.numel() == 0:
            raise ValueError("this layer holds no tokens yet")
        return self.keys, self.values

    def compress(self, keep: torch.Tensor) -> None:
        keys, _ = self._dense()
        if keep.shape != keys.shape[:3]:
            raise ValueError(f"keep mask of shape {tuple(keep.shape)} does not match the layer's cache "
                             f"{tuple(keys.shape[:3])}")
        self.keep = keep

    def reset(self) -> None:
        super().reset()
        self.keep = None

    def _visible(self, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        keys, _ = self._dense()
        if self.keep is None:
            return prefill_visible(key_mask, tuple(keys.shape[:3]), keys.device)
        return F.pad(self.keep, (0, keys.shape[2] - self.keep.shape[-1]), value=True)

    def decode_view(self, key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The visible entries as a left-padded view ``(keys, values, valid)`` (see ``decode_compression``)."""
        keys, values = self._dense()
        view_keys, view_values, valid, _ = visible_view(keys, values, self._visible(key_mask))
        return view_keys, view_values, valid

    def decode_compact(self, keep: torch.Tensor, spare: int, key_mask: torch.Tensor | None = None) -> None:
        """Hide every entry whose :meth:`decode_view` slot ``keep`` drops (nothing is freed; ``spare``
        is unused). ``key_mask`` as given to :meth:`decode_view`."""
        keys, values = self._dense()
        visible = self._visible(key_mask)
        _, _, _, index = visible_view(keys[..., :1], values[..., :1], visible)
        padded = F.pad(keep, (0, 1), value=False)
        self.keep = padded.gather(2, index) & visible

    def head_lengths(self) -> torch.Tensor:
        """Visible entries per (batch, kv head), ``[B, H_kv]``."""
        keys, _ = self._dense()
        if self.keep is None:
            return torch.full(keys.shape[:2], keys.shape[2], dtype=torch.long, device=keys.device)
        return self.keep.sum(-1) + (keys.shape[2] - self.keep.shape[2])

    def _held(self) -> torch.Tensor:
        keys, _ = self._dense()
        if self.keep is None:
            return torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
        return F.pad(self.keep, (0, keys.shape[2] - self.keep.shape[-1]), value=True)

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded per-head view ``(keys, values [B, H, Lv, D], lengths [B, H])`` of the visible
        entries (kept prefix entries and everything appended since), in position order."""
        keys, values = self._dense()
        view_k, view_v, lengths, _ = masked_view(keys, values, self._held())
        return view_k, view_v, lengths

    def keep_entries(self, keep: torch.Tensor, view: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Keep the entries of :meth:`entries`'s view where ``keep [B, H, Lv]`` is True; the others
        are hidden from now on (chunked prefill). ``view`` is accepted for the ragged layer's
        signature and not needed here."""
        keys, values = self._dense()
        _, _, _, source = masked_view(keys, values, self._held())
        full = torch.zeros(keys.shape[:3], dtype=torch.bool, device=keys.device)
        full.scatter_(-1, source.clamp(min=0), keep & (source >= 0))
        self.keep = None
        self.compress(full)

    def nbytes(self) -> int:
        """Bytes held for keys and values: the full dense cache (masking frees nothing)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float, dense_fn: DenseAttention, module: torch.nn.Module,
               **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Dense SDPA with the layer's keep mask (GQA via ``enable_gqa``, no ``repeat_kv``)."""
        if self.keep is None:
            return dense_fn(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        B, Hq, Q, _ = query.shape
        Hkv, kv_len = key.shape[1], key.shape[2]
        full = F.pad(self.keep, (0, kv_len - self.keep.shape[-1]), value=True)
        allowed = _allowed(attention_mask, B, Q, kv_len, query.device)
        mask = allowed & full.repeat_interleave(Hq // Hkv, dim=1)[:, :, None, :]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=Hq != Hkv)
        return out.transpose(1, 2).contiguous(), None


class MaskedCache(PressCache):
    """A dense cache of :class:`MaskedLayer` objects: the reference the ragged cache must match,
    or where a dense cache is required. ``head_lengths``/``nbytes`` as for the ragged cache."""

    def __init__(self, config: Any = None, num_layers: int | None = None):
        super().__init__(layers=[MaskedLayer() for _ in range(_num_layers(config, num_layers))])


def _num_layers(config: Any, num_layers: int | None) -> int:
    if num_layers is not None:
        return num_layers
    if config is None:
        raise ValueError("a press cache needs a model config or num_layers")
    return int(config.get_text_config(decoder=True).num_hidden_layers)


def _allowed(attention_mask: Any, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The model's own mask as bool ``[B, 1, Q, KV]`` (bottom-right causal when it is ``None``)."""
    if attention_mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        causal = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
        return causal[None, None].expand(batch, 1, q_len, kv_len)
    mask = attention_mask[..., -kv_len:]
    if mask.dtype != torch.bool:
        mask = mask == 0
    return mask
