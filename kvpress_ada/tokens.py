"""Token-id helpers shared by the generation API and scorers that prompt the model (KVzip)."""

from __future__ import annotations

from typing import Any

import torch


def encode(tokenizer: Any, text: str, device: Any = None) -> torch.Tensor:
    """``[1, n]`` long ids of ``text`` without special tokens (on ``device`` when given)."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].long()
    return ids if device is None else ids.to(device)


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D id tensors with left padding: ``(ids [B, T], mask [B, T] bool)``, on the rows' device."""
    if not rows:
        raise ValueError("left_pad needs at least one row")
    T = max(r.numel() for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros(len(rows), T, dtype=torch.bool, device=rows[0].device)
    for b, row in enumerate(rows):
        ids[b, T - row.numel():] = row
        mask[b, T - row.numel():] = True
    return ids, mask
