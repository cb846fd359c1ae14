"""Composite tokens (KVCompose, Akulov et al., 2025, arXiv 2509.05165): a model-scope layer schedule that gives
every kv head of a layer the same count, chosen by one top-k over the layers' *composite* scores.

Each kv head of layer ``l`` sorts its scores in decreasing order; the composite score of rank ``r`` is the mean over
the layer's kv heads of their ``r``-th best score (the ``r``-th composite token aligns one entry of every head).
One top-k of ``n_layers * b`` over every layer's composite scores gives layer ``l`` its per-head budget ``b_l``: the
number of its composite tokens that win (so ``sum_l b_l = n_layers * b`` exactly). With ``UniformHead`` each kv head
then keeps its own best ``b_l`` entries: the paper's structured cache. ``first_layer_max`` (kvpress's
``KVComposePress``, commit 8bb29b9) replaces layer 0's composite scores by their maximum over the layers, so the
first layer keeps the most; ``floor`` is kvpress's ``keep_token_lower_bound`` (at least that many per head in every
layer, when it fits). Scores that are not comparable across heads are first turned into shares of each head's mass.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .heads import flat_topk_counts, head_shares
from .layers import LayerSchedule, lift_to_floor, register_layer_schedule
from .model_scope import layer_floors
from .rounding import round_preserving_sum


@register_layer_schedule("composite")
class CompositeLayer(LayerSchedule):
    """KVCompose's layer allocation by composite tokens (see the module docstring)."""

    name: Literal["composite"] = "composite"
    first_layer_max: bool = Field(True, description="layer 0's composite scores are their maximum over the layers")
    floor: int = Field(0, ge=0, description="least tokens per kv head in every layer (kvpress's "
                                            "keep_token_lower_bound), when it fits")

    needs_all_layers: ClassVar[bool] = True

    def budgets(self, avg: torch.Tensor, n_layers: int, lengths: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} splits the model's budget across layers from every layer's scores: call "
            "layer_budgets(scores, avg, lengths, comparable) with all layers' scores (a pipeline does)")

    def layer_budgets(self, scores: list[torch.Tensor], avg: torch.Tensor, lengths: torch.Tensor,
                      comparable: bool = True) -> torch.Tensor:
        """Per-head budget of every layer, ``[B, n_layers]`` long, each row summing to ``n_layers * min(avg,
        lengths)``; ``scores``: one ``[B, H, L]`` per layer (padding ``-inf``, protected ``+inf``)."""
        stacked = torch.stack(scores, dim=1)  # [B, n, H, L]
        B, n, H, L = stacked.shape
        lengths = lengths.long()
        avg = torch.minimum(avg.long(), lengths)
        if not comparable:
            stacked = head_shares(stacked.reshape(B, n * H, L)).view(B, n, H, L)
        composite = composite_scores(stacked)  # [B, n, L]
        if self.first_layer_max and n > 1:
            composite = torch.cat([composite.amax(dim=1, keepdim=True), composite[:, 1:]], dim=1)
        total = n * avg
        won = flat_topk_counts(composite, total)  # [B, n]: composite tokens each layer wins
        floor = layer_floors(stacked, avg, lengths)
        if self.floor:
            wanted = torch.maximum(floor, torch.minimum(torch.full_like(floor, self.floor), lengths[:, None]))
            fits = wanted.sum(-1) <= total
            floor = torch.where(fits[:, None], wanted, floor)
        lifted = lift_to_floor(won.double(), floor.double(), total.double())
        return round_preserving_sum(lifted, total=total, upper=lengths, tie_break=won)


def composite_scores(stacked: torch.Tensor) -> torch.Tensor:
    """``[B, n, L]``: the mean over kv heads of each head's ``r``-th best score, for every rank ``r``, from
    ``stacked [B, n, H, L]``. Heads holding fewer than ``r + 1`` entries (``-inf`` there) are left out of rank
    ``r``'s mean (``-inf`` when no head holds one); a rank where some head has a protected (``+inf``) entry is
    ``+inf``."""
    ranked = stacked.double().sort(dim=-1, descending=True).values
    held = ~torch.isneginf(ranked)
    protected = torch.isposinf(ranked).any(dim=2)
    finite = torch.where(torch.isfinite(ranked), ranked, torch.zeros_like(ranked))
    count = held.sum(dim=2)
    mean = finite.sum(dim=2) / count.clamp(min=1)
    mean = torch.where(protected, torch.full_like(mean, float("inf")), mean)
    return torch.where(count == 0, torch.full_like(mean, float("-inf")), mean)
