"""Left-padded views of what a cache layer holds (one builder for every cache kind).

A view lays row ``(b, h)``'s entries in position order at the *end* of a ``[B, H_kv, W]`` slot
range (left padding), ``W`` the longest row. :func:`pack_left` builds it from a mask over a
dense layer, :func:`ragged_index` from the rows of a flat ragged buffer; both give the source
index of every slot and whether the slot is real.
"""

from __future__ import annotations

import torch


def left_pad_index(lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, present)`` ``[..., width]``: slot ``j`` of a row of ``n`` entries holds entry
    ``j - (width - n)`` of the row (clamped to 0 where absent); ``present`` marks the real slots."""
    slots = torch.arange(width, device=lengths.device)
    index = slots - (width - lengths[..., None])
    present = index >= 0
    return index.clamp(min=0), present


def pack_left(held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, present)`` ``[B, H, W]`` of the entries where ``held [B, H, L]`` is True: slot ``j``
    holds dense entry ``index[..., j]`` (0 where absent), entries in position order. One host sync."""
    lengths = held.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    order = torch.argsort(held.to(torch.uint8), dim=-1, stable=True)[..., held.shape[-1] - width:]
    _, present = left_pad_index(lengths, width)
    return torch.where(present, order, torch.zeros_like(order)), present


def ragged_index(row_offsets: torch.Tensor, row_lengths: torch.Tensor,
                 shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, present)`` ``[B, H, W]`` into a flat ragged buffer whose row ``b * H + h`` starts at
    ``row_offsets`` and holds ``row_lengths`` entries. One host sync (the longest row)."""
    B, H = shape
    lengths = row_lengths.long().view(B, H)
    width = int(lengths.max()) if lengths.numel() else 0
    index, present = left_pad_index(lengths, width)
    return row_offsets.long().view(B, H, 1) + index, present


def gather_slots(source: torch.Tensor, index: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """``[B, H, W, D]``: ``source`` (dense ``[B, H, L, D]``, or flat ``[N, D]`` for a ragged buffer)
    at each slot's index, zeros where absent (free ragged slots are never read as values)."""
    B, H, W = index.shape
    if source.dim() == 2:
        picked = source.index_select(0, index.reshape(-1)).view(B, H, W, source.shape[-1])
    else:
        picked = source.gather(2, index[..., None].expand(B, H, W, source.shape[-1]))
    return torch.where(present[..., None], picked, torch.zeros((), dtype=source.dtype, device=source.device))


def real_entries(key_mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """``[B, H, W]`` whether the entries at sequence ``positions [B, H, W]`` are real tokens: not
    left padding of the prefill (``key_mask [B, L0]``, False on padding); tokens after ``L0`` are real."""
    if key_mask is None:
        return torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
    B, H, W = positions.shape
    L0 = key_mask.shape[-1]
    inside = key_mask.to(positions.device).gather(1, positions.clamp(min=0, max=L0 - 1).reshape(B, H * W))
    return inside.view(B, H, W) | (positions >= L0)
