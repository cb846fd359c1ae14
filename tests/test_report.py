"""Paired accuracy differences between two presses on the same samples."""

import math

from kvpress_ada.harness.eval.report import paired_difference


def _rec(label, ratio, sample, score, task="passkey"):
    return {"label": label, "ratio": ratio, "sample": sample, "task": task, "score": score}


def test_paired_difference_matches_hand_computation():
    a = [1.0, 1.0, 0.0, 1.0]
    b = [0.0, 1.0, 0.0, 0.0]
    records = [_rec("x", 0.5, i, s) for i, s in enumerate(a)] + [_rec("y", 0.5, i, s) for i, s in enumerate(b)]
    records += [_rec("x", 0.75, 0, 0.0), _rec("y", 0.9, 7, 1.0)]  # other ratios and unpaired samples are ignored
    out = paired_difference(records, "x", "y", 0.5)
    diffs = [1.0, 0.0, 0.0, 1.0]
    sd = math.sqrt(sum((d - 0.5) ** 2 for d in diffs) / 3)
    assert out["n"] == 4 and out["delta"] == 0.5
    assert math.isclose(out["ci95"], 1.96 * sd / 2)
    assert out["verdict"] == "no significant difference"  # 0.5 - 0.566 < 0


def test_paired_difference_verdicts_and_full_cache_pairs_at_any_ratio():
    records = [_rec("full", 0.0, i, 1.0) for i in range(10)] + [_rec("p", 0.75, i, 0.0) for i in range(10)]
    out = paired_difference(records, "full", "p", 0.75)
    assert out["delta"] == 1.0 and out["ci95"] == 0.0 and out["verdict"] == "a better"
    assert paired_difference(records, "p", "full", 0.75)["verdict"] == "b better"
    assert paired_difference(records, "p", "full", 0.5) is None  # p has no sample at 0.5


def test_paired_difference_pairs_a_threshold_press_with_a_fixed_ratio():
    from kvpress_ada.harness.eval.report import paired_difference

    def rec(label, ratio, sample, score):
        return {"label": label, "ratio": ratio, "task": "passkey", "sample": sample, "score": score}

    records = [rec("thr", 0.0, i, s) for i, s in enumerate([1, 1, 0, 1])]
    records += [rec("kvzip", 0.5, i, s) for i, s in enumerate([1, 0, 0, 0])]
    records += [rec("kvzip", 0.0, i, 1.0) for i in range(4)]  # another cell: must not be paired
    found = paired_difference(records, "thr", "kvzip", 0.0, 0.5)
    assert found is not None and found["n"] == 4 and found["delta"] == 0.5 and found["ratio_b"] == 0.5
    assert paired_difference(records, "thr", "kvzip", 0.0)["delta"] == -0.25
