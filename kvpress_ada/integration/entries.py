"""Per-head views of a press cache layer: what each (batch, kv head) row holds, left-padded.

Chunked prefill (and anything else that re-scores a compressed layer) reads a layer as dense
``[B, H_kv, Lv, D]`` keys and values where row ``(b, h)`` holds its ``lengths[b, h]`` entries in
position order at the *end* (left padding), and hands back a keep mask over that view. Decode
compression reads a layer the same way (``ragged_view``, ``visible_view``).
"""

from __future__ import annotations

from typing import Any

import torch


def left_pad_index(lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, present)`` ``[..., width]``: slot ``j`` of a row of ``n`` entries holds entry
    ``j - (width - n)`` (clamped to 0 where absent); ``present`` marks the real slots."""
    slots = torch.arange(width, device=lengths.device)
    index = slots - (width - lengths[..., None])
    present = index >= 0
    return index.clamp(min=0), present


def ragged_view(k_flat: torch.Tensor, v_flat: torch.Tensor, row_offsets: torch.Tensor, row_lengths: torch.Tensor,
                shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``(keys, values [B, H, Lv, D], lengths [B, H])`` of a ragged layer's rows
    (absent slots hold zeros). One host sync (the longest row)."""
    B, H, D = shape
    lengths = row_lengths.long().view(B, H)
    width = int(lengths.max()) if lengths.numel() else 0
    index, present = left_pad_index(lengths, width)
    flat = (row_offsets.long().view(B, H, 1) + index).reshape(-1)
    zero = torch.zeros((), dtype=k_flat.dtype, device=k_flat.device)  # not a product: spare slots are uninitialised
    keys = torch.where(present[..., None], k_flat.index_select(0, flat).view(B, H, width, D), zero)
    values = torch.where(present[..., None], v_flat.index_select(0, flat).view(B, H, width, D), zero)
    return keys, values, lengths


def masked_view(keys: torch.Tensor, values: torch.Tensor,
                held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded view of the entries where ``held [B, H, L]`` is True in dense ``keys/values``:
    ``(keys, values [B, H, Lv, D], lengths [B, H], source [B, H, Lv])`` where ``source`` is each
    slot's index in the dense layer (-1 where absent)."""
    lengths = held.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    order = torch.argsort(held.to(torch.uint8), dim=-1, stable=True)[..., held.shape[-1] - width:]
    _, present = left_pad_index(lengths, width)
    D = keys.shape[-1]
    gather = order[..., None].expand(*order.shape, D)
    zero = torch.zeros((), dtype=keys.dtype, device=keys.device)
    view_k = torch.where(present[..., None], keys.gather(2, gather), zero)
    view_v = torch.where(present[..., None], values.gather(2, gather), zero)
    return view_k, view_v, lengths, torch.where(present, order, torch.full_like(order, -1))


def visible_view(keys: torch.Tensor, values: torch.Tensor,
                 visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded view of the ``visible [B, H, L]`` entries of dense ``keys``/``values``:
    ``(keys, values, valid [B, H, L_max], index)`` where ``index [B, H, L]`` maps each dense entry
    to its view slot (``L_max`` for hidden entries)."""
    B, H, L, D = keys.shape
    n = visible.sum(-1)
    width = int(n.max()) if n.numel() else 0
    rank = visible.long().cumsum(-1) - 1
    index = torch.where(visible, (width - n)[..., None] + rank, torch.full_like(rank, width))
    out = []
    for x in (keys, values):
        view = x.new_zeros(B, H, width + 1, D)
        view.scatter_(2, index[..., None].expand(B, H, L, D), x)
        out.append(view[:, :, :width])
    valid = torch.arange(width, device=keys.device)[None, None, :] >= (width - n)[..., None]
    return out[0], out[1], valid, index


def prefill_visible(key_mask: torch.Tensor | None, shape: tuple[int, ...], device: Any) -> torch.Tensor:
    """``[B, H, L]`` visibility of a dense layer: the prefill's real tokens, then every appended one."""
    B, H, L = shape
    if key_mask is None:
        return torch.ones(B, H, L, dtype=torch.bool, device=device)
    mask = key_mask.to(device)[:, :L]
    mask = torch.nn.functional.pad(mask, (0, L - mask.shape[-1]), value=True)
    return mask[:, None, :].expand(B, H, L)
