"""Every layer schedule keeps a floor in every layer, as ``AdaLayer`` does: at least 1 entry per head
and the protected entries when they fit, with each row's total exact (no layer is ever emptied)."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from conftest import build_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import AdaHead, Pipeline, PyramidLayer, SnapKV, StreamingLLM, UniformHead, UniformLayer
from kvpress_ada.allocators.layers import LayerSchedule
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.scorers import SCORERS


class FrontLoaded(LayerSchedule):
    """A user schedule that gives the whole budget to the first layer."""

    name: Literal["front_loaded"] = "front_loaded"

    def budgets(self, avg, n_layers, lengths):
        out = torch.zeros(avg.shape[0], n_layers, dtype=torch.long)
        out[:, 0] = n_layers * torch.minimum(avg, lengths)
        return torch.minimum(out, lengths[:, None])


@settings(max_examples=150, deadline=None)
@given(B=st.integers(1, 3), n_layers=st.integers(1, 40), beta=st.floats(1.5, 50), max_len=st.integers(1, 600),
       data=st.data())
def test_pyramid_and_uniform_floor_with_exact_totals(B, n_layers, beta, max_len, data):
    lengths = torch.tensor([data.draw(st.integers(1, max_len)) for _ in range(B)])
    avg = torch.tensor([data.draw(st.integers(1, int(n))) for n in lengths])
    protected = data.draw(st.none() | st.lists(st.integers(0, 70), min_size=B, max_size=B).map(torch.tensor))
    need = torch.ones(B, dtype=torch.long) if protected is None else protected.clamp(min=1)
    floor = torch.minimum(need, avg)
    for schedule in (PyramidLayer(beta=beta), UniformLayer()):
        budgets = torch.stack([schedule.layer_budget(avg, i, n_layers, lengths, protected) for i in range(n_layers)], 1)
        assert torch.equal(budgets.sum(-1), n_layers * avg), schedule  # mean over layers equals the budget
        assert bool((budgets >= floor[:, None]).all()), (schedule, budgets, floor)
        assert bool((budgets <= lengths[:, None]).all())


def test_floor_leaves_budgets_it_does_not_touch_alone():
    avg, lengths = torch.tensor([100]), torch.tensor([10_000])
    assert torch.equal(PyramidLayer().floored_budgets(avg, 11, lengths, torch.tensor([4])),
                       PyramidLayer().budgets(avg, 11, lengths))


def test_a_user_schedule_gets_the_floor_too():
    budgets = FrontLoaded().floored_budgets(torch.tensor([6]), 4, torch.tensor([50]), torch.tensor([2]))
    assert budgets.sum() == 24 and bool((budgets >= 2).all())


@pytest.mark.parametrize("scorer, budget, floor", [(SnapKV(window=4, kernel=3), 1, 1),  # floor 1 per head
                                                   (SnapKV(window=4, kernel=3), 6, 4),  # the window fits
                                                   (StreamingLLM(sinks=3), 5, 3)])  # the sinks fit
def test_pyramid_never_empties_a_layer(scorer, budget, floor):
    model = build_model("llama", num_hidden_layers=4)
    press = Pipeline(scorer=scorer, allocator=UniformHead(), layers=PyramidLayer(), budget=budget)
    ids = torch.randint(5, 100, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), press(model):
        cache = output_cache(model(input_ids=ids))
    kept = torch.stack([cache.head_lengths(i) for i in range(4)])  # [layers, B, H]
    assert bool((kept >= floor).all()), kept[..., 0]
    assert torch.equal(kept.sum((0, 2)), torch.full((2,), 4 * 2 * budget))  # exact totals


@pytest.mark.parametrize("name", sorted(SCORERS.names()))
def test_declared_protected_count_is_what_the_scores_protect(name):
    """``Scorer.protected`` (what the floor reads) equals the ``+inf`` entries of every head."""
    from test_scorer_padding import _observation, _rows

    if name == "qfilter":
        pytest.skip("Q-filters are one model's: their scores are checked in tests/test_key_statistics.py")
    if name == "expected_attention_stats":
        pytest.skip("query statistics are one model's: their protected sinks are checked in "
                    "tests/test_expected_attention_stats.py")
    scorer = SCORERS.build(name)
    n = max(scorer.min_context(), 1) + 70
    g = torch.Generator().manual_seed(0)
    keys, values, queries = _rows(g, 2, 2, n)
    obs = _observation(scorer, keys, values, queries, torch.ones(1, n, dtype=torch.bool), torch.randn(16, 64), 1)
    scores = scorer.score(obs)
    protected = torch.isposinf(scores).sum(-1)
    declared = scorer.protected(torch.tensor([n]))[:, None].expand(1, 2)
    if name == "composed":  # its last stage protects only what the earlier stages kept of what it would protect:
        # the declaration is an upper bound (a floor that reserves a little more than needed, never less)
        assert bool((protected <= declared).all()) and bool((protected > 0).all())
    else:
        assert torch.equal(protected, declared)


def test_chunked_prefill_floors_like_one_shot():
    """The floor comes from the scorer's declaration, so chunked prefill (budgets fixed before any
    score) and the one-shot press give every layer the same budget."""
    model = build_model("llama")
    ids = torch.randint(5, 100, (1, 20), generator=torch.Generator().manual_seed(3))
    press = Pipeline(scorer=SnapKV(window=4, kernel=3), allocator=AdaHead(alpha=0.0), layers=PyramidLayer(), budget=2,
                     prefill_chunk=3)
    kept = []
    for p in (press, press.model_copy(update={"prefill_chunk": None})):
        with torch.no_grad(), p(model):
            cache = output_cache(model(input_ids=ids))
        kept.append([int(cache.head_lengths(i).sum()) for i in range(3)])
    assert kept[0] == kept[1] == [4, 4, 4]  # window 4 > budget 2: every layer keeps the uniform 2 per head
