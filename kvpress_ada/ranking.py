"""Top-k selection that float noise cannot decide: every top-k that keeps or counts entries
(``topk_mask``, ``flat_topk_counts``, hence every evictor and Ada allocator) goes through here.

Scores that are equal in exact arithmetic often come out a few ulps apart, and differently from
one run to another: KNorm's key norms of a repeated token at two RoPE angles, KeyDiff's cosines of
a head's two entries to their mean, any score once the keys differ by the float noise of a padded
batch or of ragged vs dense attention. Ranking on those last bits would make the kept set depend
on the batch layout or the cache kind. So the contract of :func:`top_k` is: scores within a
relative ``TIE_RTOL`` of the k-th best score are ties, and ties go by position. Selections from
two sets of scores that agree to ``TIE_RTOL`` are then identical, unless a genuinely distinct
score lies almost exactly ``TIE_RTOL`` away from the k-th best (a measure-zero coincidence,
where a tie group at the threshold is the common case). ``+inf`` and ``-inf`` tie only with
themselves. No host sync: it compiles.
"""

from __future__ import annotations

import torch

from .kernels.ragged.sparse_cpu_kernel import top_k_cpu

#: relative width of a tie at the selection threshold: about 80 float32 ulps, far above the noise of
#: equivalent computations (a few ulps), far below any difference a scorer means
TIE_RTOL = 1e-5


def top_k(scores: torch.Tensor, k: torch.Tensor, recent_first: bool) -> torch.Tensor:
    """Bool mask of the ``k[...]`` best entries along the last dim of ``scores [..., N]`` (``k``
    has the leading shape of ``scores``, values in ``[0, N]``). Entries beyond ``TIE_RTOL`` above
    the k-th best are kept; the rest are taken from the ties of the k-th best, the later positions
    first when ``recent_first``, else the earlier ones."""
    fused = top_k_cpu(scores, k, recent_first, TIE_RTOL)  # eager CPU calls: a quickselect per row, same entries
    if fused is not None:
        return fused
    n = scores.shape[-1]
    k = k.long().clamp(0, n)[..., None]
    ranked = scores.sort(dim=-1, descending=True).values
    kth = ranked.gather(-1, (k - 1).clamp(min=0))
    tol = torch.where(torch.isfinite(kth), kth.abs() * TIE_RTOL, torch.zeros_like(kth))
    tied = (scores == kth) | ((scores - kth).abs() <= tol)  # inf - inf is NaN: == covers the infinities
    above = (scores > kth) & ~tied  # not kth + tol: that sum may round past a score more than tol above kth
    want = k - above.sum(-1, keepdim=True)  # entries still to take from the ties
    order = tied.long()
    before = (order.flip(-1).cumsum(-1).flip(-1) if recent_first else order.cumsum(-1)) - order
    return above | (tied & (before < want))
