"""Data-parallel ``kvpress-ada eval``: samples sharded over torchrun processes, one results.json
equal to the single-process run's (all but the wall-clock ``seconds``), per-rank checkpoints, resume across
process counts."""

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import build_model, build_tokenizer

from kvpress_ada.harness import cli
from kvpress_ada.harness.distributed import World
from kvpress_ada.harness.eval import parallel
from kvpress_ada.harness.eval.runner import Record

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--presets", "snapkv,ada_snapkv", "--ratios", "0.5,0.75", "--tasks", "passkey", "--n", "4", "--context", "300",
        "--max-new-tokens", "3", "--no-progress", "--threads", "1"]

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_model("llama", max_position_embeddings=4096).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def single(tiny_dir, tmp_path_factory):
    """results.json of the single-process run."""
    out = tmp_path_factory.mktemp("single")
    assert cli.main(["eval", "--model", tiny_dir, *ARGS, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def _settings(argv):
    args = cli.build_parser().parse_args(argv)
    tasks, entries = cli._eval_entries(args, cli._eval_inputs(args))
    return cli._settings(args, tasks, entries)


def test_sharding_round_robin_covers_every_sample_once():
    shards = [World(r, 3).shard(10) for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert parallel.strip_workers(["eval", "--workers", "2", "--n", "3", "--workers=4"]) == ["eval", "--n", "3"]


def test_merge_orders_as_one_process():
    recs = [Record(i, "t", label, 0.5, "", 0.0, 1, 1) for i in range(4) for label in ("full", "a", "b")]
    parts = [[r for r in recs if r.sample % 2 == k] for k in (1, 0)]
    assert parallel.merge(parts) == recs


def test_resume_from_per_rank_checkpoints_in_one_process(tiny_dir, single, tmp_path, monkeypatch, capsys):
    """Checkpoints of a 2-process run (partial.rank0/1.json) resumed by one process: nothing is evaluated again,
    the result equals the uninterrupted run and every checkpoint is removed."""
    argv = ["eval", "--model", tiny_dir, *ARGS, "--out", str(tmp_path)]
    settings = _settings(argv)
    for rank in (0, 1):
        recs = [r for r in single["records"] if r["sample"] % 2 == rank]
        (tmp_path / f"partial.rank{rank}.json").write_text(json.dumps(
            {"settings": settings, "samples_done": 2, "samples": 4, "seconds": 1.0 + rank, "records": recs}))
    ran = []
    from kvpress_ada.harness.eval import runner

    monkeypatch.setattr(runner, "evaluate_sample", lambda *a, **k: ran.append(a) or [])
    assert cli.main([*argv, "--resume"]) == 0, capsys.readouterr().err
    assert ran == []
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["records"] == single["records"] and data["summary"] == single["summary"]
    assert parallel.partial_files(tmp_path) == []


def test_resume_refuses_a_rank_checkpoint_of_other_settings(tiny_dir, tmp_path, capsys):
    argv = ["eval", "--model", tiny_dir, *ARGS, "--out", str(tmp_path)]
    settings = {**_settings(argv), "seed": 7}
    rank1 = tmp_path / "partial.rank1.json"
    rank1.write_text(json.dumps({"settings": settings, "seconds": 0.0, "records": []}))
    assert cli.main([*argv, "--resume"]) == 2
    assert f"--resume: {rank1} was written with another seed" in capsys.readouterr().err


@needs_gloo
def test_two_processes_equal_one(tiny_dir, single, tmp_path):
    """``--workers 2`` (torchrun, gloo, 2 processes) resuming a one-process checkpoint: rank 0 takes over the finished
    sample 0 (its answer marked, to see that it is not evaluated again), ranks 0 and 1 evaluate samples 2 and 1, 3;
    rank 0 gathers: records and summary equal the single-process run's, in the same order."""
    argv = ["eval", "--model", tiny_dir, *ARGS, "--out", str(tmp_path)]
    done = [dict(r, answer="from the checkpoint") for r in single["records"] if r["sample"] == 0]
    (tmp_path / "partial.json").write_text(json.dumps(
        {"settings": _settings(argv), "samples_done": 1, "samples": 4, "seconds": 2.0, "records": done}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvpress_ada.harness.cli", *argv, "--resume", "--workers", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 2 processes" in proc.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    expected = [dict(r, answer="from the checkpoint") if r["sample"] == 0 else r for r in single["records"]]
    assert data["records"] == expected
    assert data["summary"] == single["summary"]
    assert data["command"] == ["kvpress-ada", *argv, "--resume"]  # the workers' command line: no --workers
    assert parallel.partial_files(tmp_path) == []
    assert (tmp_path / "accuracy.png").stat().st_size > 1000


def test_records_round_trip():
    r = Record(0, "passkey", "snapkv", 0.5, "x", 1.0, 10, 20, 0.1, 1.0, [0.0], [0.0])
    assert Record(**json.loads(json.dumps(asdict(r)))) == r
