"""Layer schedules: how many tokens per kv head each layer keeps, given the average budget."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..components import Component, Registry
from .rounding import round_preserving_sum


class LayerSchedule(Component):
    """``budgets(avg, n_layers, lengths) -> [B, n_layers]`` integer per-head budgets whose mean
    over layers equals ``avg`` (as far as clipping to the context length allows): the schedule's
    own shape. What a pipeline uses is :meth:`floored_budgets`, the same totals with every layer
    lifted to the floor ``AdaLayer`` keeps (at least 1 per head, and the protected entries when
    they fit), so no schedule ever empties a layer.
    ``needs_all_layers`` is true for schedules that need every layer's scores (``AdaLayer``): they
    have no ``budgets`` without them, and a pipeline using them evicts once at the end of prefill."""

    kind: ClassVar[str] = "layer schedule"
    needs_all_layers: ClassVar[bool] = False

    def budgets(self, avg: torch.Tensor, n_layers: int, lengths: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def floored_budgets(self, avg: torch.Tensor, n_layers: int, lengths: torch.Tensor,
                        protected: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`budgets` with each row's total kept exactly and every layer at least
        ``min(max(1, protected), avg, lengths)`` per head; ``protected [B]``: the entries per head the
        scorer always protects (``Scorer.protected``; ``None`` floors at 1). Layers below the floor
        are lifted to it, paid by the layers above it in proportion to their surplus; budgets the
        floor does not touch are unchanged."""
        raw = self.budgets(avg, n_layers, lengths).long()
        total = raw.sum(-1)
        need = torch.ones_like(total) if protected is None else protected.long().clamp(min=1)
        floor = torch.minimum(torch.minimum(need, avg.long()), torch.minimum(lengths.long(), total // n_layers))
        lifted = lift_to_floor(raw.double(), floor.double()[:, None].expand_as(raw), total.double())
        return round_preserving_sum(lifted, total=total, upper=lengths.long(), tie_break=raw)

    def layer_budget(self, avg: torch.Tensor, layer_idx: int, n_layers: int, lengths: torch.Tensor,
                     protected: torch.Tensor | None = None) -> torch.Tensor:
        """Per-head budget of one layer, ``[B]`` long (from :meth:`floored_budgets`)."""
        return self.floored_budgets(avg, n_layers, lengths, protected)[:, layer_idx]


def lift_to_floor(values: torch.Tensor, floor: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Raise ``values [B, n]`` to ``floor``, taking the difference from the surplus above the floor
    in proportion, so each row still sums to ``total`` (assumes ``floor.sum(-1) <= total``)."""
    surplus = (values - floor).clamp(min=0)
    spare = (total - floor.sum(-1)).clamp(min=0)
    scale = spare / surplus.sum(-1).clamp(min=torch.finfo(values.dtype).tiny)
    return floor + surplus * scale.clamp(max=1.0)[:, None]


LAYER_SCHEDULES = Registry("layer schedule", LayerSchedule)
register_layer_schedule = LAYER_SCHEDULES.decorator_function()


@register_layer_schedule("uniform")
class UniformLayer(LayerSchedule):
    """Every layer keeps the average budget (SnapKV, Ada-SnapKV)."""

    name: Literal["uniform"] = "uniform"

    def budgets(self, avg: torch.Tensor, n_layers: int, lengths: torch.Tensor) -> torch.Tensor:
        return torch.minimum(avg, lengths).long()[:, None].expand(-1, n_layers)


@register_layer_schedule("pyramid")
class PyramidLayer(LayerSchedule):
    """PyramidKV (Cai et al., 2024): budgets decrease linearly with depth from ``2b - b/beta`` to
    ``b/beta``; layers clipped at the context length hand their excess to the others."""

    name: Literal["pyramid"] = "pyramid"
    beta: float = Field(20.0, gt=1.0, description="ratio between the mean and the smallest layer budget")

    def budgets(self, avg: torch.Tensor, n_layers: int, lengths: torch.Tensor) -> torch.Tensor:
        avg = torch.minimum(avg, lengths).double()
        lengths = lengths.double()
        low = avg / self.beta
        high = 2 * avg - low
        if n_layers == 1:
            return avg.round().long()[:, None]
        steps = torch.linspace(0, 1, n_layers, dtype=torch.float64, device=avg.device)
        raw = high[:, None] - (high - low)[:, None] * steps[None, :]
        raw = _clip_and_redistribute(raw, lengths[:, None])
        return round_preserving_sum(raw, total=(avg * n_layers).round().long(), upper=lengths.long())


def _clip_and_redistribute(raw: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """Clip to ``cap`` and spread the clipped mass evenly over unclipped layers (water filling).

    Runs a fixed number of rounds (no data-dependent exit), so it compiles without graph breaks.
    """
    for _ in range(raw.shape[-1]):
        over = (raw - cap).clamp(min=0)
        excess = over.sum(-1, keepdim=True)
        raw = torch.minimum(raw, cap)
        free = raw < cap
        n_free = free.sum(-1, keepdim=True).clamp(min=1)
        raw = raw + free * excess / n_free
    return torch.minimum(raw, cap)
