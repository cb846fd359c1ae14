"""Our key-statistics presses keep the positions NVIDIA kvpress 0.5.5 keeps, on identical token ids, checked
against kvpress's kept positions recorded in ``tests/fixtures/kvpress_agreement.json`` (kvpress runs in its own
venv only when recording: ``python benchmarks/kvpress_agreement.py --record``; what each case compares and why
only those: that script's docstring). A kept set may differ only at a tie of our scores (a repeated token's
identical keys in the first layer), never elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kvpress_agreement  # noqa: E402

RECORDED = kvpress_agreement.load()
MODELS: dict = {}


@pytest.mark.parametrize("label", sorted(RECORDED["cases"]))
def test_keeps_what_kvpress_kept(label):
    rec = RECORDED["cases"][label]
    case = kvpress_agreement._cases()[label]
    assert (case.arch, case.length, case.press) == (rec["arch"], rec["length"], rec["kvpress"])
    if case.arch not in MODELS:
        MODELS[case.arch] = kvpress_agreement._model(case.arch)
        if kvpress_agreement.weights_digest(MODELS[case.arch]) != RECORDED["models"][case.arch]:
            pytest.fail(f"the tiny {case.arch} model's weights differ from the recorded ones: re-record with "
                        f"`{kvpress_agreement.RECORD}`", pytrace=False)
    kept, scores = kvpress_agreement.ours(case, MODELS[case.arch])
    res = kvpress_agreement.compare(kept, kvpress_agreement.as_mask(rec["kept"], rec["length"]), scores)
    assert res["same_counts"] and res["untied"] == 0, res
    assert res["jaccard"] >= 0.99, res


def test_every_key_statistics_case_is_recorded():
    assert set(RECORDED["cases"]) == set(kvpress_agreement._cases())
    assert RECORDED["versions"]["kvpress"] == "0.5.5"
