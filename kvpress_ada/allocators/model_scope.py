"""Model-scope allocation: a layer schedule that splits the whole model's budget across layers
from the scores of every layer (Ada-KV's top-k, lifted from the heads of a layer to all layers).

``AdaLayer(alpha)`` needs every layer's scores before any eviction, so a pipeline using it evicts
once, at the end of prefill; the plain ``budgets(avg, n_layers, lengths)`` of a layer schedule
raises for it. ``AdaLayer(alpha=0)`` then ``AdaHead(alpha=0)`` is one global top-k over all layers
and heads (:func:`model_topk_counts`) whenever every layer's share is a whole number of tokens per
head; otherwise a layer's total differs from it by less than ``H`` entries, plus what the floor
moves (``docs/design.md``, end of prefill).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .heads import constant_heads, flat_topk_counts, head_shares
from .layers import LayerSchedule, lift_to_floor, register_layer_schedule
from .rounding import round_preserving_sum


def model_topk_counts(scores: list[torch.Tensor], k: torch.Tensor) -> torch.Tensor:
    """How many of the top ``k[b]`` entries over all layers and heads fall in each (layer, head).

    ``scores``: one ``[B, H, L]`` tensor per layer (same shape for every layer); returns
    ``[B, n_layers, H]`` long. Ties go to the lower (layer, head, position) index.
    """
    stacked = torch.stack(scores, dim=1)  # [B, n, H, L]
    B, n, H, L = stacked.shape
    return flat_topk_counts(stacked.reshape(B, n * H, L), k.long()).view(B, n, H)


@register_layer_schedule("ada_layer")
class AdaLayer(LayerSchedule):
    """Ada-KV at model scope: a top-k over the flattened scores of all layers and kv heads gives
    layer ``l`` its adaptive per-head share ``n_l`` (entries it wins, divided by ``H``); the safeguard
    mixes it with the uniform share, ``alpha * b + (1 - alpha) * n_l``, rounded (largest remainder)
    so ``budgets.sum(-1) == n_layers * b`` exactly. ``alpha=1`` is ``UniformLayer``.

    When scores are not comparable across heads (nor, then, across layers), each (layer, head)'s
    scores are first turned into shares of its own mass (``head_shares``), which makes the
    comparison scale-free; a head whose scores are all equal carries no preference and keeps
    its uniform share ``b``, as in ``AdaHead``.

    Floor: every layer keeps at least ``need_l = max(1, max_h protected_{l,h})`` tokens per head,
    where ``protected_{l,h}`` counts the ``+inf`` (protected) entries of head ``h`` of layer ``l``, so
    even ``UniformHead`` inside the layer keeps every protected token and no layer is ever emptied.
    If the floors do not fit in the total (``sum_l need_l > n_layers * b``), the floor becomes
    ``min(need_l, b)``: each layer keeps at least what the uniform schedule would give it (which
    is still ``>= 1``). Layers below their floor are lifted to it; the lift is paid by the layers
    above their floor in proportion to their surplus, so totals stay exact and no layer exceeds
    the context length.
    """

    name: Literal["ada_layer"] = "ada_layer"
    alpha: float = Field(0.2, ge=0.0, le=1.0, description="safeguard: fraction of the uniform share every layer keeps")

    needs_all_layers: ClassVar[bool] = True

    def budgets(self, avg: torch.Tensor, n_layers: int, lengths: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} allocates the model's budget across layers from every layer's scores: "
            "it has no budget without them. Call layer_budgets(scores, avg, lengths, comparable) with all "
            "layers' scores (a pipeline using it evicts once, at the end of prefill)."
        )

    def layer_budgets(self, scores: list[torch.Tensor], avg: torch.Tensor, lengths: torch.Tensor,
                      comparable: bool = True) -> torch.Tensor:
        """Per-head budget of every layer, ``[B, n_layers]`` long.

        ``scores``: one ``[B, H, L]`` tensor per layer (padding at ``-inf``, protected at ``+inf``);
        ``avg [B]``: average per-head budget; ``lengths [B]``: valid tokens per row. Each row sums
        to ``n_layers * min(avg, lengths)`` exactly and every budget lies in ``[floor, lengths]``
        (see the class docstring for the floor).
        """
        stacked = torch.stack(scores, dim=1)  # [B, n, H, L]
        B, n, H, L = stacked.shape
        lengths = lengths.long()
        avg = torch.minimum(avg.long(), lengths)
        flat = stacked.reshape(B, n * H, L)
        if comparable:
            counts = flat_topk_counts(flat, n * H * avg)
        else:
            const = constant_heads(flat)  # [B, n*H]: uniform share, the rest compete on their shares
            shares = head_shares(flat).masked_fill(const[..., None], float("-inf"))
            n_const = const.long().sum(-1)
            counts = flat_topk_counts(shares, (n * H - n_const) * avg) + const.long() * avg[:, None]
        won = counts.view(B, n, H).sum(-1)  # [B, n]: entries each layer wins
        adaptive = won.double() / H
        mixed = self.alpha * avg.double()[:, None] + (1.0 - self.alpha) * adaptive
        total = n * avg
        floor = layer_floors(stacked, avg, lengths)
        lifted = lift_to_floor(mixed, floor.double(), total.double())
        return round_preserving_sum(lifted, total=total, upper=lengths, tie_break=won)


def layer_floors(stacked: torch.Tensor, avg: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` long: the least per-head budget of each layer (see ``AdaLayer``'s floor rule).

    ``stacked``: ``[B, n, H, L]`` scores; ``avg``, ``lengths``: ``[B]`` long with ``avg <= lengths``.
    """
    n = stacked.shape[1]
    protected = torch.isposinf(stacked).sum(-1).amax(-1)  # [B, n]
    need = torch.minimum(protected.clamp(min=1), lengths[:, None])
    fits = need.sum(-1) <= n * avg
    return torch.where(fits[:, None], need, torch.minimum(need, avg[:, None]))
