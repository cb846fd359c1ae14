"""Ctrl-C on ``kvpress-ada eval --workers N`` prints one line, as a one-process run does: torchrun's
``SignalException`` traceback and the workers' own notes are dropped, and the launcher says what the
ranks' checkpoints keep and how to continue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvpress_ada.harness import cli
from kvpress_ada.harness.eval import parallel

ROOT = Path(__file__).resolve().parents[1]

# stands in for torchrun: relays progress, then on SIGINT prints a traceback as torchrun's agent does
FAKE_TORCHRUN = textwrap.dedent("""
    import pathlib, signal, sys, time
    def on_interrupt(*_):
        sys.stderr.write("kvpress-ada eval: interrupted after 1 of this rank's 2 of 4 samples\\n")
        sys.stderr.write("Traceback (most recent call last):\\n" + "  File 'torch/distributed/run.py'\\n" * 22
                         + "torch.distributed.elastic.multiprocessing.api.SignalException: got signal: 2\\n")
        sys.stderr.flush()
        sys.exit(1)
    signal.signal(signal.SIGINT, on_interrupt)
    sys.stderr.write("progress 50%\\r")
    sys.stderr.write("loading model ...\\n")
    sys.stderr.flush()
    pathlib.Path(sys.argv[1]).write_text("ready")
    time.sleep(60)
""")


def test_interrupt_drops_the_launchers_traceback(tmp_path):
    child, ready = tmp_path / "fake_torchrun.py", tmp_path / "ready"
    child.write_text(FAKE_TORCHRUN)
    # Ctrl-C as from a terminal even when the tests run in the background (a shell starts `cmd &` with
    # SIGINT ignored, and Python keeps an ignored SIGINT ignored)
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from kvpress_ada.harness.eval.parallel import supervise; "
            f"sys.exit(supervise([sys.executable, {str(child)!r}, {str(ready)!r}]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # let the relay pass on what was printed before the interrupt
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "progress 50%" in err and "loading model ..." in err  # relayed as it came
    assert "Traceback" not in err and "SignalException" not in err and "interrupted" not in err, err


def test_a_run_without_interrupt_keeps_every_line_and_exit_code(capfd):
    code = parallel.supervise([sys.executable, "-c", "import sys; sys.stderr.write('a\\nb\\n'); sys.exit(3)"])
    assert code == 3
    assert capfd.readouterr().err == "a\nb\n"


def _partial(path, done, total):
    path.write_text(json.dumps({"settings": {}, "samples_done": done, "samples": total, "seconds": 1.0,
                                "records": []}))


def test_workers_run_interrupted_prints_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(workers, argv):
        _partial(tmp_path / "partial.rank0.json", 2, 6)
        _partial(tmp_path / "partial.rank1.json", 1, 6)
        return 130

    monkeypatch.setattr(parallel, "launch", interrupted)
    argv = ["eval", "--presets", "snapkv", "--ratios", "0.5", "--n", "3", "--out", str(tmp_path), "--workers", "2"]
    assert cli.main(argv) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"kvpress-ada eval: interrupted after 3 of 6 samples, kept in {tmp_path} (partial.rank0.json, "
                     f"partial.rank1.json); continue with: kvpress-ada {' '.join(argv)} --resume"]


def test_workers_run_interrupted_before_any_sample(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(parallel, "launch", lambda workers, argv: 130)
    assert cli.main(["eval", "--presets", "snapkv", "--out", str(tmp_path), "--workers", "2"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "kvpress-ada eval: interrupted before the first sample finished; nothing to keep"]
