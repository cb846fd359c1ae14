"""``benchmarks/press_table.py``: per preset, agreement over its recorded cases (every layer, also where only some
are asserted) and accuracy from the first kvpress_compare summary holding both libraries' cells at the ratio, per
setting. Needs neither kvpress nor a model."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import press_table as pt  # noqa: E402


def _res(identical: int, heads: int, jaccard: float) -> dict:
    return {"identical_heads": identical, "heads": heads, "jaccard": jaccard}


def test_agreement_groups_cases_by_preset_and_counts_every_layer():
    cases = {"snapkv/a": SimpleNamespace(exact=True, press="SnapKVPress"),
             "snapkv/b": SimpleNamespace(exact=False, press="SnapKVPress"),
             "block_keydiff": SimpleNamespace(exact=True, press="BlockPress")}
    results = {"snapkv/a": _res(6, 6, 1.0), "snapkv/b": _res(2, 6, 0.5),
               # only layer 0 asserted: the row counts every layer
               "block_keydiff": {**_res(2, 2, 1.0), "all_layers": _res(2, 6, 0.9)}}
    rows = pt.agreement(results, cases)
    assert rows["snapkv"] == {"cases": 2, "exact": 1, "identical": 8, "rows": 12, "jaccard": 0.75,
                              "presses": ["SnapKVPress"]}
    assert (rows["block_keydiff"]["identical"], rows["block_keydiff"]["rows"]) == (2, 6)
    assert rows["block_keydiff"]["jaccard"] == 0.9


def _summary(rows: list[tuple[str, str, float, str, float]], complete=True) -> dict:
    return {"complete": complete, "table": [
        {"library": lib, "method": m, "ratio": r, "name": m, "accuracy": {s: {"mean": acc, "n": 4, "kv_fraction": 0.3}}}
        for lib, m, r, s, acc in rows]}


def test_accuracy_takes_the_first_summary_holding_both_cells_per_setting():
    first = _summary([("kvpress_ada", "ada_chunkkv", 0.75, "agnostic", 0.5)])  # no kvpress cell: skipped
    second = _summary([("kvpress_ada", "ada_chunkkv", 0.75, "agnostic", 0.4), ("kvpress", "chunkkv", 0.75,
                       "agnostic", 0.3), ("kvpress_ada", "ada_chunkkv", 0.5, "aware", 0.9),
                       ("kvpress", "chunkkv", 0.5, "aware", 0.9)], complete=False)
    third = _summary([("kvpress_ada", "ada_chunkkv", 0.75, "aware", 0.2), ("kvpress", "chunkkv", 0.75, "aware", 0.1)])
    acc = pt.accuracy([("1", first), ("2", second), ("3", third)], "ada_chunkkv", "chunkkv", 0.75)
    assert acc["agnostic"]["source"] == "2" and acc["agnostic"]["complete"] is False
    assert (acc["agnostic"]["ours"]["mean"], acc["agnostic"]["kvpress"]["mean"]) == (0.4, 0.3)
    assert acc["aware"]["source"] == "3"  # the 0.5 cells of "2" are another ratio
    assert pt.fmt_acc(acc["agnostic"]) == "0.40 / 0.30 (n = 4*)"
    assert pt.accuracy([("1", first)], "ada_chunkkv", "chunkkv", 0.75) == {}


def test_a_preset_with_its_own_budget_takes_the_uncapped_cells():
    """SimLayerKV, DuoAttention and threshold presses set their own budget: their cells at ratio 0 (no cap) are
    paired, never a capped row at the table's ratio."""
    summary = _summary([("kvpress_ada", "duo_attention", 0.75, "agnostic", 0.07),
                        ("kvpress", "duo_attention", 0.75, "agnostic", 0.53),
                        ("kvpress_ada", "duo_attention", 0.0, "agnostic", 0.5),
                        ("kvpress", "duo_attention", 0.0, "agnostic", 0.52)])
    acc = pt.accuracy([("s", summary)], "duo_attention", "duo_attention", 0.75, own_budget=True)
    assert (acc["agnostic"]["ours"]["mean"], acc["agnostic"]["kvpress"]["mean"]) == (0.5, 0.52)
    assert pt.fmt_acc(acc["agnostic"]) == "0.50 / 0.52 (n = 4, own budget)"
    capped = pt.accuracy([("s", summary)], "duo_attention", "duo_attention", 0.75)
    assert capped["agnostic"]["ours"]["mean"] == 0.07
