"""Left padding never changes a scorer's numbers: a padded batch row gets exactly the scores of that
row run alone (on its valid positions), for every registered scorer (drawn from the registry)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scorer_registry import scorer_names, scorer_strategy

from kvpress_ada import Observation, SnapKV, StreamingLLM
from kvpress_ada.scorers import SCORERS
from kvpress_ada.scorers.attention import pool_scores

D = 8


def _inv_freq(D, base=10000.0):
    return 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


def _n_queries(scorer, L):
    """What the pipeline hands a scorer: ``min(window, L)`` trailing queries (all for ``None``)."""
    w = scorer.query_window()
    return L if w is None else min(w, L)


def _observation(scorer, keys, values, queries, key_mask, w_o, layer_idx):
    L = keys.shape[2]
    w = _n_queries(scorer, L)
    return Observation(keys=keys, values=values, queries=queries[:, :, L - w:], key_mask=key_mask,
                       layer_idx=layer_idx, n_layers=4, scaling=D**-0.5, output_weight=w_o,
                       rope_inv_freq=_inv_freq(D),
                       # a model pass (KVzip) measures something per entry; its own padding-invariance is
                       # tested end to end (test_press_edge_cases, test_kvzip): here any per-token value will do
                       pass_scores=values.float().norm(dim=-1) if type(scorer).needs_model_pass else None,
                       # likewise what a hidden-state scorer gave each entry when its token arrived
                       entry_scores=values.float().sum(dim=-1) if type(scorer).reads_hidden_states else None)


def _rows(g, Hkv, G, n):
    return (torch.randn(1, Hkv, n, D, generator=g), torch.randn(1, Hkv, n, D, generator=g),
            torch.randn(1, Hkv * G, n, D, generator=g))


def _garbage(g, Hkv, G, pad):
    """What sits on padding: large values, so any leak into the valid scores shows."""
    k, v, q = _rows(g, Hkv, G, pad)
    return k * 30 + 7, v * 30 - 5, q * 30 + 3


def _pad_left(parts, garbage):
    return [torch.cat([x, y], dim=2) for x, y in zip(garbage, parts)]


def _assert_same(padded, alone):
    """Equal to float rounding: relative, and absolute at the scale of the row (z-scored scores near 0 are
    differences of O(1) terms, summed in another order over a padded batch)."""
    finite = torch.isfinite(alone)
    assert torch.equal(torch.isinf(padded), torch.isinf(alone)), "protected positions differ"
    scale = float(alone[finite].abs().max()) if bool(finite.any()) else 0.0
    assert torch.allclose(padded[finite], alone[finite], rtol=1e-5, atol=1e-6 * max(1.0, scale)), \
        (padded - alone).abs()[finite].max()


@pytest.mark.parametrize("name", scorer_names())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_padded_row_scores_equal_the_row_alone(name, data):
    if name == "qfilter":
        pytest.skip("scores with filters made for one model: its padded rows are in tests/test_key_statistics.py")
    if name == "expected_attention_stats":
        pytest.skip("scores with statistics made for one model: its padded rows are in "
                    "tests/test_expected_attention_stats.py")
    cls = SCORERS.get(name)
    scorer = data.draw(scorer_strategy(cls), label="scorer")
    need = max(scorer.min_context(), 1)
    n = data.draw(st.integers(need, need + 12), label="valid length")
    pad = data.draw(st.integers(1, 9), label="left padding")
    other = data.draw(st.integers(0, n + pad), label="valid length of the other row")
    other = max(other, need)
    Hkv, G = data.draw(st.integers(1, 2), label="kv heads"), data.draw(st.sampled_from([1, 2]), label="group")
    layer = data.draw(st.integers(0, 3), label="layer")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    w_o = torch.randn(16, Hkv * G * D, generator=g)

    row = _rows(g, Hkv, G, n)
    L = max(n + pad, other)
    first = _pad_left(row, _garbage(g, Hkv, G, L - n))
    second = _pad_left(_rows(g, Hkv, G, other), _garbage(g, Hkv, G, L - other))
    keys, values, queries = (torch.cat([a, b]) for a, b in zip(first, second))
    key_mask = torch.zeros(2, L, dtype=torch.bool)
    key_mask[0, L - n:] = True
    key_mask[1, L - other:] = True

    padded = scorer.score(_observation(scorer, keys, values, queries, key_mask, w_o, layer))
    alone = scorer.score(_observation(scorer, *row, torch.ones(1, n, dtype=torch.bool), w_o, layer))
    assert padded.shape == (2, Hkv, L) and alone.shape == (1, Hkv, n)
    _assert_same(padded[0, :, L - n:], alone[0])


def test_snapkv_pooling_ignores_padding_example():
    """The defect as reported: the first real tokens' pooled scores mixed with padding zeros."""
    scores = torch.tensor([[[0.0, 0.0, 0.3, 0.5, 0.2]]])
    mask = torch.tensor([[False, False, True, True, True]])
    pooled = pool_scores(scores, 3, mask)
    alone = pool_scores(scores[..., 2:], 3)
    assert torch.allclose(pooled[..., 2:], alone)
    assert abs(float(pooled[0, 0, 2]) - (0.3 + 0.5) / 2) < 1e-7  # valid neighbours only


def test_streamingllm_scores_rank_among_valid_tokens():
    keys = torch.zeros(1, 1, 6, D)
    mask = torch.tensor([[False, False, True, True, True, True]])
    obs = Observation(keys=keys, values=keys, queries=keys[:, :, :0], key_mask=mask, layer_idx=0, n_layers=1,
                      scaling=1.0)
    scores = StreamingLLM(sinks=1).score(obs)[0, 0, 2:]
    assert scores[0] == float("inf") and scores[1:].tolist() == [1.0, 2.0, 3.0]
    assert SnapKV().min_context() == 64


def test_window_attention_reads_only_the_observation():
    """Dead parameter removed: the window's queries come from ``obs`` alone."""
    import inspect

    from kvpress_ada.scorers.attention import window_attention

    assert list(inspect.signature(window_attention).parameters) == ["obs", "window"]
