"""Calibrated budgets: split a pipeline's budget by per-(layer, kv head) shares measured offline.

The shares ``s[l, h]`` come from a calibration file (:mod:`kvpress_ada.calibration`: which share of
KVzip's kept entries falls in each (layer, kv head) of a model); any scorer's own top-k still picks
the tokens within each head. Why and how: ``docs/design.md`` (calibrated budgets).

- ``CalibratedLayer(path)``: layer ``l`` keeps a per-head budget proportional to its share
  ``sum_h s[l, h]`` (layer-local: no scores needed, each layer is still evicted right after its
  own prefill).
- ``Calibrated(path)``: a layer's budget is split among its kv heads in proportion to ``s[l, h]``.

A calibration with a keep curve (LU-KV, :mod:`kvpress_ada.harness.lukv`) gives the shares of the pipeline's own
ratio: ``CalibratedLayer`` reads each layer's keep fraction at the row's ratio ``1 - b / L`` off the curve
(interpolated between its ratios), ``Calibrated`` the heads' fractions at the point of the curve where the layer
keeps ``b_l / L`` (so the two together reproduce the curve's (layer, head) budgets).

Both mix the calibrated shares with the uniform ones by ``alpha`` (the Ada-KV safeguard) and round
with :func:`~kvpress_ada.allocators.rounding.round_preserving_sum`, so totals are exact. The file is
read once (cached) and refused for another model (``check_model``) with an error naming both.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, NoReturn

import torch
from pydantic import Field

from .. import calibration
from .heads import HeadAllocator, register_allocator
from .layers import LayerSchedule, register_layer_schedule
from .rounding import round_preserving_sum

_PATH = Field(calibration.SHIPPED, description="calibration file (`kvpress-ada calibrate --out FILE`) or "
                                               "builtin:NAME for one shipped with kvpress_ada")
_ALPHA = Field(0.0, ge=0.0, le=1.0, description="safeguard: fraction of the uniform share every entry keeps")


class _UsesCalibration:
    """What both components share: the cached file, the model check, the shares as a tensor."""

    path: str
    alpha: float
    model_specific: ClassVar[bool] = True  # tied to the model it was calibrated on: refused for any other

    def load_calibration(self) -> calibration.Calibration:
        """The calibration file's content (read once, cached)."""
        return calibration.load(self.path)

    def check_model(self, config: Any) -> None:
        self.load_calibration().check_model(config, source=f"calibration {self.path!r}")

    def _shares(self, device: torch.device) -> torch.Tensor:
        """``[n_layers, H]`` float64 shares (summing to 1) on ``device`` (cached per device)."""
        return calibration.shares_tensor(self.path, device)

    def _curve(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(ratios [R], keep [R, n_layers, H])`` of a calibration with a keep curve, else ``None``."""
        return calibration.keep_curve(self.path, device)

    def _refuse_shape(self, what: str, got: Any, expected: Any) -> NoReturn:
        raise calibration.CalibrationError(
            f"calibration {self.path!r} was made for model {self.load_calibration().model.describe()} with {expected} "
            f"{what}; this model has {got}; run `kvpress-ada calibrate` for this model")


@register_layer_schedule("calibrated")
class CalibratedLayer(_UsesCalibration, LayerSchedule):
    """Per-layer budgets from calibrated shares (KVzip's per-layer share of kept entries, measured
    offline; see the module docstring). ``b_l = (alpha / n + (1 - alpha) * share_l) * n * b``, at
    least 1 and at most the context length, rounded so the layers' mean is exactly ``b``."""

    name: Literal["calibrated"] = "calibrated"
    path: str = _PATH
    alpha: float = _ALPHA

    def budgets(self, avg: torch.Tensor, n_layers: int, lengths: torch.Tensor) -> torch.Tensor:
        shares = self._shares(avg.device)
        if shares.shape[0] != n_layers:
            self._refuse_shape("layers", n_layers, shares.shape[0])
        lengths = lengths.long()
        avg = torch.minimum(avg.long(), lengths)
        curve = self._curve(avg.device)
        if curve is None:
            per_layer = shares.sum(-1)[None, :].expand(avg.shape[0], -1)
        else:  # each layer's keep fraction at the row's ratio
            ratios, keep = curve
            ratio = 1.0 - avg.double() / lengths.double().clamp(min=1)
            per_layer = interpolate(ratios, keep.mean(-1), ratio)
        lower = torch.ones_like(per_layer)
        return split_by_shares(_mix(per_layer, self.alpha), n_layers * avg, lower, lengths)


@register_allocator("calibrated")
class Calibrated(_UsesCalibration, HeadAllocator):
    """Splits a layer's budget among its kv heads in proportion to calibrated shares (KVzip's
    share of kept entries per (layer, head), measured offline by ``kvpress-ada calibrate``; see the
    module docstring). Protected (``+inf``) entries are a floor: each head keeps at least its
    protected count when the floors fit in the layer's total (otherwise ``min(protected, budget)``,
    as ``AdaLayer`` does), and no head keeps more than the row's valid tokens."""

    name: Literal["calibrated"] = "calibrated"
    path: str = _PATH
    alpha: float = _ALPHA

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, comparable: bool = True) -> torch.Tensor:
        raise NotImplementedError("Calibrated splits by per-layer shares: call "
                                  "allocate_layer(scores, budget, layer_idx) (the pipeline does)")

    def allocate_layer(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int,
                       comparable: bool = True) -> torch.Tensor:
        B, H, L = scores.shape
        shares = self._shares(scores.device)
        if shares.shape[1] != H:
            self._refuse_shape("kv heads", H, shares.shape[1])
        if not 0 <= layer_idx < shares.shape[0]:
            self._refuse_shape("layers", f"a layer {layer_idx}", shares.shape[0])
        budget = budget.long()
        length = (~torch.isneginf(scores)).sum(-1).amax(-1)  # [B] valid tokens of the row
        total = H * torch.minimum(budget, length)
        protected = torch.minimum(torch.isposinf(scores).sum(-1), length[:, None])  # [B, H]
        fits = protected.sum(-1) <= total
        lower = torch.where(fits[:, None], protected, torch.minimum(protected, budget[:, None]))
        curve = self._curve(scores.device)
        if curve is None:
            row = shares[layer_idx][None, :].expand(B, -1)
        else:  # the heads' keep fractions where the curve has this layer keep budget / length
            keep = curve[1][:, layer_idx]  # [R, H], the layer's mean non-increasing along the ratios
            fraction = torch.minimum(budget, length).double() / length.double().clamp(min=1)
            row = interpolate(keep.mean(-1).flip(0), keep.flip(0), fraction)
        return split_by_shares(_mix(row, self.alpha), total, lower.double(), length)


def interpolate(x: torch.Tensor, y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[B, ...]``: ``y [R, ...]`` linearly interpolated at ``q [B]`` along ``x [R]`` (non-decreasing), held
    constant beyond its ends."""
    if x.shape[0] == 1:
        return y[0].expand(q.shape[0], *y.shape[1:])
    q = q.to(x.dtype)
    hi = torch.searchsorted(x.contiguous(), q.contiguous()).clamp(1, x.shape[0] - 1)
    x0, x1 = x[hi - 1], x[hi]
    w = ((q - x0) / (x1 - x0).clamp(min=torch.finfo(x.dtype).tiny)).clamp(0.0, 1.0)
    w = w.view(-1, *([1] * (y.dim() - 1)))
    return y[hi - 1] * (1.0 - w) + y[hi] * w


def _mix(shares: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * uniform + (1 - alpha) * shares`` of each row (rows normalised to sum 1)."""
    shares = shares / shares.sum(-1, keepdim=True).clamp(min=torch.finfo(shares.dtype).tiny)
    return alpha / shares.shape[-1] + (1.0 - alpha) * shares


def split_by_shares(shares: torch.Tensor, total: torch.Tensor, lower: torch.Tensor,
                    upper: torch.Tensor) -> torch.Tensor:
    """Integers ``[B, N]`` summing exactly to ``total [B]``, each in ``[lower, upper]``, in proportion
    to ``shares [B, N]`` where no bound binds: ``x = clamp(lam * shares, lower, upper)`` with ``lam``
    solved exactly (``x`` is piecewise linear in ``lam``), then largest-remainder rounding.

    Assumes ``lower.sum(-1) <= total <= N * upper`` and ``lower <= upper``, integer bounds.
    ``upper [B]`` is per row. A zero share gets its lower bound unless the others are all full.
    """
    s = shares.double().clamp(min=0) + 1e-12  # a zero share still fills up once every other entry is full
    lo = lower.double()
    hi = upper.double()[:, None].expand_as(lo)
    want = total.double()
    knots = torch.cat([lo / s, hi / s], -1).sort(-1).values  # [B, 2N]: where an entry leaves a bound
    filled = torch.minimum(torch.maximum(knots[..., None] * s[:, None, :], lo[:, None]), hi[:, None]).sum(-1)
    k = torch.searchsorted(filled.contiguous(), want[:, None].contiguous()).clamp(1, knots.shape[-1] - 1)
    k0, k1 = knots.gather(-1, k - 1), knots.gather(-1, k)
    f0, f1 = filled.gather(-1, k - 1), filled.gather(-1, k)
    t = ((want[:, None] - f0) / (f1 - f0).clamp(min=1e-300)).clamp(0, 1)
    lam = k0 + t * (k1 - k0)  # [B, 1]
    values = torch.minimum(torch.maximum(lam * s, lo), hi)
    values = torch.round(values * 2.0**20) / 2.0**20  # equal fractions tie exactly: float noise never decides
    return round_preserving_sum(values, total=total.long(), upper=upper.long(), tie_break=values)
