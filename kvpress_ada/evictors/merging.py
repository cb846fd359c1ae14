"""Merging evicted entries into kept ones: what an evictor does with the rest (``Evictor(merge=...)``).

When a layer keeps its selection, a :class:`Merge` folds the values of the entries it drops into the values of
entries it keeps (per kv head; keys are left as they are, so RoPE positions stay right), and the kept entries are
then stored as the evictor says (``TopK``: the ragged cache frees the dropped ones; ``Mask``: the dense reference
hides them). Every eviction merges: the prompt's end, each chunk of a chunked prefill, each decode compaction.
Register your own with :func:`register_merge`.

* :class:`SimilarityMerge` (NVIDIA kvpress's ``MergingPress``, after Token Merging, Bolya et al. 2023, and D2O,
  Wan et al. 2024): each dropped entry's value goes to its most cosine-similar kept key's entry, weighted by that
  similarity and the two values' norms, then normalised.
* :class:`CaM` (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference"; kvpress's
  ``CAMPress``): each dropped entry's value is spread over the ``merge_budget`` kept entries that follow it, with the
  probability ``clamp(A_i / mean A_window, 0, 1)`` of its score against theirs.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from ..components import Component, Registry

_EPS = 1e-6  # as kvpress: safe in float16 and bfloat16
_BLOCK = 256  # dropped entries compared with the kept ones at a time (bounds the similarity matrix)


class Merge(Component):
    """``merge(keys, values, valid, keep, scores) -> values``: the values ``[B, H_kv, L, D]`` of a layer's view after
    the dropped entries (``valid & ~keep``) are folded into the kept ones (``valid & keep``); only kept entries'
    values may change. ``needs_scores``: it reads the scorer's scores of the view (``scores [B, H_kv, L]``)."""

    kind: ClassVar[str] = "merge"
    needs_scores: ClassVar[bool] = False

    def merge(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor,
              scores: torch.Tensor | None) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement merge(...)")


MERGES = Registry("merge", Merge)
register_merge = MERGES.decorator_function()


@register_merge("similarity")
class SimilarityMerge(Merge):
    """kvpress's ``MergingPress`` (commit 8bb29b9), per kv head: a dropped entry ``e`` goes to the kept entry ``t`` of
    most cosine-similar key (``s = cos(k_e, k_t)``); it merges when ``s >= similarity_threshold`` and ``s`` is among
    the ``merge_fraction`` highest of the head's merging entries, with weight
    ``w_e = max(s, 0) * ||v_e|| / (||v_e|| + ||v_t|| + eps)``; then ``v_t <- (v_t + sum_e w_e v_e) / (1 + sum_e w_e)``
    over the entries merged into ``t`` (computed in fp32). Differs from kvpress: the heads of a row may keep
    different entries (Ada), and left padding takes no part."""

    name: Literal["similarity"] = "similarity"
    similarity_threshold: float = Field(0.0, ge=0.0, le=1.0, description="least cosine similarity that merges")
    merge_fraction: float = Field(1.0, gt=0.0, le=1.0, description="fraction of the dropped entries (most similar "
                                                                   "first) that merge")

    def merge(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor,
              scores: torch.Tensor | None) -> torch.Tensor:
        kept, dropped = valid & keep, valid & ~keep
        if not bool(dropped.any()) or not bool(kept.any()):
            return values
        unit = keys.float() / keys.float().norm(dim=-1, keepdim=True).clamp(min=_EPS)
        best = torch.full(keys.shape[:3], float("-inf"), device=keys.device)
        target = torch.zeros(keys.shape[:3], dtype=torch.long, device=keys.device)
        for start in range(0, keys.shape[2], _BLOCK):  # [B, H, block, L] similarities to every kept entry
            sim = torch.einsum("bhid,bhjd->bhij", unit[:, :, start:start + _BLOCK], unit)
            sim = sim.masked_fill(~kept[:, :, None, :], float("-inf"))
            best[:, :, start:start + _BLOCK], target[:, :, start:start + _BLOCK] = sim.max(dim=-1)
        ok = dropped & (best >= self.similarity_threshold)
        if self.merge_fraction < 1.0:
            cut = _quantile_among(best.masked_fill(~ok, float("-inf")), dropped, 1.0 - self.merge_fraction)
            ok = ok & (best >= cut)
        v = values.float()
        norms = v.norm(dim=-1)
        weight = best.clamp(min=0) * ok * norms / (norms + norms.gather(-1, target) + _EPS)
        weight = torch.where(ok, weight, torch.zeros_like(weight))
        added = torch.zeros_like(v).scatter_add_(2, target[..., None].expand_as(v), weight[..., None] * v)
        total = torch.zeros_like(weight).scatter_add_(2, target, weight)
        merged = (v + added) / (1.0 + total)[..., None]
        return torch.where((kept & (total > 0))[..., None], merged.to(values.dtype), values)


@register_merge("cam")
class CaM(Merge):
    """CaM, as kvpress's ``CAMPress`` (commit 8bb29b9) merges, per kv head: the ``merge_budget`` kept entries right
    after a dropped entry ``e`` (in position order; fewer at the end of the row) each receive ``p_e / m_e * v_e``,
    with ``m_e`` the number of those targets and ``p_e = clamp(A_e / mean_t A_t, 0, 1)`` (as kvpress: 1 for
    ``A_e > 0`` over a mean of 0, 0 for ``0 / 0``), ``A`` the scorer's scores (the attention an attention scorer
    measures), a protected entry's ``+inf`` counted as the head's highest finite score (as kvpress's scorers score
    their window). Differs from kvpress: the expected merge (``p_e``) instead of a Bernoulli draw of it (no
    randomness: a batch row merges as it would alone), every dropped entry merges (kvpress merges the
    ``compression_interval`` best-scored dropped tokens of each compaction, as its per-step emulation), per kv head
    (kvpress evicts the same tokens in every head, by their mean score), and at every eviction (kvpress's is a
    decoding press: use ``decode_budget``/``decode_interval`` for that)."""

    name: Literal["cam"] = "cam"
    merge_budget: int = Field(32, ge=1, description="kept entries after a dropped one that share its value")
    needs_scores: ClassVar[bool] = True

    def merge(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor,
              scores: torch.Tensor | None) -> torch.Tensor:
        if scores is None:
            raise ValueError("CaM merges by the scorer's scores of the dropped and kept entries; none were given")
        kept, dropped = valid & keep, valid & ~keep
        if not bool(dropped.any()) or not bool(kept.any()):
            return values
        B, H, L, D = values.shape
        m = self.merge_budget
        # rank of each column among its row's kept entries; the kept entries in order, padded at the end
        order = torch.where(kept, torch.arange(L, device=keep.device), L).sort(dim=-1).values  # [B, H, L]
        n_kept = kept.sum(-1)  # [B, H]
        start = kept.long().cumsum(-1)  # a dropped entry's first target: the kept entries before it
        window = start[..., None] + torch.arange(m, device=keep.device)  # [B, H, L, m] ranks of its targets
        inside = window < n_kept[..., None, None]
        columns = order.gather(-1, window.clamp(max=L - 1).reshape(B, H, L * m)).view(B, H, L, m)
        columns = columns.clamp(max=L - 1)
        a = scores.float()
        finite = torch.isfinite(a)
        top = torch.where(finite, a, torch.full_like(a, float("-inf"))).amax(-1, keepdim=True)
        a = torch.where(torch.isposinf(a), top.expand_as(a), torch.where(finite, a, torch.zeros_like(a)))
        a_targets = a.gather(-1, columns.reshape(B, H, L * m)).view(B, H, L, m)
        count = inside.sum(-1)
        mean = torch.where(inside, a_targets, torch.zeros_like(a_targets)).sum(-1) / count.clamp(min=1)
        p = (a / mean).nan_to_num(nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)
        p = torch.where(dropped & (count > 0) & torch.isfinite(mean), p, torch.zeros_like(p))
        share = (p / count.clamp(min=1))[..., None] * inside  # [B, H, L, m]
        v = values.float()
        added = torch.zeros_like(v)
        contributions = (share[..., None] * v[:, :, :, None, :]).reshape(B, H, L * m, D)
        added.scatter_add_(2, columns.reshape(B, H, L * m, 1).expand(-1, -1, -1, D), contributions)
        return torch.where(kept[..., None], (v + added).to(values.dtype), values)


def _quantile_among(values: torch.Tensor, members: torch.Tensor, q: float) -> torch.Tensor:
    """``[B, H, 1]``: the ``q``-quantile (linear interpolation, as ``torch.quantile``) of ``values [B, H, L]`` over
    each head's ``members`` (``-inf`` where none)."""
    out = torch.full(values.shape[:2] + (1,), float("-inf"), device=values.device)
    for b in range(values.shape[0]):
        for h in range(values.shape[1]):
            row = values[b, h][members[b, h]]
            if row.numel():
                out[b, h, 0] = torch.quantile(row, q)
    return out


__all__ = ["MERGES", "CaM", "Merge", "SimilarityMerge", "register_merge"]
