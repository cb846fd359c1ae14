"""Largest-remainder rounding: integers that sum exactly to a target."""

from __future__ import annotations

import torch


def round_preserving_sum(values: torch.Tensor, total: torch.Tensor, upper: torch.Tensor | None = None,
                         tie_break: torch.Tensor | None = None) -> torch.Tensor:
    """Round ``values [B, N]`` (non-negative) to integers summing to ``total [B]``.

    Floors every entry, then hands the remaining units to the largest fractional parts;
    ties go to the larger ``tie_break`` value, then to the lower index. ``upper [B]`` caps
    entries (never binding when ``values <= upper``). No host syncs, so it compiles.
    """
    values = values.double()
    # snap values within 1e-9 of an integer, so float noise never decides who gets a unit
    snapped = torch.where((values - values.round()).abs() < 1e-9, values.round(), values)
    floors = snapped.floor()
    frac = snapped - floors
    remaining = (total.double() - floors.sum(-1)).clamp(min=0)
    if tie_break is None:
        order = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    else:
        order = (-tie_break.double()).argsort(dim=-1, stable=True)
    order = order.gather(-1, frac.gather(-1, order).argsort(dim=-1, descending=True, stable=True))
    rank = order.argsort(dim=-1)
    result = floors + (rank < remaining[:, None]).double()
    if upper is not None:
        result = torch.minimum(result, upper.double()[:, None])
    return result.long()
