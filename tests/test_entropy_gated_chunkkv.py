"""Entropy-gated ChunkKV (kvpress's EntropyGatedChunkKVPress): the kept sets against kvpress's greedy walk recomputed
with explicit loops (chunk means and normalised entropies, the median gate, the top-up), at every budget; padding
changes nothing; the Ada variant's scores carry ChunkKV's per-head magnitudes; the lengths are validated. The model
matrix (every preset on every family, ragged against the Mask reference) runs it in test_matrix.py."""

from __future__ import annotations

import math

import pytest
import torch

from kvpress_ada import Observation, Pipeline, preset
from kvpress_ada.allocators import AdaHead
from kvpress_ada.scorers import EntropyGatedChunkKV, KNorm, SnapKV


def _obs(seed=0, B=2, Hkv=2, G=2, L=40, D=4, pads=(0, 10)):
    g = torch.Generator().manual_seed(seed)
    key_mask = torch.ones(B, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        key_mask[b, :p] = False
    scale = torch.rand(B, Hkv, L, 1, generator=g) * 3  # keys of uneven norms: spiky and flat chunks
    return Observation(keys=torch.randn(B, Hkv, L, D, generator=g) * scale,
                       values=torch.randn(B, Hkv, L, D, generator=g),
                       queries=torch.randn(B, Hkv * G, L, D, generator=g), key_mask=key_mask, layer_idx=0,
                       n_layers=1, scaling=D**-0.5)


def _walk(y: list[float], budget: int, length: int, low: int) -> set[int]:
    """kvpress's rule with loops on one ranking's scores ``y``: chunks of ``length`` (counted from the end), each
    with its mean and normalised entropy; chunks in decreasing mean, a chunk at or above the median mean and below
    the median entropy (lower medians) taking only its ``low`` best entries; then the best entries left."""
    n = len(y)
    chunks = [list(range(max(0, end - length), end)) for end in range(n, 0, -length)]
    means = [sum(y[i] for i in c) / len(c) for c in chunks]
    entropies = []
    for c in chunks:
        shift = min(min(y[i] for i in c), 0.0)
        total = sum(y[i] - shift for i in c) + 1e-8
        h = -sum((y[i] - shift) / total * math.log((y[i] - shift) / total + 1e-8) for i in c)
        entropies.append(0.0 if len(c) == 1 else min(max(h / math.log(len(c)), 0.0), 1.0))
    median_mean = sorted(means)[(len(means) - 1) // 2]
    median_entropy = sorted(entropies)[(len(entropies) - 1) // 2]
    kept: set[int] = set()
    for c in sorted(range(len(chunks)), key=lambda c: -means[c]):
        if budget <= 0:
            break
        take = min(len(chunks[c]), budget)
        if means[c] >= median_mean and entropies[c] < median_entropy:
            take = min(take, low)
        kept |= set(sorted(chunks[c], key=lambda i: -y[i])[:take])
        budget -= take
    rest = sorted((i for i in range(n) if i not in kept), key=lambda i: -y[i])
    return kept | set(rest[:max(budget, 0)])


def _ranking(inner_scores: torch.Tensor, b: int, h: int, shared: bool, valid: torch.Tensor) -> list[float]:
    """One ranking's scores over its valid entries, protected entries counted as its best finite score."""
    heads = inner_scores[b] if shared else inner_scores[b, h:h + 1]
    heads = heads[:, valid].double()
    best = heads[torch.isfinite(heads)].max()
    return torch.where(torch.isinf(heads), best, heads).sum(0).tolist()


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("inner,length,low", [(KNorm(), 10, 4), (KNorm(), 7, 3), (SnapKV(window=10, kernel=3), 5, 2),
                                              (SnapKV(window=20, kernel=1), 10, 4)],
                         ids=["knorm_10_4", "knorm_7_3", "snapkv_5_2", "snapkv_10_4"])
def test_keeps_what_kvpress_greedy_walk_keeps_at_every_budget(inner, length, low, shared):
    obs = _obs()
    scorer = EntropyGatedChunkKV(scorer=inner, length=length, low_entropy_length=low, shared=shared)
    raw = inner.score(obs).float()
    window = getattr(inner, "window", 0)  # protected entries: whole chunks at the end, the walk's first
    for budget in range(max(window, 1), 31):
        keep = Pipeline(scorer=scorer, budget=budget).select(obs)
        for b in range(2):
            valid = obs.key_mask[b]
            for h in range(2):
                want = _walk(_ranking(raw, b, h, shared, valid), budget, length, low)
                got = set(torch.nonzero(keep[b, h][valid])[:, 0].tolist())
                assert got == want, (budget, b, h)
        if shared:
            assert keep.eq(keep[:, :1]).all()


def test_padding_changes_nothing():
    obs = _obs()
    for scorer in (EntropyGatedChunkKV(scorer=SnapKV(window=6)), EntropyGatedChunkKV(shared=False, length=6,
                                                                                       low_entropy_length=2)):
        batch = scorer.score(obs)
        for b, p in enumerate((0, 10)):
            row = Observation(keys=obs.keys[b:b + 1, :, p:], values=obs.values[b:b + 1, :, p:],
                              queries=obs.queries[b:b + 1, :, p:], key_mask=obs.key_mask[b:b + 1, p:], layer_idx=0,
                              n_layers=1, scaling=obs.scaling)
            assert torch.allclose(batch[b:b + 1, :, p:], scorer.score(row), rtol=1e-6)


def _walk_order(y: list[float], length: int, low: int) -> list[tuple[int, bool, float]]:
    """The whole walk of :func:`_walk` (a budget keeps a prefix of it): ``(entry, taken with its chunk, worth)`` in
    order, an entry taken with its chunk worth the chunk's mean, a spiky chunk's other entry its own score."""
    n = len(y)
    order: list[int] = []
    for budget in range(1, n + 1):
        [new] = _walk(y, budget, length, low) - set(order)
        order.append(new)
    chunks = [list(range(max(0, end - length), end)) for end in range(n, 0, -length)]
    chunk_of = {i: c for c, members in enumerate(chunks) for i in members}
    spiky = _spiky_chunks(y, chunks)
    out = []
    for e in order:
        mates = chunks[chunk_of[e]]
        best = sorted(mates, key=lambda i: -y[i])
        in_chunk = chunk_of[e] not in spiky or best.index(e) < low
        out.append((e, in_chunk, sum(y[i] for i in mates) / len(mates) if in_chunk else y[e]))
    return out


def _spiky_chunks(y: list[float], chunks: list[list[int]]) -> set[int]:
    """The chunks at or above the median mean and below the median entropy (lower medians)."""
    means, entropies = [], []
    for ch in chunks:
        shift = min(min(y[i] for i in ch), 0.0)
        total = sum(y[i] - shift for i in ch) + 1e-8
        h = -sum((y[i] - shift) / total * math.log((y[i] - shift) / total + 1e-8) for i in ch)
        means.append(sum(y[i] for i in ch) / len(ch))
        entropies.append(0.0 if len(ch) == 1 else min(max(h / math.log(len(ch)), 0.0), 1.0))
    mm, me = sorted(means)[(len(means) - 1) // 2], sorted(entropies)[(len(entropies) - 1) // 2]
    return {c for c in range(len(chunks)) if means[c] >= mm and entropies[c] < me}


@pytest.mark.parametrize("shared", [True, False])
def test_scores_carry_the_walks_chunk_means(shared):
    """Along the walk the scores fall; an entry taken with its chunk scores the chunk's mean (ChunkKV's score, what
    Ada compares across heads), up to the small steps that order it within its chunk; a spiky chunk's other entries
    score below every entry taken."""
    obs = _obs(pads=(0, 0))
    raw = KNorm().score(obs).double()
    got = EntropyGatedChunkKV(scorer=KNorm(), shared=shared, length=6, low_entropy_length=2).score(obs).double()
    for b in range(2):
        off = []
        for h in range(2):
            walk = _walk_order(_ranking(raw, b, h, shared, obs.key_mask[b]), 6, 2)
            scores = [float(got[b, h, e]) for e, _, _ in walk]
            assert all(x > y for x, y in zip(scores, scores[1:]))  # distinct inputs: strictly falling
            taken = [(float(got[b, h, e]), worth) for e, in_chunk, worth in walk if in_chunk]
            rest = [float(got[b, h, e]) for e, in_chunk, _ in walk if not in_chunk]
            assert taken and rest and min(s for s, _ in taken) > max(rest)
            off += [abs(s - w) / abs(w) for s, w in taken]
        assert max(off) < 1e-3  # the chunk's mean, in its units (steps of 2e-5 within a chunk)


def test_float_ties_stay_ties():
    """Entries the walk orders by less than the tie tolerance score within it too (the top-k then breaks the tie by
    position, the same way whatever rounding produced them: a padded batch, another process's heads); by more, they
    score a step apart."""
    from kvpress_ada.ranking import TIE_RTOL
    from kvpress_ada.scorers.entropy_gated_chunkkv import gated_order_scores

    obs = _obs(pads=(0, 0))
    raw = KNorm().score(obs)
    for gap, tied in ((1e-7, True), (1e-4, False)):
        nudged = raw.clone()
        nudged[:, :, 30] = raw[:, :, 31] * (1 - gap)  # entry 30 a hair above its chunk mate 31 (scores < 0)
        for shared in (True, False):
            out = gated_order_scores(nudged, obs.key_mask, 10, 4, shared).double()
            near = (out[:, :, 30] - out[:, :, 31]).abs() <= TIE_RTOL * out[:, :, 31].abs()
            assert bool(near.all()) if tied else not bool(near.any())


def test_ada_variant_splits_the_budget_exactly_and_unevenly():
    obs = _obs(pads=(0, 0))
    counts = Pipeline(scorer=EntropyGatedChunkKV(scorer=SnapKV(window=4), shared=False, length=6,
                                                 low_entropy_length=2),
                      allocator=AdaHead(alpha=0.2), budget=12).select(obs).sum(-1)
    assert torch.equal(counts.sum(-1), torch.tensor([24, 24])) and (counts != 12).any()  # exact total, uneven


def test_lengths_are_validated_in_one_line():
    scorer = EntropyGatedChunkKV()
    assert (scorer.length, scorer.low_entropy_length, scorer.shared) == (10, 4, True)
    assert isinstance(scorer.scorer, SnapKV)
    for length, low in ((4, 4), (3, 5)):
        with pytest.raises(ValueError, match=f"length > low_entropy_length >= 1, got length={length}") as err:
            EntropyGatedChunkKV(length=length, low_entropy_length=low)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="low_entropy_length"):
        EntropyGatedChunkKV(low_entropy_length=0)
    with pytest.raises(ValueError, match="model pass"):
        EntropyGatedChunkKV(scorer="kvzip")


def test_presets_and_capabilities():
    press = preset("entropy_gated_chunkkv", compression_ratio=0.5)
    assert press.scorer == EntropyGatedChunkKV() and press.scorer.shared
    ada = preset("ada_entropy_gated_chunkkv", compression_ratio=0.5)
    assert not ada.scorer.shared and ada.allocator == AdaHead(alpha=0.2)
    assert Pipeline.model_validate_json(ada.model_dump_json()) == ada
    assert EntropyGatedChunkKV(scorer=KNorm()).comparable_across_heads is False
    assert EntropyGatedChunkKV().query_window() == SnapKV().query_window()
