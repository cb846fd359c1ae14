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


def assert_same_cells(got: list[dict], want: list[dict]) -> None:
    assert [(c["context"], c["method"], c["n"], c["covers"]) for c in got] == \
        [(c["context"], c["method"], c["n"], c["covers"]) for c in want]
    for g, w in zip(got, want):
        for f in long_context.CELL_MEANS:
            assert (g[f] is None) == (w[f] is None), f
            if w[f] is not None:
                assert g[f] == pytest.approx(w[f], rel=1e-12), (g["method"], f)


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
                task="passkey")
    records = [fake_record(dict(base, context=L, sample=i, method=m)) for L in (16000, 32000)
               for i in range(len(side)) for m in ("full", "kvzip")]
    a = [r for r in records if side[r["sample"]]]
    b = [r for r in records if not side[r["sample"]]]
    merged = long_context.merge_staged_summaries(long_context.staged_summary(a), long_context.staged_summary(b))
    assert_same_cells(merged, long_context.staged_summary(records))


def test_merge_refuses_a_run_in_both_summaries():
    base = dict(kind="stages", model="m", seed=0, budget=4096, chunk=1024, threads=2, max_new_tokens=24,
                task="passkey", context=16000, method="full")
    one = long_context.staged_summary([fake_record(dict(base, sample=0)), fake_record(dict(base, sample=1))])
    other = long_context.staged_summary([fake_record(dict(base, sample=1))])
    with pytest.raises(ValueError, match=r"runs \[\('passkey', 1\)\] are in both"):
        long_context.merge_staged_summaries(one, other)
