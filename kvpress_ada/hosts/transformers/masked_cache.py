"""MaskedCache: the reference/compatibility path. Shapes stay dense; evicted entries are hidden."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from .attention import logit_extras, masked_attention
from .entries import gather_slots, pack_left, real_entries
from .press_cache import DenseAttention, HeldEntries, PressCache, uncroppable
from .window_layer import press_layers


class MaskedLayer(DynamicLayer):
    """A ``DynamicLayer`` that remembers which prefix entries each kv head keeps.

    Nothing is freed (like NVIDIA kvpress); tokens appended after compression are visible.
    """

    rewrites_kept_keys = True  # retain() writes the view's kept keys and values back (re-rotated, merged, pruned)

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

    def reset(self) -> None:
        super().reset()
        self.keep = None

    def crop(self, tokens_to_remove: int) -> None:
        """``DynamicLayer.crop``; refuses to crop entries the keep mask covers (compressed ones)."""
        if self.keep is not None and self.keys is not None:
            appended = self.keys.shape[2] - self.keep.shape[-1]
            if -tokens_to_remove > appended:
                raise uncroppable(-tokens_to_remove, appended)
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the keep mask follows its keys and values."""
        super().reorder_cache(beam_idx)
        if self.keep is not None:
            self.keep = self.keep.index_select(0, beam_idx.to(self.keep.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.keep is not None:
            self.keep = self.keep[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.keep is not None:
            self.keep = self.keep.repeat_interleave(repeats, dim=0)

    def view(self, key_mask: torch.Tensor | None = None) -> HeldEntries:
        """The visible entries (kept prefix entries and everything appended since), left-padded; the
        dense layer itself before compression (``key_mask``: the prefill's real tokens)."""
        keys, values = self._dense()
        B, H, L, _ = keys.shape
        if self.keep is None:
            positions = torch.arange(L, device=keys.device).expand(B, H, L)
            return HeldEntries(keys, values, real_entries(key_mask, positions), positions, uniform=True)
        index, present = pack_left(F.pad(self.keep, (0, L - self.keep.shape[-1]), value=True))
        positions = torch.where(present, index, -1)
        return HeldEntries(gather_slots(keys, index, present), gather_slots(values, index, present),
                           present & real_entries(key_mask, positions), positions)

    def retain(self, keep: torch.Tensor, held: HeldEntries, spare: int | None = None) -> None:
        """Hide every entry of ``held`` (this layer's view) that ``keep`` drops; nothing is freed
        (``spare`` is unused)."""
        keys, values = self._dense()
        if keep.shape != held.valid.shape:
            raise ValueError(f"keep mask of shape {tuple(keep.shape)} does not match the layer's view "
                             f"{tuple(held.valid.shape)}")
        kept = (keep & held.valid).to(torch.int32)
        full = torch.zeros(keys.shape[:3], dtype=torch.int32, device=keys.device)
        self.keep = full.scatter_add_(-1, held.positions.clamp(min=0).expand_as(kept), kept) > 0
        if held.keys is not keys or held.values is not values:  # a copy (re-rotated keys, merged values, pruned
            b, h, j = kept.bool().nonzero(as_tuple=True)       # channels): its kept entries go back in place
            where = (b, h, held.positions.expand_as(kept)[b, h, j])
            if held.keys is not keys:
                self.keys = keys.index_put(where, held.keys[b, h, j])
            if held.values is not values:
                self.values = values.index_put(where, held.values[b, h, j])

    def head_lengths(self) -> torch.Tensor:
        """Visible entries per (batch, kv head), ``[B, H_kv]``."""
        keys, _ = self._dense()
        if self.keep is None:
            return torch.full(keys.shape[:2], keys.shape[2], dtype=torch.long, device=keys.device)
        return self.keep.sum(-1) + (keys.shape[2] - self.keep.shape[2])

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
        out = masked_attention(query, key, value, mask, scaling, *logit_extras(kwargs))
        return out.transpose(1, 2).contiguous(), None


class MaskedCache(PressCache):
    """A dense cache of :class:`MaskedLayer` objects: the reference the ragged cache must match,
    or where a dense cache is required. ``head_lengths``/``nbytes`` as for the ragged cache."""

    def __init__(self, config: Any = None, num_layers: int | None = None):
        super().__init__(layers=press_layers(config, num_layers, MaskedLayer))



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
