"""``benchmarks/long_context.py --stages`` resumes on a new machine from the committed summary alone: the runs
it covers are skipped, and the merged summary equals the summary of one uninterrupted run. The subprocess
worker (a real model at 16k) is replaced by a deterministic fake record per run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import long_context  # noqa: E402

METHODS = "full,ada_snapkv@chunk,kvzip"


def fake_record(cfg: dict) -> dict:
    """A run's record as the worker writes it, its numbers a function of (method, sample, context)."""
    i, m, L = cfg["sample"], cfg["method"], cfg["context"]
    k = len(m)
    return dict(cfg, answer=str(i), score=float((i + k) % 2), answer_tokens=3 + i, prefill_s=10.0 * i + k + L / 1e3,
                pass_s=5.0 + i if m == "kvzip" else None, decode_s=0.5 * i + 1, peak_kv_bytes=2**20 * (k + i),
                kv_bytes_after_prefill=2**19 * (k + 2 * i), full_kv_bytes=2**21 * L / 1e3,
                peak_delta_rss_mib=100.0 * k + i, peak_rss_mib=1000.0 + 7 * i)


@pytest.fixture
def runs(monkeypatch):
    called: list[tuple] = []

    def run_one(cfg, timeout):
        called.append((cfg["context"], cfg["sample"], cfg["method"]))
        return fake_record(cfg)

    monkeypatch.setattr(long_context, "run_one", run_one)
    return called


def stages(out: Path, *extra: str) -> int:
    return long_context.main(["--stages", "--contexts", "16000", "--methods", METHODS, "--out", str(out), *extra])


def summary_of(out: Path) -> list[dict]:
    return json.loads(out.with_name(out.stem + ".summary.json").read_text())["summary"]


def assert_same_means(got: dict, want: dict, fields: tuple) -> None:
    for f in fields:
        assert (got[f] is None) == (want[f] is None), f
        if want[f] is not None:
            assert got[f] == pytest.approx(want[f], rel=1e-12), f


def assert_same_cells(got: list[dict], want: list[dict]) -> None:
    assert [(c["context"], c["method"], c["n"], c["covers"]) for c in got] == \
        [(c["context"], c["method"], c["n"], c["covers"]) for c in want]
    for g, w in zip(got, want):
        assert_same_means(g, w, long_context.CELL_MEANS + long_context.STAGES)
        assert [(t["processor"], t["n"]) for t in g["times"]] == [(t["processor"], t["n"]) for t in w["times"]]
        for gt, wt in zip(g["times"], w["times"]):
            assert_same_means(gt, wt, long_context.STAGES)


def test_resume_from_committed_summary_skips_its_runs_and_merges_exactly(tmp_path, runs):
    whole = tmp_path / "whole" / "stages.json"
    assert stages(whole, "--n", "3") == 0
    assert len(runs) == 9
    runs.clear()

    part = tmp_path / "part" / "stages.json"
    assert stages(part, "--n", "2", "--resume") == 0
    assert sorted(s for _, s, _ in runs) == [0, 0, 0, 1, 1, 1]
    assert "records" not in json.loads(part.with_name("stages.summary.json").read_text())
    part.unlink()  # a new machine: the per-run records are gone, the committed summary is there
    runs.clear()
    assert stages(part, "--n", "3", "--resume") == 0
    assert runs == [(16000, 2, m) for m in METHODS.split(",")]  # only the runs the summary does not cover
    assert_same_cells(summary_of(part), summary_of(whole))
    written = json.loads(part.with_name("stages.summary.json").read_text())
    assert len(written["earlier"]) == 1 and "carried" not in written
    assert part.with_suffix(".png").exists()

    runs.clear()  # --summary-only rewrites the summary from what is kept and runs nothing
    assert stages(part, "--n", "4", "--resume", "--summary-only") == 0
    assert runs == []
    assert_same_cells(summary_of(part), summary_of(whole))

    with pytest.raises(SystemExit):  # without --resume it would start afresh and write an empty summary
        stages(part, "--n", "4", "--summary-only")
    assert_same_cells(summary_of(part), summary_of(whole))

    runs.clear()  # the same machine again: nothing left to run, the summary unchanged
    assert stages(part, "--n", "3", "--resume") == 0
    assert runs == []
    assert_same_cells(summary_of(part), summary_of(whole))


def test_resume_refuses_a_summary_made_with_other_settings(tmp_path, runs):
    out = tmp_path / "stages.json"
    assert stages(out, "--n", "1") == 0
    out.unlink()
    with pytest.raises(SystemExit, match="budget=4096, this run asks budget=2048"):
        stages(out, "--n", "2", "--budget", "2048", "--resume")
    with pytest.raises(SystemExit, match="threads=1, this run asks threads=2"):
        stages(out, "--n", "2", "--threads", "2", "--resume")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=8).filter(lambda s: any(s) and not all(s)))
def test_merge_of_a_split_equals_the_whole(side):
    """Any split of a cell's runs between two machines merges to the summary of all runs."""
    base = dict(kind="stages", model="m", seed=0, budget=4096, chunk=1024, threads=2, max_new_tokens=24,
                task="passkey", processor="cpu A")
    records = [fake_record(dict(base, context=L, sample=i, method=m)) for L in (16000, 32000)
               for i in range(len(side)) for m in ("full", "kvzip")]
    a = [r for r in records if side[r["sample"]]]
    b = [r for r in records if not side[r["sample"]]]
    merged = long_context.merge_staged_summaries(long_context.staged_summary(a), long_context.staged_summary(b))
    assert_same_cells(merged, long_context.staged_summary(records))


def test_merge_refuses_a_run_in_both_summaries():
    base = dict(kind="stages", model="m", seed=0, budget=4096, chunk=1024, threads=2, max_new_tokens=24,
                task="passkey", context=16000, method="full", processor="cpu A")
    one = long_context.staged_summary([fake_record(dict(base, sample=0)), fake_record(dict(base, sample=1))])
    other = long_context.staged_summary([fake_record(dict(base, sample=1))])
    with pytest.raises(ValueError, match=r"runs \[\('passkey', 1\)\] are in both"):
        long_context.merge_staged_summaries(one, other)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=8).filter(lambda s: any(s) and not all(s)))
def test_stage_times_stay_apart_across_processors(side):
    """Runs split between two processors: accuracy, KV and RSS merge to the whole's, the stage times are each
    processor's own means (never averaged across them), and the cell names no single stage time."""
    base = dict(kind="stages", model="m", seed=0, budget=4096, chunk=1024, threads=2, max_new_tokens=24,
                task="passkey", context=16000)
    records = [fake_record(dict(base, sample=i, method=m, processor="cpu A" if side[i] else "cpu B"))
               for i in range(len(side)) for m in ("full", "kvzip")]
    a = [r for r in records if side[r["sample"]]]
    b = [r for r in records if not side[r["sample"]]]
    merged = long_context.merge_staged_summaries(long_context.staged_summary(a), long_context.staged_summary(b))
    whole = long_context.staged_summary(records)
    for cell, want, alone_a, alone_b in zip(merged, whole, long_context.staged_summary(a),
                                            long_context.staged_summary(b)):
        assert_same_means(cell, want, long_context.CELL_MEANS)
        assert all(cell[k] is None for k in long_context.STAGES)
        assert [(t["processor"], t["n"]) for t in cell["times"]] == [("cpu A", alone_a["n"]), ("cpu B", alone_b["n"])]
        assert_same_means(cell["times"][0], alone_a, long_context.STAGES)
        assert_same_means(cell["times"][1], alone_b, long_context.STAGES)


def test_resume_on_another_processor_keeps_times_apart(tmp_path, runs, monkeypatch):
    """A summary written before cells kept their times per processor (one machine) resumes on a machine with
    another processor: its times are attributed to its own machine, the new runs' to this one."""
    out = tmp_path / "stages.json"
    assert stages(out, "--n", "2") == 0
    first = long_context.common.machine_info()["processor"]
    summary_file = out.with_name("stages.summary.json")
    old = json.loads(summary_file.read_text())
    for cell in old["summary"]:
        del cell["times"]
    summary_file.write_text(json.dumps(old))
    out.unlink()

    machine_info = long_context.common.machine_info
    monkeypatch.setattr(long_context.common, "machine_info", lambda: dict(machine_info(), processor="Other CPU"))
    runs.clear()
    assert stages(out, "--n", "3", "--resume") == 0
    assert runs == [(16000, 2, m) for m in METHODS.split(",")]
    for cell in summary_of(out):
        assert [(t["processor"], t["n"]) for t in cell["times"]] == [(first, 2), ("Other CPU", 1)]
        assert cell["prefill_s"] is None
        # sample 2's prefill (fake_record): 10 * 2 + len(method) + 16
        assert cell["times"][1]["prefill_s"] == pytest.approx(20.0 + len(cell["method"]) + 16.0)
    rows = long_context.staged_readme_rows(summary_of(out))
    assert f"{long_context._short_processor(first)} (2) / Other CPU (1)" in rows
