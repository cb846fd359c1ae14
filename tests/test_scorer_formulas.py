"""Golden tests: every scorer against its paper's formula, recomputed independently with explicit
Python loops (``math.exp`` softmax, pooling, ``W_o`` projection and the Gaussian expectation written
out) on tiny tensors, with left padding in the batch. Comparing two evictors on the same scores
cannot catch a wrong formula; these can (each was checked to fail when its key factor is removed).
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import (
    TOVA,
    CriticalKV,
    ExpectedAttention,
    KNorm,
    Observation,
    ObservedAttention,
    RandomScorer,
    SnapKV,
    StreamingLLM,
)

INF = float("inf")
RTOL, ATOL = 1e-4, 1e-6


def _inv_freq(D, base=10000.0):
    return [1.0 / base ** (2 * i / D) for i in range(D // 2)]


def _setup(seed, B=2, Hkv=2, G=2, L=12, D=4, pads=(0, 3), hidden=6):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, Hkv, L, D, generator=g)
    values = torch.randn(B, Hkv, L, D, generator=g)
    queries = torch.randn(B, Hkv * G, L, D, generator=g)
    key_mask = torch.ones(B, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        key_mask[b, :p] = False
    w_o = torch.randn(hidden, Hkv * G * D, generator=g)
    return keys, values, queries, key_mask, w_o


def _obs(setup, w):
    keys, values, queries, key_mask, w_o = setup
    L, D = keys.shape[2], keys.shape[3]
    w = L if w is None else min(w, L)
    return Observation(keys=keys, values=values, queries=queries[:, :, L - w:], key_mask=key_mask, layer_idx=1,
                       n_layers=2, scaling=D**-0.5, output_weight=w_o, rope_inv_freq=torch.tensor(_inv_freq(D)))


def _dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def _softmax(logits):
    """``logits``: dict position -> logit (only the visible keys)."""
    top = max(logits.values())
    e = {j: math.exp(v - top) for j, v in logits.items()}
    total = sum(e.values())
    return {j: v / total for j, v in e.items()}


def _attention_row(q, K, valid, i, scaling):
    """Softmax of query at position ``i`` over the valid keys ``j <= i`` (dict j -> probability)."""
    return _softmax({j: _dot(q, K[j]) * scaling for j in range(i + 1) if valid[j]})


def _window_attention(setup, b, hq, w, scaling):
    """Mean attention of the last ``w`` (valid) queries of query head ``hq``: list over positions."""
    keys, _, queries, key_mask, _ = setup
    G = queries.shape[1] // keys.shape[1]
    K = keys[b, hq // G].double().tolist()
    Q = queries[b, hq].double().tolist()
    valid = key_mask[b].tolist()
    L = len(valid)
    out = [0.0] * L
    used = [i for i in range(L - w, L) if valid[i]]
    for i in used:
        for j, p in _attention_row(Q[i], K, valid, i, scaling).items():
            out[j] += p / len(used)
    return out


def _pool(row, valid, kernel):
    """SnapKV's 1-D average pooling (odd kernel, centred) over the valid neighbours of each token."""
    L, r = len(row), kernel // 2
    out = [0.0] * L
    for j in range(L):
        if valid[j]:
            window = [row[t] for t in range(j - r, j + r + 1) if 0 <= t < L and valid[t]]
            out[j] = sum(window) / len(window)
    return out


def _compare(actual, expected, key_mask):
    """``expected``: nested list [B][H][L] (None on padding, which is not compared)."""
    for b, rows in enumerate(expected):
        for h, row in enumerate(rows):
            for j, e in enumerate(row):
                if not key_mask[b, j]:
                    continue
                a = float(actual[b, h, j])
                if e == INF:
                    assert a == INF, (b, h, j, a)
                else:
                    assert math.isfinite(a) and abs(a - e) <= ATOL + RTOL * abs(e), (b, h, j, a, e)


SEEDS = settings(max_examples=6, deadline=None)


@SEEDS
@given(st.integers(0, 10_000), st.integers(1, 6), st.sampled_from([1, 3, 5]))
def test_snapkv_formula(seed, window, kernel):
    """SnapKV (Li et al., 2024): window-averaged attention, pooled, averaged over the query group;
    the window itself kept."""
    setup = _setup(seed)
    keys, _, queries, key_mask, _ = setup
    B, Hkv, L, D = keys.shape
    G = queries.shape[1] // Hkv
    expected = []
    for b in range(B):
        valid = key_mask[b].tolist()
        rows = []
        for h in range(Hkv):
            per_group = [_pool(_window_attention(setup, b, h * G + g, window, D**-0.5), valid, kernel)
                         for g in range(G)]
            row = [sum(p[j] for p in per_group) / G for j in range(L)]
            rows.append([INF if j >= L - window else row[j] for j in range(L)])
        expected.append(rows)
    _compare(SnapKV(window=window, kernel=kernel).score(_obs(setup, window)), expected, key_mask)


@SEEDS
@given(st.integers(0, 10_000), st.integers(1, 6), st.sampled_from([1, 3]))
def test_criticalkv_formula(seed, window, kernel):
    """CriticalKV (Feng et al., 2025): each query head's window attention times ``||W_o^h v_j||_1``
    (the value projected through that head's slice of the output matrix), pooled, group-averaged."""
    setup = _setup(seed)
    keys, values, queries, key_mask, w_o = setup
    B, Hkv, L, D = keys.shape
    G = queries.shape[1] // Hkv
    W = w_o.double().tolist()
    expected = []
    for b in range(B):
        valid = key_mask[b].tolist()
        rows = []
        for h in range(Hkv):
            V = values[b, h].double().tolist()
            per_group = []
            for g in range(G):
                hq = h * G + g
                attn = _window_attention(setup, b, hq, window, D**-0.5)
                weight = [sum(abs(sum(W[o][hq * D + d] * V[j][d] for d in range(D))) for o in range(len(W)))
                          for j in range(L)]
                per_group.append(_pool([attn[j] * weight[j] for j in range(L)], valid, kernel))
            row = [sum(p[j] for p in per_group) / G for j in range(L)]
            rows.append([INF if j >= L - window else row[j] for j in range(L)])
        expected.append(rows)
    _compare(CriticalKV(window=window, kernel=kernel).score(_obs(setup, window)), expected, key_mask)


@SEEDS
@given(st.integers(0, 10_000), st.integers(0, 3), st.integers(1, 5))
def test_h2o_formula(seed, recent, chunk):
    """H2O (Zhang et al., 2023): attention each key accumulates over every (valid) prefill query,
    averaged over the query group; the ``recent`` last tokens kept."""
    setup = _setup(seed)
    keys, _, queries, key_mask, _ = setup
    B, Hkv, L, D = keys.shape
    G = queries.shape[1] // Hkv
    expected = []
    for b in range(B):
        valid = key_mask[b].tolist()
        rows = []
        for h in range(Hkv):
            K = keys[b, h].double().tolist()
            row = [0.0] * L
            for g in range(G):
                Q = queries[b, h * G + g].double().tolist()
                for i in range(L):
                    if valid[i]:
                        for j, p in _attention_row(Q[i], K, valid, i, D**-0.5).items():
                            row[j] += p / G
            rows.append([INF if j >= L - recent else row[j] for j in range(L)])
        expected.append(rows)
    _compare(ObservedAttention(recent=recent, chunk=chunk).score(_obs(setup, None)), expected, key_mask)


@SEEDS
@given(st.integers(0, 10_000))
def test_tova_formula(seed):
    """TOVA (Oren et al., 2024): attention of the last query, averaged over the query group."""
    setup = _setup(seed)
    keys, _, queries, key_mask, _ = setup
    B, Hkv, L, D = keys.shape
    G = queries.shape[1] // Hkv
    expected = []
    for b in range(B):
        valid = key_mask[b].tolist()
        rows = []
        for h in range(Hkv):
            K = keys[b, h].double().tolist()
            row = [0.0] * L
            for g in range(G):
                q = queries[b, h * G + g, L - 1].double().tolist()
                for j, p in _attention_row(q, K, valid, L - 1, D**-0.5).items():
                    row[j] += p / G
            rows.append(row)
        expected.append(rows)
    _compare(TOVA().score(_obs(setup, 1)), expected, key_mask)


@SEEDS
@given(st.integers(0, 10_000))
def test_knorm_formula(seed):
    """KNorm (Devoto et al., 2024): minus the L2 norm of each key."""
    setup = _setup(seed)
    keys, _, _, key_mask, _ = setup
    expected = [[[-math.sqrt(sum(x * x for x in k)) for k in keys[b, h].double().tolist()]
                 for h in range(keys.shape[1])] for b in range(keys.shape[0])]
    _compare(KNorm().score(_obs(setup, 0)), expected, key_mask)


def _rope(x, angles):
    """Half-split RoPE rotation of vector ``x`` by one angle per frequency."""
    half = len(x) // 2
    out = [0.0] * len(x)
    for i, a in enumerate(angles):
        c, s = math.cos(a), math.sin(a)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([2, 5, None]), st.integers(1, 6), st.integers(0, 2),
       st.booleans(), st.booleans())
def test_expected_attention_formula(seed, window, n_future, sinks, use_covariance, use_vnorm):
    """Expected Attention (Devoto et al., 2025), as its docstring states: the (valid) window queries,
    each rotated to the next ``n_future`` positions after the context and averaged over them, give a
    Gaussian (mean ``mu``, covariance ``Sigma`` with ``n - 1``); ``logit_j = s mu.k_j + s^2/2 k_j^T Sigma k_j``,
    softmax over the valid keys, averaged over the query group, times ``||v_j||``; first ``sinks`` kept."""
    setup = _setup(seed)
    keys, values, queries, key_mask, _ = setup
    B, Hkv, L, D = keys.shape
    G = queries.shape[1] // Hkv
    s = D**-0.5
    inv = _inv_freq(D)
    w = L if window is None else min(window, L)
    expected = []
    for b in range(B):
        valid = key_mask[b].tolist()
        rows = []
        for h in range(Hkv):
            K = keys[b, h].double().tolist()
            V = values[b, h].double().tolist()
            row = [0.0] * L
            for g in range(G):
                Q = queries[b, h * G + g].double().tolist()
                future = []
                for i in range(L - w, L):
                    if not valid[i]:
                        continue
                    rotated = [0.0] * D
                    for p in range(L, L + n_future):  # a query at position i moved to future position p
                        r = _rope(Q[i], [(p - i) * f for f in inv])
                        rotated = [a + c / n_future for a, c in zip(rotated, r)]
                    future.append(rotated)
                n = len(future)
                mu = [sum(q[d] for q in future) / n for d in range(D)]
                cov = [[sum((q[d] - mu[d]) * (q[e] - mu[e]) for q in future) / max(n - 1, 1) for e in range(D)]
                       for d in range(D)]
                logits = {}
                for j in range(L):
                    if valid[j]:
                        logits[j] = s * _dot(mu, K[j])
                        if use_covariance:
                            logits[j] += 0.5 * s * s * sum(K[j][d] * cov[d][e] * K[j][e]
                                                           for d in range(D) for e in range(D))
                for j, p in _softmax(logits).items():
                    row[j] += p / G
            if use_vnorm:
                row = [row[j] * math.sqrt(sum(x * x for x in V[j])) for j in range(L)]
            first = [j for j in range(L) if valid[j]][:sinks]
            rows.append([INF if j in first else row[j] for j in range(L)])
        expected.append(rows)
    scorer = ExpectedAttention(window=window, n_future=n_future, sinks=sinks, use_covariance=use_covariance,
                               use_vnorm=use_vnorm)
    _compare(scorer.score(_obs(setup, window)), expected, key_mask)


@SEEDS
@given(st.integers(0, 10_000), st.integers(0, 4))
def test_streamingllm_formula(seed, sinks):
    """StreamingLLM (Xiao et al., 2024): the first ``sinks`` valid tokens, then recency."""
    setup = _setup(seed, pads=(0, 5))
    key_mask = setup[3]
    expected = []
    for b in range(key_mask.shape[0]):
        valid = key_mask[b].tolist()
        order = [j for j in range(len(valid)) if valid[j]]
        row = [None] * len(valid)
        for rank, j in enumerate(order):
            row[j] = INF if rank < sinks else float(rank)
        expected.append([row] * setup[0].shape[1])
    _compare(StreamingLLM(sinks=sinks).score(_obs(setup, 0)), expected, key_mask)


def test_random_is_deterministic_uniform_and_padding_free():
    """Random: a fixed function of (seed, layer, head, valid index); uniform-looking in [0, 1)."""
    setup = _setup(0, B=2, L=400, pads=(0, 150))
    obs = _obs(setup, 0)
    a, again = RandomScorer(seed=3).score(obs), RandomScorer(seed=3).score(obs)
    assert torch.equal(a, again)
    assert not torch.equal(a, RandomScorer(seed=4).score(obs))
    other_layer = Observation(**{**obs.__dict__, "layer_idx": 0})
    assert not torch.equal(a, RandomScorer(seed=3).score(other_layer))
    assert not torch.equal(a[0, 0], a[0, 1])  # heads differ
    assert torch.equal(a[1, :, 150:], a[0, :, :250])  # the same valid index, whatever the padding
    valid = a[0]
    assert bool((valid >= 0).all() and (valid < 1).all())
    assert abs(float(valid.mean()) - 0.5) < 0.05 and len(valid.unique()) > 0.99 * valid.numel()
    counts = torch.histc(valid, bins=10, min=0.0, max=1.0)
    assert bool((counts > 0.5 * valid.numel() / 10).all())
