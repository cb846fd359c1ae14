"""``benchmarks/kvpress_compare.py --kvpress-cache``: the pure-Python side of running kvpress's presses on
transformers' ``QuantizedCache`` (cache specs, venv requirements, row names, the QuantizedCache table, resume
keys). Needs neither kvpress nor a model: the worker half runs only in the kvpress venv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kvpress_compare as kc  # noqa: E402

BASE_ARGS = ["--methods", "kvzip,ada_snapkv", "--ratios", "0.75", "--settings", "agnostic", "--no-decode"]


def test_cache_specs_parse_and_validate():
    assert kc.parse_kvpress_caches("dynamic") == ["dynamic"]
    assert kc.parse_kvpress_caches("Quanto-int4, quanto-int4,hqq-int8") == ["quanto-int4", "hqq-int8"]
    # transformers 5.2's QuantoQuantizedLayer takes 2 or 4 bits only: 8-bit asks for HQQ
    with pytest.raises(ValueError, match="hqq-int8"):
        kc.parse_kvpress_caches("quanto-int8")
    for bad in ("", "int4", "gguf-int4", "quanto4", "hqq-int5"):
        with pytest.raises(ValueError):
            kc.parse_kvpress_caches(bad)


def test_backend_requirements_go_to_the_kvpress_venv_only_when_asked():
    assert kc.cache_requirements(["dynamic"]) == ()
    assert kc.cache_requirements(["quanto-int4", "quanto-int2"]) == ("optimum-quanto==0.2.7",)
    assert kc.cache_requirements(["dynamic", "hqq-int4", "quanto-int4"]) == ("hqq==0.2.8.post1",
                                                                            "optimum-quanto==0.2.7")


def test_row_names():
    assert kc.kvpress_name("ada_snapkv") == "AdaKVPress(SnapKVPress)"
    assert kc.kvpress_name("full") == "no press"
    assert (kc.kvpress_name("ada_snapkv+quanto-int4")
            == "AdaKVPress(SnapKVPress) + QuantizedCache(quanto, 4 bits)")
    assert kc.kvpress_name("kvzip+hqq-int8") == "KVzipPress(layerwise=False) + QuantizedCache(hqq, 8 bits)"
    assert kc.kvpress_name("full+quanto-int4") == "QuantizedCache(quanto, 4 bits), no press"


def test_default_run_config_is_unchanged_and_options_enter_it():
    """A default run's resume key has no cache entries (earlier checkpoints still resume); the options do."""
    default = kc.run_config(kc.parse_args(BASE_ARGS))
    assert "kvpress_caches" not in default and "kvpress_only" not in default
    args = kc.parse_args(BASE_ARGS + ["--kvpress-cache", "quanto-int4", "--kvpress-only"])
    assert args.kvpress_caches == ["quanto-int4"]
    assert args.kept_sets is False and args.no_diagnostics is True
    cfg = kc.run_config(args)
    assert cfg["kvpress_caches"] == ["quanto-int4"] and cfg["kvpress_only"] is True


def test_option_errors():
    with pytest.raises(SystemExit):
        kc.parse_args(BASE_ARGS + ["--kvpress-cache", "quanto-int8"])
    with pytest.raises(SystemExit):  # no model on our side, so no decode part
        kc.parse_args([a for a in BASE_ARGS if a != "--no-decode"] + ["--kvpress-only"])


def _rec(sample, label, score, kv_bytes, task="passkey", parts=None):
    r = {"setting": "agnostic", "sample": sample, "task": task, "label": label, "ratio": 0.0 if "full" in label
         else 0.75, "score": score, "kv_bytes": kv_bytes, "answer": str(score)}
    if parts is not None:
        r.update(kv_bytes_parts={**parts, "other": 0, "total": kv_bytes}, kv_bytes_end={"total": kv_bytes + 10})
    return r


def test_quantized_rows_pair_with_the_full_dynamic_cache():
    parts = {"data": 80, "scale": 10, "zero_point": 10, "residual": 0}
    recs = []
    for i in range(4):
        recs += [_rec(i, "full", 1.0, 1000), _rec(i, "full+quanto-int4", 1.0, 100, parts=parts),
                 _rec(i, "ada_snapkv+quanto-int4", float(i == 0), 100, parts=parts)]
    report = {"records": {"kvpress": recs, "kvpress_ada": []}}
    lines = kc.quantized_rows(report).splitlines()
    assert lines[2].startswith("| full DynamicCache (no press) | 0 | 1.00")
    assert lines[3].startswith("| QuantizedCache(quanto, 4 bits), no press | 0 | 1.00")
    row = lines[4]
    assert row.startswith("| AdaKVPress(SnapKVPress) + QuantizedCache(quanto, 4 bits) | 0.75 | 0.25")
    assert "| 0.100 |" in row and "0.800 / 0.100 / 0.100 / 0.000" in row
    assert "-0.750" in row and "0/3" in row and "n = 4" in row


def test_build_report_names_rows_and_keeps_quantized_rows_out_of_the_best_press():
    parts = {"data": 80, "scale": 10, "zero_point": 10, "residual": 0}
    recs = [_rec(0, "full", 1.0, 1000), _rec(0, "kvzip+quanto-int4", 1.0, 100, parts=parts)]
    args = kc.parse_args(BASE_ARGS + ["--tasks", "passkey", "--kvpress-cache", "quanto-int4", "--kvpress-only"])
    payload = [{"index": 0, "task": "passkey", "answers": ["1"], "head_ids": [1, 2], "tail_ids": [3]}]
    report = kc.build_report(args, payload, recs, [], [], None)
    rows = {r["method"]: r for r in report["table"]}
    q = rows["kvzip+quanto-int4"]
    assert q["name"] == "KVzipPress(layerwise=False) + QuantizedCache(quanto, 4 bits)"
    acc = q["accuracy"]["agnostic"]
    assert acc["kv_fraction"] == pytest.approx(0.1)
    assert acc["kv_bytes_parts"]["scale"] == 10 and acc["kv_bytes_end"] == 110
    assert report["vs_kvpress_best"] == []  # no kvpress press on its DynamicCache to call the best
