"""MaskedCache: the reference/compatibility path. Shapes stay dense; evicted entries are hidden."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache


class MaskedCache(DynamicCache):
    """A ``DynamicCache`` that remembers, per layer, which prefix entries each kv head keeps.

    Nothing is freed (like NVIDIA kvpress); use it as the reference that the ragged cache must
    match, or where a dense cache is required. Tokens appended after compression are visible.
    """

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config, **kwargs)
        self.keep: dict[int, torch.Tensor] = {}

    def is_compressed(self, layer_idx: int) -> bool:
        return layer_idx in self.keep

    def compress_layer(self, layer_idx: int, keep: torch.Tensor) -> None:
        keys = self.layers[layer_idx].keys
        if keep.shape != keys.shape[:3]:
            raise ValueError(f"keep mask of shape {tuple(keep.shape)} does not match layer {layer_idx}'s cache {tuple(keys.shape[:3])}")
        self.keep[layer_idx] = keep

    def head_lengths(self, layer_idx: int) -> torch.Tensor:
        """Visible entries per (batch, kv head), ``[B, H_kv]``."""
        _check_layer(layer_idx, len(self.layers))
        keys = self.layers[layer_idx].keys
        keep = self.keep.get(layer_idx)
        if keep is None:
            return torch.full(keys.shape[:2], keys.shape[2], dtype=torch.long, device=keys.device)
        return keep.sum(-1) + (keys.shape[2] - keep.shape[2])

    def nbytes(self) -> int:
        """Bytes held for keys and values: the full dense cache (masking frees nothing)."""
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))

    def attend(self, layer_idx, query, key, value, attention_mask, scaling, dense_fn, module, **kwargs):
        """Dense SDPA with the layer's keep mask (GQA via ``enable_gqa``, no ``repeat_kv``)."""
        keep = self.keep.get(layer_idx)
        if keep is None:
            return dense_fn(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        B, Hq, Q, _ = query.shape
        Hkv, kv_len = key.shape[1], key.shape[2]
        full = F.pad(keep, (0, kv_len - keep.shape[-1]), value=True)
        allowed = _allowed(attention_mask, B, Q, kv_len, query.device)
        mask = allowed & full.repeat_interleave(Hq // Hkv, dim=1)[:, :, None, :]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=Hq != Hkv)
        return out.transpose(1, 2).contiguous(), None


def _allowed(attention_mask, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """The model's own mask as bool ``[B, 1, Q, KV]`` (bottom-right causal when it is ``None``)."""
    if attention_mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        causal = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]
        return causal[None, None].expand(batch, 1, q_len, kv_len)
    mask = attention_mask[..., -kv_len:]
    if mask.dtype != torch.bool:
        mask = mask == 0
    return mask


def _check_layer(layer_idx: int, n_layers: int) -> None:
    if not 0 <= layer_idx < n_layers:
        raise ValueError(f"layer_idx {layer_idx} out of range: this cache has layers 0..{n_layers - 1}")
