"""Invariants of layer schedules and head allocators (hypothesis properties)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import AdaHead, PyramidLayer, UniformHead, UniformLayer
from kvpress_ada.allocators.heads import flat_topk_counts, head_shares
from kvpress_ada.evictors import topk_mask

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def layer_scores(draw, distinct=False):
    B = draw(st.integers(1, 3))
    H = draw(st.integers(1, 6))
    L = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if distinct:
        scores = torch.randperm(B * H * L, generator=g).float().view(B, H, L) / (B * H * L)
    else:
        scores = (torch.rand(B, H, L, generator=g) * draw(st.sampled_from([1.0, 1e-3, 100.0])))
        if draw(st.booleans()):
            scores = scores.round(decimals=1)  # many ties
    budget = torch.tensor([draw(st.integers(1, L)) for _ in range(B)])
    return scores, budget


@SETTINGS
@given(layer_scores(), st.floats(0, 1), st.booleans())
def test_ada_budgets_sum_exactly_and_fit(data, alpha, comparable):
    scores, budget = data
    H, L = scores.shape[1:]
    counts = AdaHead(alpha=alpha).allocate(scores, budget, comparable=comparable)
    assert torch.equal(counts.sum(-1), H * budget)
    assert int(counts.max()) <= L and int(counts.min()) >= 0
    safeguard = torch.floor(alpha * budget.double() + 1e-9).long()
    assert bool((counts >= safeguard[:, None]).all())


@SETTINGS
@given(layer_scores())
def test_ada_alpha_one_is_uniform(data):
    scores, budget = data
    ada = AdaHead(alpha=1.0).allocate(scores, budget)
    uni = UniformHead().allocate(scores, budget)
    assert torch.equal(ada, uni)
    assert torch.equal(topk_mask(scores, ada), topk_mask(scores, uni))


@SETTINGS
@given(layer_scores(distinct=True), st.floats(0, 1), st.integers(0, 2**31 - 1))
def test_ada_equivariant_to_head_permutation(data, alpha, seed):
    scores, budget = data
    H = scores.shape[1]
    perm = torch.randperm(H, generator=torch.Generator().manual_seed(seed))
    counts = AdaHead(alpha=alpha).allocate(scores, budget)
    permuted = AdaHead(alpha=alpha).allocate(scores[:, perm], budget)
    # the multiset is always the same; heads whose adaptive share is unique map exactly
    assert torch.equal(permuted.sort(-1).values, counts[:, perm].sort(-1).values)
    n = flat_topk_counts(scores, H * budget)
    for b in range(scores.shape[0]):
        if len(set(n[b].tolist())) == H:
            assert torch.equal(permuted[b], counts[b, perm])


@SETTINGS
@given(layer_scores(distinct=True), st.floats(0, 1), st.floats(1e-3, 1e3))
def test_ada_invariant_to_positive_scaling(data, alpha, factor):
    scores, budget = data
    a = AdaHead(alpha=alpha).allocate(scores, budget)
    b = AdaHead(alpha=alpha).allocate(scores * factor, budget)
    assert torch.equal(a, b)


@SETTINGS
@given(layer_scores(distinct=True), st.floats(0, 0.99))
def test_scale_free_comparison_ignores_per_head_scales(data, alpha):
    """With comparable=False, multiplying one head's scores by a constant changes nothing."""
    scores, budget = data
    scaled = scores.clone()
    scaled[:, 0] *= 1000.0
    a = AdaHead(alpha=alpha).allocate(scores, budget, comparable=False)
    b = AdaHead(alpha=alpha).allocate(scaled, budget, comparable=False)
    assert torch.equal(a, b)


def test_ada_follows_concentration():
    """A head whose attention mass is concentrated needs fewer tokens than a flat one."""
    L = 100
    peaked = torch.zeros(L)
    peaked[:5] = 1.0
    flat = torch.full((L,), 0.05)
    scores = torch.stack([peaked / peaked.sum(), flat / flat.sum()])[None]
    counts = AdaHead(alpha=0.0).allocate(scores, torch.tensor([20]))
    assert counts[0, 0] < counts[0, 1]
    assert int(counts.sum()) == 40


def test_head_shares_keep_protected_and_padding():
    s = torch.tensor([[[float("-inf"), 1.0, 3.0, float("inf")]]])
    shares = head_shares(s)
    assert shares[0, 0, 0] == float("-inf") and shares[0, 0, 3] == float("inf")
    assert torch.allclose(shares[0, 0, 1:3], torch.tensor([0.0, 1.0]))


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 40), st.floats(1.5, 50), st.integers(1, 3000), st.data())
def test_pyramid_schedule(B, n_layers, beta, max_len, data):
    lengths = torch.tensor([data.draw(st.integers(1, max_len)) for _ in range(B)])
    avg = torch.tensor([data.draw(st.integers(1, int(n))) for n in lengths])
    budgets = PyramidLayer(beta=beta).budgets(avg, n_layers, lengths)
    assert budgets.shape == (B, n_layers)
    assert bool((budgets <= lengths[:, None]).all()) and bool((budgets >= 0).all())
    assert torch.equal(budgets.sum(-1), avg * n_layers)  # mean over layers equals the budget
    if n_layers > 1 and bool((budgets < lengths[:, None]).all()):
        assert bool((budgets[:, 0] >= budgets[:, -1]).all())  # decreasing with depth


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 40), st.integers(1, 3000), st.data())
def test_uniform_layer_schedule(B, n_layers, max_len, data):
    lengths = torch.tensor([data.draw(st.integers(1, max_len)) for _ in range(B)])
    avg = torch.tensor([data.draw(st.integers(1, int(n))) for n in lengths])
    budgets = UniformLayer().budgets(avg, n_layers, lengths)
    assert torch.equal(budgets, avg[:, None].expand(B, n_layers))


def test_pyramid_matches_paper_shape():
    """Without clipping: linear from 2b - b/beta down to b/beta (PyramidKV)."""
    b, beta, n = 100, 20.0, 11
    budgets = PyramidLayer(beta=beta).budgets(torch.tensor([b]), n, torch.tensor([10_000]))[0]
    expected = torch.linspace(2 * b - b / beta, b / beta, n)
    assert (budgets.double() - expected.double()).abs().max() <= 1.0
    assert math.isclose(float(budgets.double().mean()), b)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 4), L=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_fit_to_valid_totals_caps_and_best_entries(B, H, L, seed):
    """Every head's count fits its valid entries, the row total is min(asked, valid), and the excess
    goes to the best-scored valid entries the other heads had not selected."""
    from kvpress_ada.allocators.heads import fit_to_valid
    from kvpress_ada.evictors import topk_mask

    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(B, H, L, generator=g) > 0.4
    scores = torch.randn(B, H, L, generator=g).masked_fill(~valid, float("-inf"))  # padding, as callers pass it
    counts = torch.randint(0, L + 3, (B, H), generator=g)
    fitted = fit_to_valid(scores, counts, valid, topk_mask)
    cap = valid.sum(-1)
    assert bool((fitted <= cap).all()) and bool((fitted >= torch.minimum(counts, cap)).all())
    assert fitted.sum(-1).tolist() == torch.minimum(counts.sum(-1), cap.sum(-1)).tolist()
    # the extra entries are the best of what was left: written out per row
    clipped = torch.minimum(counts, cap)
    chosen = topk_mask(scores, clipped)
    for b in range(B):
        extra = int(fitted[b].sum() - clipped[b].sum())
        left = scores[b][valid[b] & ~chosen[b]]
        if extra:
            threshold = left.sort(descending=True).values[extra - 1]
            granted = topk_mask(scores[b:b + 1], fitted[b:b + 1])[0] & ~chosen[b] & valid[b]
            assert int(granted.sum()) == extra and bool((scores[b][granted] >= threshold).all())


@pytest.mark.parametrize("value", [0.5, float("inf")])
def test_ada_splits_ties_spanning_heads_fairly(value):
    """All-equal (or all-protected) scores carry no preference between heads: each keeps its share."""
    scores = torch.full((2, 4, 50), value)
    scores[1, :, :10] = float("-inf")  # left padding of the second row
    counts = AdaHead(alpha=0.0).allocate(scores, torch.tensor([26, 26]), comparable=True)
    assert counts.sum(-1).tolist() == [104, 104]
    assert (counts.amax(-1) - counts.amin(-1)).tolist() == [0, 0]
    assert flat_topk_counts(scores, torch.tensor([6, 7])).tolist() == [[2, 2, 1, 1], [2, 2, 2, 1]]


def test_a_scorer_editing_its_observation_in_place_is_refused():
    from conftest import build_model

    from kvpress_ada import Pipeline, SnapKV

    class Vandal(SnapKV):
        def score(self, obs):
            obs.keys.zero_()
            return super().score(obs)

    model = build_model("llama")
    ids = torch.randint(4, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Pipeline(scorer=Vandal(window=4), compression_ratio=0.5)(model):
        with pytest.raises(RuntimeError, match="Vandal modified its observation's keys"):
            model(input_ids=ids, use_cache=True)
