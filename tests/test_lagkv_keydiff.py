"""LagKV and KeyDiff: golden scores recomputed with explicit Python loops over (batch, head,
partition, token, channel) on tiny tensors with left padding; each golden test also checks that the
formula with a factor removed (LagKV's value term, its next-partition normalisation, its softmax;
KeyDiff's key normalisation in the anchor) gives different scores, so the test would catch it.
Then the presets through the model (ragged == Mask, batch == single rows), Ada composition, and
agreement with NVIDIA kvpress when it is importable."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import left_padded_batch

from kvpress_ada import AdaHead, KeyDiff, LagKV, Mask, Observation, Pipeline, preset

INF = float("inf")
TAIL = LagKV.TAIL
RTOL, ATOL = 1e-4, 1e-6


def _setup(seed, B=2, H=2, L=23, D=3, pads=(0, 3)):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, L, D, generator=g)
    values = torch.randn(B, H, L, D, generator=g)
    key_mask = torch.ones(B, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        key_mask[b, :p] = False
        keys[b, :, :p] = keys[b, :, :p] * 40 + 9  # padding garbage: any leak shows
        values[b, :, :p] = values[b, :, :p] * 40 - 9
    return keys, values, key_mask


def _obs(keys, values, key_mask):
    B, H, L, D = keys.shape
    return Observation(keys=keys, values=values, queries=keys[:, :, :0], key_mask=key_mask, layer_idx=0,
                       n_layers=1, scaling=D**-0.5)


# ----------------------------------------------------------------------------- LagKV by hand


def _std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _softmax(xs):
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    return [v / sum(e) for v in e]


def _spread_shares(X, part, ref, normalise=True, softmax=True):
    """Channel std of each token of ``part`` normalised by ``ref``'s per-channel min/max; softmax."""
    D = len(X[0])
    lo = [min(X[t][c] for t in ref) for c in range(D)]
    hi = [max(X[t][c] for t in ref) for c in range(D)]
    spreads = []
    for t in part:
        if normalise:
            normed = [(X[t][c] - lo[c]) / (hi[c] - lo[c]) for c in range(D)]
        else:
            normed = list(X[t])
        spreads.append(_std(normed))
    return _softmax(spreads) if softmax else spreads


def lagkv_by_hand(keys, values, key_mask, lag, sinks, cross=False, use_values=True, normalise=True,
                  softmax=True):
    B, H, L, _ = keys.shape
    out = torch.zeros(B, H, L, dtype=torch.float64)
    for b in range(B):
        pos = [i for i in range(L) if key_mask[b, i]]  # valid positions; ranks index them
        n = len(pos)
        for h in range(H):
            K = keys[b, h].double().tolist()
            V = values[b, h].double().tolist()
            K = [K[i] for i in pos]
            V = [V[i] for i in pos]
            score = [0.0] * n
            if n < sinks + 2 * lag:  # short context: sinks, then recency
                for r in range(n):
                    score[r] = INF if r < sinks else (r - sinks) / (n - sinks)
            else:
                P = (n - sinks) // lag
                for r in range(n):
                    score[r] = INF if r < sinks else TAIL  # the tail: last full partition + remainder
                for p in range(P - 1):
                    part = list(range(sinks + p * lag, sinks + (p + 1) * lag))
                    ref = [t + lag for t in part]
                    sk = _spread_shares(K, part, ref, normalise, softmax)
                    sv = _spread_shares(V, part, ref, normalise, softmax) if use_values else [0.0] * lag
                    share = [(x + y) / 2 for x, y in zip(sk, sv)]
                    for i, t in enumerate(part):
                        if cross:
                            score[t] = share[i]
                        else:  # rank within the partition (ties: earlier token ranks lower)
                            rank = sum(1 for j in range(lag) if share[j] < share[i] or (share[j] == share[i] and j < i))
                            score[t] = rank / lag
            for r, i in enumerate(pos):
                out[b, h, i] = score[r]
    return out


def _assert_valid_close(got, want, key_mask):
    """Valid positions agree (rank steps are 1 / lag, far above the tolerance)."""
    valid = key_mask[:, None, :].expand_as(got)
    got, want = got.double()[valid], want[valid]
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "protected positions differ"
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=RTOL, atol=ATOL), (got - want).abs()[finite].max()


def _differs(got, want, key_mask):
    valid = key_mask[:, None, :].expand_as(got)
    got, want = got.double()[valid], want[valid]
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        return True
    finite = torch.isfinite(want)
    return not torch.allclose(got[finite], want[finite], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cross", [False, True])
def test_lagkv_golden_partitions_and_tail(seed, cross):
    """L = 23, lag = 4, sinks = 2: row 0 (23 valid) has 5 full partitions (4 scored; tail = the 5th
    plus 1 left over), row 1 (20 valid, 3 padding) has 4 (3 scored; tail = 4 + 2)."""
    keys, values, mask = _setup(seed)
    scorer = LagKV(lag=4, sinks=2, cross_scoring=cross)
    got = scorer.score(_obs(keys, values, mask))
    want = lagkv_by_hand(keys, values, mask, lag=4, sinks=2, cross=cross)
    _assert_valid_close(got, want, mask)
    assert (got[0, :, -5:] == TAIL).all() and (got[0, :, 2:18] < 1).all() and torch.isinf(got[0, :, :2]).all()
    assert (got[1, :, -6:] == TAIL).all() and (got[1, :, 5:17] <= 1).all()
    assert torch.isinf(got[1, :, 3:5]).all()  # row 1's sinks sit after its padding
    # each removed factor changes the scores (so this test would fail without it)
    for ablation in ({"use_values": False}, {"normalise": False}, {"softmax": False}):
        if ablation == {"softmax": False} and cross:
            continue  # the raw spreads differ in scale anyway
        assert _differs(got, lagkv_by_hand(keys, values, mask, 4, 2, cross=cross, **ablation), mask), ablation


def test_lagkv_rank_scores_are_a_permutation_per_partition():
    keys, values, mask = _setup(5, pads=(0, 0))
    got = LagKV(lag=4, sinks=2).score(_obs(keys, values, mask))
    parts = got[..., 2:18].reshape(2, 2, 4, 4)
    assert torch.equal(parts.sort(-1).values, torch.tensor([0.0, 0.25, 0.5, 0.75]).expand_as(parts))


@pytest.mark.parametrize("seed", [0, 3])
def test_lagkv_short_context_keeps_sinks_then_recency(seed):
    """Fewer than sinks + 2 * lag valid tokens: no partition has a reference (the paper does not
    compress); kvpress's fallback: sinks, then recency ``(i - sinks) / (n - sinks)``. Row 0 (23
    valid, lag 10, sinks 2: 22 needed) is long, row 1 (20 valid) short, in the same batch."""
    keys, values, mask = _setup(seed)
    got = LagKV(lag=10, sinks=2).score(_obs(keys, values, mask))
    want = lagkv_by_hand(keys, values, mask, lag=10, sinks=2)
    _assert_valid_close(got, want, mask)
    row1 = got[1, 0, 3:]
    assert torch.isinf(row1[:2]).all()
    assert torch.allclose(row1[2:], torch.arange(18) / 18.0)
    assert (got[0, :, 12:] == TAIL).all() and (got[0, :, 2:12] < 1).all()
    # everything short: context shorter than the sinks
    short = LagKV(lag=4, sinks=30).score(_obs(keys, values, mask))
    assert torch.isinf(short[mask[:, None, :].expand_as(short)]).all()


@pytest.mark.parametrize("cross", [False, True])
def test_lagkv_budget_below_sinks_plus_tail_keeps_the_sinks(cross):
    """L = 40, lag = 8, sinks = 4: 4 full partitions, tail = 8 + 4 = 12 tokens, 16 always-kept.
    With a budget of 10, every head keeps the 4 sinks and the 6 most recent tokens (found at
    r = 0.75 on 1k tokens: a tie among all 16 used to go to the more recent ones, dropping sinks)."""
    keys, values, mask = _setup(2, B=1, L=40, D=4, pads=(0,))
    pipe = Pipeline(scorer=LagKV(lag=8, sinks=4, cross_scoring=cross), budget=10)
    keep = pipe.select(_obs(keys, values, mask))
    want = torch.zeros(40, dtype=torch.bool)
    want[:4] = True
    want[-6:] = True
    assert torch.equal(keep[0], want.expand(2, 40))


def test_lagkv_flat_reference_channel_gives_numbers():
    """A reference channel with max == min (kvpress divides by zero) contributes 0, never NaN."""
    keys, values, mask = _setup(4, pads=(0, 0))
    keys[..., 1] = 1.0
    values[:, :, :, :] = 0.5
    got = LagKV(lag=4, sinks=2, cross_scoring=True).score(_obs(keys, values, mask))
    assert not torch.isnan(got).any()
    one_channel = LagKV(lag=4, sinks=2).score(_obs(keys[..., :1], values[..., :1], mask))
    assert not torch.isnan(one_channel).any()


# ----------------------------------------------------------------------------- KeyDiff by hand


def keydiff_by_hand(keys, key_mask, normalise=True):
    B, H, L, D = keys.shape
    out = torch.zeros(B, H, L, dtype=torch.float64)
    for b in range(B):
        pos = [i for i in range(L) if key_mask[b, i]]
        for h in range(H):
            K = keys[b, h].double().tolist()
            anchor = [0.0] * D
            for i in pos:
                norm = math.sqrt(sum(x * x for x in K[i])) if normalise else 1.0
                for c in range(D):
                    anchor[c] += K[i][c] / norm / len(pos)
            a_norm = math.sqrt(sum(x * x for x in anchor))
            for i in pos:
                k_norm = math.sqrt(sum(x * x for x in K[i]))
                out[b, h, i] = -sum(x * y for x, y in zip(K[i], anchor)) / (k_norm * a_norm)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_keydiff_golden_negative_cosine_to_the_mean_unit_key(seed):
    keys, values, mask = _setup(seed, D=4)
    keys = keys + torch.linspace(0, 3, 23)[:, None]  # keys of different norms, so normalising matters
    got = KeyDiff().score(_obs(keys, values, mask))
    want = keydiff_by_hand(keys, mask)
    _assert_valid_close(got, want, mask)
    assert _differs(got, keydiff_by_hand(keys, mask, normalise=False), mask)


# ----------------------------------------------------------------------------- composition and the model


@pytest.mark.parametrize("scorer", [LagKV(lag=4, sinks=2), LagKV(lag=4, sinks=2, cross_scoring=True), KeyDiff()])
def test_ada_totals_are_exact(scorer):
    keys, values, mask = _setup(7, H=4)
    pipe = Pipeline(scorer=scorer, allocator=AdaHead(alpha=0.2), compression_ratio=0.5)
    counts = pipe.select(_obs(keys, values, mask)).sum(-1)
    budget = pipe.average_budget(mask.sum(-1))
    assert torch.equal(counts.sum(-1), 4 * budget)
    assert (counts <= mask.sum(-1)[:, None]).all()


def _generate(model, press, ids, mask):
    with press(model):
        return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                              output_scores=True, return_dict_in_generate=True)


@pytest.mark.parametrize("name,overrides", [
    ("lagkv", {}), ("ada_lagkv", {}), ("keydiff", {}),
    ("lagkv", {"scorer": LagKV(lag=8, sinks=2)}),  # partitions in play on the tiny contexts
    ("ada_lagkv", {"scorer": LagKV(lag=8, sinks=2, cross_scoring=True)}),
])
def test_presets_ragged_equals_mask_and_batch_equals_rows(llama, name, overrides):
    ids, mask = left_padded_batch(seed=1)
    topk = _generate(llama, preset(name, compression_ratio=0.6, **overrides), ids, mask)
    masked = _generate(llama, preset(name, compression_ratio=0.6, evictor=Mask(), **overrides), ids, mask)
    assert torch.equal(topk.sequences, masked.sequences)
    for a, b in zip(topk.scores, masked.scores):
        assert torch.allclose(a, b, atol=1e-4, rtol=0)
    L = ids.shape[1]
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        alone = _generate(llama, preset(name, compression_ratio=0.6, **overrides), ids[b:b + 1, L - n:],
                          mask[b:b + 1, L - n:])
        assert torch.equal(alone.sequences[0, n:], topk.sequences[b, L:])


# ----------------------------------------------------------------------------- NVIDIA kvpress, when importable


def test_scores_agree_with_kvpress():
    """Same tensors (one unpadded row, as kvpress runs): LagKVPress's scores equal ours where ours
    are below ``TAIL`` and are 1 where ours are +inf or ``TAIL`` (its "always keep"); KeyDiffPress's
    equal ours."""
    press_mod = pytest.importorskip("kvpress")
    keys, values, mask = _setup(11, B=1, L=40, D=8, pads=(0,))
    for lag, sinks, cross in ((4, 2, False), (4, 2, True), (8, 4, False), (30, 4, False)):
        ours = LagKV(lag=lag, sinks=sinks, cross_scoring=cross).score(_obs(keys, values, mask))
        theirs = press_mod.LagKVPress(n_sink=sinks, lag_size=lag, cross_scoring=cross).score(
            None, None, keys, values, None, {}).float()
        scored = ours < TAIL
        assert torch.allclose(ours[scored], theirs[scored], rtol=RTOL, atol=ATOL)
        assert (theirs[~scored] == 1).all()
    ours = KeyDiff().score(_obs(keys, values, mask))
    theirs = press_mod.KeyDiffPress().score(None, None, keys, values, None, {}).float()
    assert torch.allclose(ours, theirs, rtol=RTOL, atol=ATOL)


def test_ada_moves_budget_only_with_cross_scoring():
    """Rank scores are the same multiset in every head: Ada stays within a partition count of
    uniform. The softmax shares (``ada_lagkv``) differ per head, so Ada moves budget."""
    keys, values, mask = _setup(8, B=1, H=4, L=60, pads=(0,))
    keys = keys * torch.tensor([0.2, 1.0, 3.0, 8.0])[None, :, None, None] ** torch.linspace(0, 2, 60)[:, None]
    counts = {}
    for cross in (False, True):
        pipe = Pipeline(scorer=LagKV(lag=4, sinks=2, cross_scoring=cross), allocator=AdaHead(alpha=0.2),
                        compression_ratio=0.5)
        counts[cross] = pipe.select(_obs(keys, values, mask)).sum(-1)[0]
    n_scored_partitions = (60 - 2) // 4 - 1
    assert (counts[False] - 30).abs().max() <= n_scored_partitions
    assert counts[True].max() - counts[True].min() > 0
