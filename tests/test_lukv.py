"""LU-KV: the offline profile (oracle importance, utility curves, concave envelopes, greedy allocation) against
their definitions, the keep curve of a calibration file, and the calibrated budgets read off it."""

import itertools
import math

import pytest
import torch
from conftest import _COMMON, build_model, build_tokenizer, default_model_config
from transformers import LlamaConfig

from kvpress_ada import Calibrated, CalibratedLayer, Pipeline, StreamingLLM, preset
from kvpress_ada import calibration as cal
from kvpress_ada.allocators.calibrated import interpolate
from kvpress_ada.harness.lukv import (
    envelope_gains,
    greedy_counts,
    keep_fractions,
    oracle_importance,
    profile_lukv,
    utility_curves,
)
from kvpress_ada.hosts.transformers.hf import output_cache


def test_oracle_importance_is_the_later_tokens_attention_written_out():
    g = torch.Generator().manual_seed(0)
    Hkv, G, T, D, context = 2, 2, 7, 3, 4
    queries = torch.randn(1, Hkv * G, T, D, generator=g)
    keys = torch.randn(1, Hkv, T, D, generator=g)
    got = oracle_importance(queries, keys, context, 0.8)
    for h in range(Hkv):
        for i in range(context):
            want = 0.0
            for gq in range(G):
                for t in range(context, T):
                    logits = [float(queries[0, h * G + gq, t] @ keys[0, h, s]) * 0.8 for s in range(t + 1)]
                    z = sum(math.exp(v) for v in logits)
                    want += math.exp(logits[i]) / z / G
            assert abs(float(got[h, i]) - want) < 1e-5


def test_utility_curve_follows_the_scorers_ranking():
    oracle = torch.tensor([[0.1, 0.5, 0.2, 0.0]])
    scores = torch.tensor([[3.0, 1.0, float("inf"), 2.0]])  # ranking: 2, 0, 3, 1
    assert utility_curves(oracle, scores)[0].tolist() == pytest.approx([0.0, 0.2, 0.3, 0.3, 0.8])


def test_envelope_gains_are_the_upper_concave_hull():
    curve = torch.tensor([0.0, 0.0, 3.0, 3.5, 4.0, 4.0])
    # hull (0, 0) - (2, 3) - (4, 4) - (5, 4): unit gains 1.5, 1.5, 0.5, 0.5, 0
    assert envelope_gains(curve).tolist() == pytest.approx([1.5, 1.5, 0.5, 0.5, 0.0])
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        curve = torch.cat([torch.zeros(1), torch.rand(9, generator=g).cumsum(0)])
        gains = envelope_gains(curve)
        assert (gains[1:] <= gains[:-1] + 1e-12).all()  # concave
        hull = torch.cat([torch.zeros(1, dtype=torch.float64), gains.cumsum(0)])
        assert (hull >= curve.double() - 1e-12).all()  # above every point
        assert abs(float(hull[-1]) - float(curve[-1])) < 1e-9  # through the ends


def test_greedy_is_optimal_on_the_envelopes():
    """The greedy's allocation reaches the best total envelope utility of every split of the budget."""
    g = torch.Generator().manual_seed(2)
    N, L = 3, 4
    curves = torch.cat([torch.zeros(N, 1), torch.rand(N, L, generator=g).cumsum(1)], 1)
    gains = torch.stack([envelope_gains(c) for c in curves])
    hull = torch.cat([torch.zeros(N, 1, dtype=torch.float64), gains.cumsum(1)], 1)
    for total in range(N * L + 1):
        counts = greedy_counts(gains, total)
        assert int(counts.sum()) == total
        best = max(sum(float(hull[i, k]) for i, k in enumerate(split))
                   for split in itertools.product(range(L + 1), repeat=N) if sum(split) == total)
        assert sum(float(hull[i, int(k)]) for i, k in enumerate(counts)) == pytest.approx(best)


def test_keep_fractions_meet_every_ratios_total_and_grow_with_the_budget():
    g = torch.Generator().manual_seed(3)
    n, H, L = 3, 2, 20
    oracle = torch.rand(n, H, L, generator=g) ** 4
    scores = oracle + 0.3 * torch.rand(n, H, L, generator=g)  # an imperfect scorer
    ratios = [0.25, 0.5, 0.75]
    keep = keep_fractions(oracle, scores, ratios)
    for r, row in zip(ratios, keep):
        assert int(round(float(row.sum()) * L)) == n * H * round((1 - r) * L)
    assert (keep[1:] <= keep[:-1] + 1e-12).all()  # the greedy is nested: less budget never gives a head more


def test_interpolate_between_and_beyond_the_ratios():
    x = torch.tensor([0.2, 0.4, 0.8], dtype=torch.float64)
    y = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.1, 0.3]], dtype=torch.float64)
    got = interpolate(x, y, torch.tensor([0.0, 0.3, 0.4, 0.6, 0.9]))
    torch.testing.assert_close(got, torch.tensor([[1.0, 0.0], [0.75, 0.25], [0.5, 0.5], [0.3, 0.4], [0.1, 0.3]],
                                                 dtype=torch.float64))


def _curve_file(path, keep, ratios, config=None):
    config = config or LlamaConfig(**_COMMON)
    keep = torch.tensor(keep, dtype=torch.float64)
    shares = keep.mean(0) / keep.mean(0).sum()
    c = cal.Calibration(model=cal.model_identity(config), scorer={"name": "expected_attention"},
                        reference={"method": "lukv"}, ratios=ratios, tasks=["passkey"], n=1,
                        seeds={"seed": cal.CALIBRATION_SEED}, context=100, library_version="test", created="now",
                        shares=shares.tolist(), keep=keep.tolist())
    c.save(path)
    return str(path)


def test_calibrated_budgets_reproduce_the_keep_curve(tmp_path):
    """At a ratio of the curve, CalibratedLayer then Calibrated give each (layer, head) the curve's count."""
    keep = [[[0.9, 0.7], [0.5, 0.3], [0.8, 0.8]],  # r = 1/3: layer means 0.8, 0.4, 0.8 (overall 2/3)
            [[0.6, 0.4], [0.2, 0.2], [0.5, 0.1]]]  # r = 2/3: layer means 0.5, 0.2, 0.3 (overall 1/3)
    ratios = [1 / 3, 2 / 3]
    path = _curve_file(tmp_path / "curve.json", keep, ratios)
    L = 60
    layers, heads = CalibratedLayer(path=path), Calibrated(path=path)
    for r, row in zip(ratios, keep):
        avg = torch.tensor([round((1 - r) * L)])
        budgets = layers.budgets(avg, 3, torch.tensor([L]))
        want = [sum(h) / 2 * L for h in row]
        assert int(budgets.sum()) == 3 * int(avg)
        assert (budgets[0].double() - torch.tensor(want)).abs().max() <= 1.0
        for layer in range(3):
            scores = torch.rand(1, 2, L)
            counts = heads.allocate_layer(scores, budgets[:, layer], layer)
            expect = torch.tensor(row[layer]) * L * float(budgets[0, layer]) / want[layer]
            assert (counts[0].double() - expect).abs().max() <= 1.0, (r, layer, counts, expect)


def test_curve_validation(tmp_path):
    with pytest.raises(ValueError, match="keep must be 2 ratios"):
        _curve_file(tmp_path / "a.json", [[[0.5, 0.5]] * 3], [0.3, 0.6])
    with pytest.raises(ValueError, match="must increase"):
        _curve_file(tmp_path / "b.json", [[[0.5, 0.5]] * 3] * 2, [0.6, 0.3])
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        _curve_file(tmp_path / "c.json", [[[1.5, 0.5]] * 3] * 2, [0.3, 0.6])


def test_profile_on_the_tiny_model_then_the_press_keeps_its_counts(tmp_path):
    model = build_model("llama", max_position_embeddings=4096)
    result = profile_lukv(model, build_tokenizer(), StreamingLLM(), n=2, tasks=["passkey"], context=300,
                          ratios=[0.25, 0.5, 0.75], progress=False)
    keep = torch.tensor(result.keep)
    assert keep.shape == (3, 3, 2) and (keep[1:] <= keep[:-1] + 1e-9).all()
    path = tmp_path / "lukv.json"
    result.save(path)
    ids = torch.randint(5, 100, (1, 80), generator=torch.Generator().manual_seed(6))
    press = Pipeline(scorer=StreamingLLM(), layers=CalibratedLayer(path=str(path)),
                     allocator=Calibrated(path=str(path)), compression_ratio=0.5)
    with press(model):
        out = model(ids, use_cache=True)
    cache = output_cache(out)
    kept = torch.stack([cache.head_lengths(i)[0] for i in range(3)]).double()
    assert int(kept.sum()) == 3 * 2 * 40
    assert (kept / 80 - keep[1]).abs().max() <= 2.5 / 80  # the curve's fractions at r = 0.5, up to rounding


def test_shipped_lukv_curve_fits_the_default_model():
    shipped = cal.load("builtin:smollm2_135m_lukv")
    shipped.check_model(default_model_config())
    assert shipped.scorer["name"] == "expected_attention" and shipped.reference["method"] == "lukv"
    assert shipped.seeds["seed"] >= cal.CALIBRATION_SEED and len(shipped.ratios) == 19
    keep = torch.tensor(shipped.keep)
    for r, row in zip(shipped.ratios, keep):
        assert abs(float(row.mean()) - (1 - r)) < 0.01
    press = preset("lukv", compression_ratio=0.75)
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    budgets = press.layers.budgets(torch.tensor([250]), 30, torch.tensor([1000]))
    assert int(budgets.sum()) == 30 * 250
