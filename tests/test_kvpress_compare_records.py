"""``benchmarks/kvpress_compare.py --ours-records``: our answers read from benchmarks/quality.py's
quality_<setting>.json (or a `kvpress-ada eval` run's records), each file paired with the setting it was run in,
only after checking it was run on the samples built here (tasks, n, context, seed, answer length; every sample's
full-cache bytes its prompt's token count times the model's bytes per token). Needs neither kvpress nor a model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kvpress_compare as kc  # noqa: E402

TASKS = ["passkey", "multikey"]
N = 3
BPT = 4 * 2 * 2 * 2 * 8  # fp32 x (keys, values) x 2 layers x 2 kv heads x head dim 8


def _payload() -> list[dict]:
    """Six samples, round-robin over TASKS, with prompts of different lengths (as make_samples + split_prompt)."""
    return [{"index": i, "task": TASKS[i % 2], "head_ids": [1] * (50 + i), "tail_ids": [2] * (7 + i % 3)}
            for i in range(N * len(TASKS))]


def _quality(path: Path, setting: str, payload: list[dict], samples=None, **change) -> Path:
    """A quality.py file: per sample a full record (its bytes from the prompt's token count) and two presets."""
    records = []
    for p in payload if samples is None else [payload[i] for i in samples]:
        tokens = len(p["head_ids"]) + (len(p["tail_ids"]) if setting == "aware" else 0)
        for label, ratio, score, kv in (("full", 0.0, 1.0, tokens * BPT), ("chunkkv", 0.75, 0.0, tokens * BPT // 4),
                                        ("cam", 0.75, 1.0, tokens * BPT // 4)):
            records.append({"sample": p["index"], "task": p["task"], "label": label, "ratio": ratio, "answer": "a",
                            "score": score, "kv_bytes": kv, "full_kv_bytes": tokens * BPT, "kl": 0.0, "top1": 1.0,
                            "hidden_error": [], "eviction_loss": [], "achieved_ratio": 0.0})
    data = {"model": "default", "tasks": TASKS, "n_per_task": N, "context": 1000, "presets": ["chunkkv", "cam"],
            "ratios": [0.75], "max_new_tokens": 24, "setting": setting, "complete": samples is None,
            "records": records, **change}
    path.write_text(json.dumps(data))
    return path


def _args(files: list[Path], settings: str = "agnostic,aware", extra=()):
    return kc.parse_args(["--tasks", ",".join(TASKS), "--n", str(N), "--ratios", "0.75", "--methods", "chunkkv",
                          "--settings", settings, "--no-decode", "--ours-records", *map(str, files), *extra])


def test_bytes_per_token_formula():
    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert kc.kv_bytes_per_token(config) == (2 * 2 * 3 * 2 * 16, 4 * 2 * 3 * 2 * 16)  # head dim 64 / 4
    config.head_dim = 24
    assert kc.kv_bytes_per_token(config)[1] == 4 * 2 * 3 * 2 * 24


def test_each_setting_pairs_with_its_file(tmp_path):
    payload = _payload()
    aware = _quality(tmp_path / "quality_aware.json", "aware", payload)
    agnostic = _quality(tmp_path / "quality_agnostic.json", "agnostic", payload, samples=[0, 1, 2])  # partial
    args = _args([aware, agnostic])  # any order: each file names its setting
    assert args.kept_sets is False and args.no_diagnostics is True
    out = kc.read_ours_records(args, payload, (BPT // 2, BPT))
    assert sorted(out) == ["agnostic", "aware"]
    assert out["aware"]["source"]["path"] == str(aware.resolve())
    assert sorted(out["aware"]["records"]) == list(range(6)) and sorted(out["agnostic"]["records"]) == [0, 1, 2]
    for setting in out:  # full and --methods only (cam is not asked for), with the fields the report reads
        for i, recs in out[setting]["records"].items():
            assert sorted(r["label"] for r in recs) == ["chunkkv", "full"]
            assert all(r["task"] == payload[i]["task"] and set(r) == set(kc.OUR_RECORD_FIELDS) for r in recs)
    assert out["agnostic"]["source"]["complete"] is False and out["aware"]["source"]["complete"] is True


def test_max_samples_leaves_out_later_records(tmp_path):
    payload = _payload()[:2]
    path = _quality(tmp_path / "q.json", "agnostic", _payload())
    out = kc.read_ours_records(_args([path], "agnostic", ["--max-samples", "2"]), payload, (BPT,))
    assert sorted(out["agnostic"]["records"]) == [0, 1]


@pytest.mark.parametrize("change, message", [
    ({"n_per_task": 4}, "n 4 there, 3 here"),
    ({"context": 2000}, "context 2000 there"),
    ({"tasks": ["multikey", "passkey"]}, "tasks"),
    ({"max_new_tokens": 16}, "max_new_tokens 16 there"),
    ({"seed": 1}, "seed 1 there, 0 here"),
])
def test_refuses_other_samples(tmp_path, change, message):
    path = _quality(tmp_path / "q.json", "agnostic", _payload(), **change)
    with pytest.raises(SystemExit, match=message):
        kc.read_ours_records(_args([path], "agnostic"), _payload(), (BPT,))


def test_refuses_other_token_ids(tmp_path):
    """One sample whose full cache holds one token more than its prompt here: refused, naming the sample."""
    payload = _payload()
    path = _quality(tmp_path / "q.json", "agnostic", payload)
    data = json.loads(path.read_text())
    for r in data["records"]:
        if r["sample"] == 4 and r["label"] == "full":
            r["kv_bytes"] += BPT
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="sample 4's full cache holds .* other token ids"):
        kc.read_ours_records(_args([path], "agnostic"), payload, (BPT // 2, BPT))
    # the question-agnostic count is the context's alone: the aware file's bytes do not pass as agnostic ones
    aware = _quality(tmp_path / "a.json", "aware", payload)
    data = json.loads(aware.read_text())
    data["setting"] = "agnostic"
    aware.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="other token ids"):
        kc.read_ours_records(_args([aware], "agnostic"), payload, (BPT,))


def test_refuses_a_mismatched_task_and_files_per_setting(tmp_path):
    payload = _payload()
    path = _quality(tmp_path / "q.json", "agnostic", payload)
    data = json.loads(path.read_text())
    data["records"][0]["task"] = "multikey"  # sample 0 is a passkey sample here
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="record of sample 0 \\(multikey\\) does not match"):
        kc.read_ours_records(_args([path], "agnostic"), payload, (BPT,))
    agnostic = _quality(tmp_path / "a.json", "agnostic", payload)
    with pytest.raises(SystemExit, match="question-agnostic, not in --settings aware"):
        kc.read_ours_records(_args([agnostic], "aware"), payload, (BPT,))
    with pytest.raises(SystemExit, match="second file for the question-agnostic"):
        kc.read_ours_records(_args([agnostic, agnostic]), payload, (BPT,))
    with pytest.raises(SystemExit):  # one file per setting
        _args([agnostic], "agnostic,aware")
    broken = tmp_path / "broken.json"
    broken.write_text(path.read_text()[:100])
    with pytest.raises(SystemExit, match="not whole JSON"):
        kc.read_ours_records(_args([broken], "agnostic"), payload, (BPT,))


def test_eval_checkpoint_still_reads(tmp_path):
    """A `kvpress-ada eval` partial.json (settings kept) pairs with the setting of its question_aware."""
    payload = _payload()
    data = json.loads(_quality(tmp_path / "q.json", "aware", payload).read_text())
    partial = {"settings": {"model": "default", "tasks": TASKS, "n": N, "context": 1000, "seed": 0,
                            "question_aware": True, "max_new_tokens": 24}, "records": data["records"]}
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(partial))
    out = kc.read_ours_records(_args([path], "aware"), payload, (BPT,))
    assert out["aware"]["source"]["format"] == "kvpress-ada eval" and len(out["aware"]["records"]) == 6


def test_own_budget_presses_run_once_uncapped_with_our_window():
    """SimLayerKV and DuoAttention set their own budget: our side runs them once at ratio 0 (no cap), and kvpress's
    SimLayerKV gets our window (its default of 1,024 recent tokens would compress nothing at ~1k tokens)."""
    from types import SimpleNamespace

    from kvpress_ada import preset
    from kvpress_ada.harness.eval.runner import grid

    assert {"simlayerkv", "duo_attention", "kvzap_threshold"} <= set(kc.RATIO_FREE)
    args = SimpleNamespace(methods=["simlayerkv", "duo_attention", "kvgrad"], ratios=[0.5, 0.75], surrogate=None)
    entries = kc.our_entries(args, grid, preset)
    assert sorted((e.label, e.ratio) for e in entries) == [("duo_attention", 0.0), ("kvgrad", 0.5), ("kvgrad", 0.75),
                                                           ("simlayerkv", 0.0)]
    ours = kc.ours_settings(["simlayerkv"], preset)["simlayerkv"]
    scorer = preset("simlayerkv").scorer
    assert ours == {"lazy_threshold": scorer.lazy_threshold, "n_recent": scorer.n_recent,
                    "n_initial": scorer.n_initial, "n_last": scorer.n_last}
    assert ours["n_recent"] < 1000 and ours["lazy_threshold"] < 1.0  # kvpress's defaults would turn it off at 1k


def test_own_budget_records_pair_uncapped_only(tmp_path, capsys):
    """A grid's capped rows of a preset with its own budget are not read (kvpress runs it uncapped): no pair, said
    so; its uncapped (ratio 0) records are read."""
    payload = _payload()
    path = _quality(tmp_path / "q.json", "agnostic", payload)
    data = json.loads(path.read_text())
    full = [r for r in data["records"] if r["label"] == "full"]
    capped = [{**r, "label": "duo_attention", "ratio": 0.75} for r in full]
    data["records"] += capped
    path.write_text(json.dumps(data))
    args = _args([path], "agnostic", ["--methods", "duo_attention"])
    out = kc.read_ours_records(args, payload, (BPT,))
    assert all(sorted(r["label"] for r in recs) == ["full"] for recs in out["agnostic"]["records"].values())
    assert "has no records for duo_attention: no pair" in capsys.readouterr().err
    data["records"] += [{**r, "ratio": 0.0} for r in capped]
    path.write_text(json.dumps(data))
    out = kc.read_ours_records(args, payload, (BPT,))
    assert all(sorted((r["label"], r["ratio"]) for r in recs) == [("duo_attention", 0.0), ("full", 0.0)]
               for recs in out["agnostic"]["records"].values())
