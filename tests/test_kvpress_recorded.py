"""Our presets keep the positions NVIDIA kvpress 0.5.5's presses keep, on identical token ids, checked against what
kvpress's cache held, recorded in ``tests/fixtures/kvpress_agreement.json`` (kvpress runs in its own venv only when
recording: ``python benchmarks/kvpress_agreement.py --record``; what each case compares and why only those: that
script's docstring). A kept set may differ only at a float tie of our scores (a repeated token's keys in the first
layer, LagKV's rank scores), never elsewhere; where kvpress takes one top-k over every layer, only by the entries
our whole per-head layer budgets move (each layer's kept set nested in the other side's); keys and values a press
rewrites (ThinK's zeroed channels, re-rotated keys, merged values) agree to float precision. Cases with kvpress's
defaults where the semantics differ are recorded too but only reported (``--check``): their reasons are listed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kvpress_agreement  # noqa: E402

RECORDED = kvpress_agreement.load()
CASES = kvpress_agreement._cases()
MODELS: dict = {}


def _model(arch: str):
    if arch not in MODELS:
        MODELS[arch] = kvpress_agreement._model(arch)
        if kvpress_agreement.weights_digest(MODELS[arch]) != RECORDED["models"][arch]:
            pytest.fail(f"the tiny {arch} model's weights differ from the recorded ones: re-record with "
                        f"`{kvpress_agreement.RECORD}`", pytrace=False)
    return MODELS[arch]


@pytest.mark.parametrize("label", sorted(label for label, case in CASES.items() if case.exact))
def test_keeps_what_kvpress_kept(label):
    rec = RECORDED["cases"][label]
    case = CASES[label]
    assert (case.arch, case.length, case.press, case.kwargs) == (rec["arch"], rec["length"], rec["kvpress"],
                                                                 rec["kwargs"])
    res = kvpress_agreement.check_case(label, rec, _model(case.arch))
    if case.layer_rounding:
        assert res["nested_layers"][0] == res["nested_layers"][1], res
        assert res["jaccard"] >= 0.99, res
    else:
        assert res["same_counts"] and res["untied"] == 0, res
        assert res["jaccard"] >= 0.99, res
    for name, diff in res["tensors"].items():
        assert diff <= 1e-5, (name, res)
    if "channels" in res:
        assert res["channels"][0] == res["channels"][1], res


def test_every_case_is_recorded():
    assert set(RECORDED["cases"]) == set(CASES)
    assert RECORDED["versions"]["kvpress"] == "0.5.5"


def _spec_presses(name: str, kwargs: dict) -> set[str]:
    found = {name}
    for value in kwargs.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and set(item) == {"press", "kwargs"}:
                found |= _spec_presses(item["press"], item["kwargs"])
    return found


def test_every_kvpress_press_is_compared_or_accounted_for():
    """Each press kvpress 0.5.5 exports (read from kvpress when recording) has a case here, or its reason: an intended
    difference, a comparison elsewhere, or no preset here; each case that is not exact, or exact on some layers only,
    names its difference."""
    compared = set().union(*(_spec_presses(c.press, c.kwargs) for c in CASES.values()))
    reasons = set(kvpress_agreement.DIFFERENCES) | set(kvpress_agreement.ELSEWHERE) | set(kvpress_agreement.NOT_HERE)
    missing = set(RECORDED["presses"]) - compared - reasons
    assert not missing, f"kvpress presses with neither a case nor a reason: {sorted(missing)}"
    unknown = (compared | reasons) - set(RECORDED["presses"])
    assert not unknown, f"names kvpress 0.5.5 does not export: {sorted(unknown)}"
    for label, case in CASES.items():
        if not case.exact or case.layers is not None or case.layer_rounding:
            assert case.press in kvpress_agreement.DIFFERENCES, label
