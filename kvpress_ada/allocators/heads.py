"""Head allocators: split a layer's budget among its kv heads."""

from __future__ import annotations

from typing import Callable, ClassVar, Literal

import torch
from pydantic import Field

from ..components import Component, Registry
from ..ranking import TIE_RTOL, top_k
from .rounding import round_preserving_sum


class HeadAllocator(Component):
    """``allocate(scores [B, H, L], budget [B]) -> counts [B, H]`` with ``counts.sum(-1) == H * budget``
    exactly and ``counts <= L``. ``comparable`` says whether scores of different heads share a scale."""

    kind: ClassVar[str] = "allocator"
    #: counts of a head depend on that head's scores alone (no collective under tensor parallelism); an
    #: allocator that compares heads (the default, the safe assumption) gets every head's scores
    head_local: ClassVar[bool] = False
    #: the allocator decides from the scores how many entries each head keeps (``Threshold``): a pipeline
    #: then needs no budget, and one it has only caps the heads
    sets_budget: ClassVar[bool] = False

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor,
                 comparable: bool = True) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement allocate(scores, budget, comparable)")

    def allocate_layer(self, scores: torch.Tensor, budget: torch.Tensor, layer_idx: int,
                       comparable: bool = True) -> torch.Tensor:
        """What the pipeline calls for layer ``layer_idx``: :meth:`allocate` for allocators that split
        every layer alike; allocators with per-layer knowledge (``Calibrated``) override this."""
        return self.allocate(scores, budget, comparable)


ALLOCATORS = Registry("allocator", HeadAllocator)
register_allocator = ALLOCATORS.decorator_function()


@register_allocator("uniform")
class UniformHead(HeadAllocator):
    """Every kv head of a layer keeps the same number of tokens (SnapKV, PyramidKV)."""

    name: Literal["uniform"] = "uniform"
    head_local: ClassVar[bool] = True

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, comparable: bool = True) -> torch.Tensor:
        return budget.long()[:, None].expand(-1, scores.shape[1]).clone()


@register_allocator("ada")
class AdaHead(HeadAllocator):
    """Ada-KV (Feng et al., NeurIPS 2025): a top-k over the flattened scores of all kv heads of a
    layer gives head ``i`` its adaptive share ``n_i``; the safeguard mixes it with the uniform share,
    ``alpha * b + (1 - alpha) * n_i``, rounded (largest remainder) so the layer total is exact.
    ``alpha=1`` is ``UniformHead``. When scores are not comparable across heads, each head's
    scores are first turned into shares of its own mass, which makes the comparison scale-free;
    a head whose scores are all equal carries no preference and keeps its uniform share."""

    name: Literal["ada"] = "ada"
    alpha: float = Field(0.2, ge=0.0, le=1.0, description="safeguard: fraction of the uniform share every head keeps")

    def allocate(self, scores: torch.Tensor, budget: torch.Tensor, comparable: bool = True) -> torch.Tensor:
        B, H, L = scores.shape
        budget = budget.long()
        if comparable:
            adaptive = flat_topk_counts(scores, H * budget)
        else:
            flat = constant_heads(scores)  # [B, H]: uniform share, the rest compete on their shares
            shares = head_shares(scores).masked_fill(flat[..., None], float("-inf"))
            n_flat = flat.long().sum(-1)
            adaptive = flat_topk_counts(shares, (H - n_flat) * budget) + flat.long() * budget[:, None]
        mixed = self.alpha * budget.double()[:, None] + (1.0 - self.alpha) * adaptive.double()
        return round_preserving_sum(mixed, total=H * budget, upper=torch.full_like(budget, L), tie_break=adaptive)


def flat_topk_counts(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """How many of the top ``k[b]`` entries of the flattened ``[H * L]`` scores fall in each head;
    ties (exact, or within the float noise ``kvpress_ada.ranking`` defines) go to the lower
    (position, head) index, so a tie spanning heads is split across them in turn."""
    B, H, L = scores.shape
    by_position = scores.transpose(1, 2).reshape(B, L * H)
    return top_k(by_position, k, recent_first=False).view(B, L, H).sum(1)


def fit_to_valid(scores: torch.Tensor, counts: torch.Tensor, valid: torch.Tensor,
                 select: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Counts ``[B, H]`` that every head can fill: each head's count clipped to its ``valid [B, H, L]``
    entries, the excess handed to the best valid entries not yet selected in the row's other heads
    (``select(scores, counts) -> keep``: the selection the counts will be used with). A row's total
    stays ``min(counts.sum(-1), valid.sum((-1, -2)))``. Counts that fit are returned unchanged.
    No host sync (it runs inside compiled steps)."""
    cap = valid.sum(-1)
    clipped = torch.minimum(counts.long(), cap)
    room = (cap.sum(-1) - clipped.sum(-1)).clamp(min=0)
    excess = torch.minimum((counts.long() - clipped).sum(-1), room)
    floor = torch.finfo(scores.dtype).min  # a valid entry scored -inf still beats padding
    ranked = torch.where(valid, scores.clamp(min=floor), torch.full_like(scores, float("-inf")))
    chosen = select(ranked, clipped)
    rest = torch.where(valid & ~chosen, ranked, torch.full_like(scores, float("-inf")))
    return clipped + flat_topk_counts(rest, excess)


def constant_heads(scores: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` bool: heads whose finite scores are all equal (``+inf``/``-inf`` entries aside),
    to the relative precision ``TIE_RTOL`` of ``kvpress_ada.ranking`` (float noise is no preference)."""
    finite = torch.isfinite(scores)
    high = torch.where(finite, scores, torch.full_like(scores, float("-inf"))).amax(-1)
    low = torch.where(finite, scores, torch.full_like(scores, float("inf"))).amin(-1)
    spread = torch.where(high > low, high - low, torch.zeros_like(high))  # no finite entry: 0, not NaN
    return ~(spread > TIE_RTOL * torch.maximum(high.abs(), low.abs()))


def head_shares(scores: torch.Tensor) -> torch.Tensor:
    """Each head's finite scores shifted to be non-negative and divided by their sum;
    ``+inf`` (protected) and ``-inf`` (padding) entries are left as they are."""
    finite = torch.isfinite(scores)
    low = torch.where(finite, scores, torch.full_like(scores, float("inf"))).amin(-1, keepdim=True)
    shifted = torch.where(finite, scores - low, torch.zeros_like(scores))
    mass = shifted.sum(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny)
    return torch.where(finite, shifted / mass, scores)
