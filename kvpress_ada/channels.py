"""Key-channel pruning: a component kind that decides which channels of each kv head's kept keys stay.

``Pipeline(..., key_channels=ThinK(ratio=0.5))``: when the prompt is compressed, the component reads each layer's
view (the kept keys' head dimension ``D`` and the scorer's window queries) and returns ``[B, H_kv, D]`` channel keep
masks; the host zeroes the other channels of that layer's kept keys before storing them, so every later query's
logit ``q . k`` runs over the kept channels only. Register your own with :func:`register_key_channels`.

**Memory, honestly**: the caches store every key with its full head dimension (the pruned channels are zeros), so
``nbytes()`` counts them and nothing is freed; a storage of ``D - n`` channels per head would save
``n / (2 D)`` of the KV bytes (keys are half of them; NVIDIA kvpress's ``ThinKPress`` reports that fraction as its
``compression_ratio`` and also stores zeros). Shrinking the ragged cache's key rows needs per-head channel
gathers in every attention kernel (ragged, paged, quantized), not done here. Channels are chosen once, at the end
of the prompt: chunked prefill and decode compression are refused with it (each would choose again over keys
already pruned), and so are serving engines and fan-out batches of several presses.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .components import Component, Registry
from .observation import LayerView


class KeyChannels(Component):
    """``channel_keep(view, keep) -> [B, H_kv, D]`` bool: the channels of each kv head's keys that stay (the others
    are zeroed in the kept keys), from a layer's ``view`` and the token selection ``keep [B, H_kv, L]`` made on it.
    ``reads_queries``: whether it reads the view's queries (the scorer's window)."""

    kind: ClassVar[str] = "key channels"
    reads_queries: ClassVar[bool] = True

    def channel_keep(self, view: LayerView, keep: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement channel_keep(view, keep)")

    def pruned_fraction(self, head_dim: int) -> float:
        """Fraction of each key's channels zeroed (``0`` when it depends on the input)."""
        return 0.0


KEY_CHANNELS = Registry("key channels", KeyChannels)
register_key_channels = KEY_CHANNELS.decorator_function()


@register_key_channels("think")
class ThinK(KeyChannels):
    """ThinK (Xu et al., ICLR 2025, arXiv 2407.21018, "Thinner Key Cache by Query-Driven Pruning"): channel ``d``
    of kv head ``h`` scores ``mean_g mean_j q_{g,j,d}^2 * mean_i k_{i,d}^2`` over the last ``window`` queries ``j``
    of the view (the scorer's window: at most that many), the query heads ``g`` of the group and the head's kept
    entries ``i`` (post-RoPE, as kvpress's ``ThinKPress``); the ``int(ratio * D)`` lowest channels are pruned.
    Differs from kvpress: left padding is left out of both means (kvpress runs batch 1), and the keys are those the
    token selection kept (kvpress's ``ComposedPress`` order prunes after the token press too)."""

    name: Literal["think"] = "think"
    ratio: float = Field(0.5, ge=0.0, lt=1.0, description="fraction of each key's channels pruned "
                                                           "(kvpress's key_channel_compression_ratio)")
    window: int = Field(32, ge=1, description="most recent queries whose squared channels are averaged")

    def pruned_fraction(self, head_dim: int) -> float:
        return int(head_dim * self.ratio) / head_dim

    def channel_keep(self, view: LayerView, keep: torch.Tensor) -> torch.Tensor:
        keys, valid = view.keys.float(), view.valid
        B, H, L, D = keys.shape
        n = int(D * self.ratio)
        channels = torch.ones(B, H, D, dtype=torch.bool, device=keys.device)
        if n == 0:
            return channels
        queries = view.queries.float()
        w = min(self.window, queries.shape[2])
        if w == 0:
            raise ValueError("ThinK scores key channels with window queries, and this view holds none: use a scorer "
                             "that reads queries (query_window() > 0)")
        q = queries[:, :, -w:]  # [B, Hq, w, D], the last w queries sit at the last w prefill positions
        voting = valid.any(1)[:, -w:].to(q.dtype)[:, None, :, None]  # left padding does not vote
        q_sq = (q.pow(2) * voting).sum(2) / voting.sum(2).clamp(min=1.0)  # [B, Hq, D]
        q_sq = q_sq.view(B, H, -1, D).mean(2)
        weight = (valid & keep).to(keys.dtype)[..., None]  # the entries the token selection kept
        k_sq = (keys.pow(2) * weight).sum(2) / weight.sum(2).clamp(min=1.0)  # [B, H, D]
        pruned = (q_sq * k_sq).topk(n, dim=-1, largest=False).indices
        return channels.scatter(-1, pruned, False)


def zero_channels(keys: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``keys [B, H, L, D]`` with the channels ``keep [B, H, D]`` drops set to zero (a new tensor)."""
    return keys * keep[:, :, None, :].to(keys.dtype)


__all__ = ["KEY_CHANNELS", "KeyChannels", "ThinK", "register_key_channels", "zero_channels"]
