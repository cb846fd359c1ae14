"""Key re-rotation (kvpress's ``KeyRerotationPress``; HF's former ``SinkCache``; FINCH, Corallo and Papotti,
TACL 2024): after an eviction the kept keys are rotated so each head's entries sit at contiguous RoPE positions.

kvpress moves a head's ``n`` kept keys to positions ``0 .. n-1`` and feeds the next tokens from position ``n``.
Here the tokens that come next keep their true positions (every host's contract) and each kept key moves
*forward* by the number of its row's entries evicted after it: a head's entries then occupy the ``n`` positions
right before the next token's, whatever each head kept. RoPE attention depends only on ``q_pos - k_pos``, so the
two give the same attention (to float rounding), per kv head (Ada) and per batch row (left padding) alike. The
invariant holds across compressions (chunked prefill, decode compaction): a head's entries always end right
before the next position, so no stored position is needed, only which entries are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..runtime.views import HeldEntries


def evicted_after(keep: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[..., L]`` long: how many valid entries later in the row than each entry are not kept."""
    dropped = (valid & ~keep).long()
    return dropped.flip(-1).cumsum(-1).flip(-1) - dropped


def rotate(keys: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``keys [..., L, D]`` (post-RoPE, transformers' ``rotate_half`` layout over the first ``2 * len(inv_freq)``
    channels, the rest left as they are) rotated forward by ``shift [..., L]`` positions, computed in fp32."""
    rot = 2 * inv_freq.shape[-1]
    angle = shift.to(torch.float32)[..., None] * inv_freq.to(keys.device, torch.float32)  # [..., L, rot / 2]
    emb = torch.cat([angle, angle], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    part = keys[..., :rot].to(torch.float32)
    half = part.shape[-1] // 2
    rotated = part * cos + torch.cat([-part[..., half:], part[..., :half]], dim=-1) * sin
    return torch.cat([rotated.to(keys.dtype), keys[..., rot:]], dim=-1)


@dataclass(frozen=True)
class KeyRotation:
    """How a cache re-rotates the keys it keeps: each layer's RoPE ``inv_freq [D_rot / 2]`` (``None`` for a layer
    without RoPE, left as it is) and, for a cache whose batch rows follow different presses (fan-out), the rows
    ``[B]`` that re-rotate (``None``: every row)."""

    inv_freqs: tuple[torch.Tensor | None, ...]
    rows: torch.Tensor | None = None

    def apply(self, layer_idx: int, held: HeldEntries, keep: torch.Tensor) -> HeldEntries:
        """``held`` with the keys it keeps (``keep [B, H_kv, L]``) re-rotated; the others are left as they are."""
        inv_freq = self.inv_freqs[layer_idx]
        if inv_freq is None:
            return held
        kept = keep & held.valid
        shift = evicted_after(kept, held.valid)
        if self.rows is not None:
            shift = shift * self.rows.to(shift.device).long()[:, None, None]
        keys = torch.where(kept[..., None], rotate(held.keys, shift, inv_freq), held.keys)
        return replace(held, keys=keys, rewritten=True)
