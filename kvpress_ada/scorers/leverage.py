"""Leverage scores (Chari and Van Durme, 2025, "Compactor", arXiv 2507.08143): keep the keys that are
statistical outliers of their head's pre-RoPE key matrix."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..observation import Observation
from .base import Scorer, register_scorer
from .statistics import gaussian_sketch, ridge_leverage, unrotate


def leverage_scores(obs: Observation, mask: torch.Tensor, sketch_dimension: int | None, ridge: float,
                    seed: int) -> torch.Tensor:
    """``[B, H_kv, L]`` ridge leverage scores of the pre-RoPE keys of ``obs`` over the entries ``mask [B, L]``
    (centred over them, optionally right-sketched by a seeded ``[D, sketch_dimension]`` Gaussian), zero
    elsewhere."""
    if obs.rope_inv_freq is None:
        raise ValueError("leverage scores need the model's RoPE inverse frequencies (obs.rope_inv_freq)")
    keys = unrotate(obs.keys, obs.rope_inv_freq, obs.positions, obs.key_mask)
    if sketch_dimension is not None:
        keys = keys @ gaussian_sketch(keys.shape[-1], sketch_dimension, seed, str(keys.device))
    full = mask[:, None, :].expand(obs.keys.shape[:3])
    return ridge_leverage(keys, full, ridge)


@register_scorer("leverage")
class Leverage(Scorer):
    """Score = ``diag(X (X^T X + ridge I)^-1 X^T)`` per kv head, ``X`` the row's valid pre-RoPE keys, centred,
    times a Gaussian sketch ``Phi [D, sketch_dimension]`` (entries ``N(0, 1/k)``; ``None``: no sketch, exact
    ridge leverage). Keys are un-rotated from the cache's post-RoPE keys with the model's RoPE frequencies
    and the entries' positions relative to the row's first entry (:func:`~.statistics.unrotate`).

    Differs from NVIDIA kvpress's ``LeverageScorePress`` (``kvpress/presses/leverage_press.py``, 0.5.5): the
    sketch is drawn once from ``seed`` and shared by every row, head and layer (kvpress draws a fresh one per
    call, row and head from the global RNG, so its selection is not reproducible and a batch row depends on
    its neighbours); scores are not z-normalised (kvpress z-scores the whole layer, an affine map common to
    all heads that changes no layer-local selection; :class:`~.compactor.Compactor`, which blends scores,
    z-scores them per row). The ridge and its tenfold retries are kvpress's.

    Across heads: a head's leverage scores sum to the rank of its (sketched) keys, at most
    ``min(D, sketch_dimension)`` in every head, so raw scores share one scale (Ada compares them).

    Chunked prefill and decode compression: the scores are recomputed over the kept entries and the new
    ones, un-rotated at their own positions."""

    name: Literal["leverage"] = "leverage"
    sketch_dimension: int | None = Field(48, ge=1, description="columns of the Gaussian sketch (None: no sketch)")
    ridge: float = Field(1e-2, gt=0.0, description="added to the Gram matrix's diagonal before the Cholesky factor")
    seed: int = Field(0, ge=0, description="seed of the Gaussian sketch")
    comparable_across_heads: ClassVar[bool] = True
    needs_rope: ClassVar[bool] = True

    def query_window(self) -> int:
        return 0

    def score(self, obs: Observation) -> torch.Tensor:
        return leverage_scores(obs, obs.key_mask, self.sketch_dimension, self.ridge, self.seed)
