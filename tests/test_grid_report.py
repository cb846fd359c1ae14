"""``benchmarks/grid_report.py``: the report's overall table keeps the per-layer arrays, the per-task tables drop
them, and the reads plot is written only when asked. Needs no model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import grid_report  # noqa: E402


def _record(label: str, ratio: float, task: str, sample: int, score: float) -> dict:
    return {"sample": sample, "task": task, "label": label, "ratio": ratio, "answer": "x", "score": score,
            "kv_bytes": int(1000 * (1 - ratio)), "full_kv_bytes": 1000, "kl": 0.1 * ratio, "top1": 1.0,
            "hidden_error": [0.1, 0.2], "eviction_loss": [0.3, ratio], "achieved_ratio": ratio,
            "read_bytes_per_step": 1000 * (1 - ratio) + 10}


def _grid(tmp_path: Path) -> Path:
    records = [_record(label, ratio, task, i, float(i < len(task) - 6))
               for task in ("passkey", "multikey") for i in range(4)
               for label, ratio in (("full", 0.0), ("snapkv", 0.5), ("streamingllm", 0.5))]
    path = tmp_path / "quality_agnostic.json"
    path.write_text(json.dumps({"setting": "agnostic", "tasks": ["passkey", "multikey"], "context": 100,
                                "records": records}))
    return path


def test_per_task_rows_drop_the_per_layer_arrays_the_overall_rows_keep(tmp_path):
    out = tmp_path / "report"
    assert grid_report.main([str(_grid(tmp_path)), "--out", str(out), "--pairs", "snapkv:streamingllm"]) == 0
    report = json.loads((out / "report.json").read_text())
    snapkv = next(r for r in report["summary"] if r["label"] == "snapkv")
    assert snapkv["eviction_loss_per_layer"] == [0.3, 0.5] and snapkv["hidden_error_per_layer"] == [0.1, 0.2]
    assert set(report["summary_by_task"]) == {"passkey", "multikey"}
    for rows in report["summary_by_task"].values():
        assert len(rows) == 3
        for row in rows:
            assert not set(grid_report.PER_LAYER) & set(row)
            assert {"accuracy", "ci95", "kv_bytes", "eviction_loss", "read_bytes_per_step"} <= set(row)
    # each task's rows hold its own samples: passkey scores 1 of 4, multikey 2 of 4, overall 3 of 8
    by_task = {task: next(r["accuracy"] for r in rows if r["label"] == "snapkv")
               for task, rows in report["summary_by_task"].items()}
    assert by_task == {"passkey": 0.25, "multikey": 0.5} and snapkv["accuracy"] == 0.375
    assert [p["a"] for p in report["paired"]] == ["snapkv"]
    assert not (out / "report_reads.png").exists()


def test_reads_plot_written_only_when_asked(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    assert grid_report.main([str(_grid(tmp_path)), "--out", str(out), "--pairs", "snapkv:full",
                             "--plot-reads"]) == 0
    assert (out / "report_reads.png").stat().st_size > 0 and (out / "report.png").stat().st_size > 0
