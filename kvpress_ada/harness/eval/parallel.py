"""Data-parallel evaluation: the samples of one ``kvpress-ada eval`` shared among ``torchrun`` processes.

``torchrun --nproc-per-node N -m kvpress_ada.harness.cli eval ...`` (or ``kvpress-ada eval --workers N``,
which launches exactly that) runs one evaluator per process. Rank ``r`` of ``W`` evaluates the
samples ``r, r + W, r + 2W, ...`` (round robin: every rank gets a mix of the tasks), checkpoints
them after each sample to ``OUT/partial.rank<r>.json``, and at the end rank 0 gathers every rank's
records through ``torch.distributed`` (gloo), sorts them by sample as one process would have
produced them, and writes the one ``results.json`` and plot. Each sample's records depend on that
sample only (one prefill per sample, batch 1), so the results equal the single-process run's
except for the wall-clock ``seconds``.

``--resume`` reads every partial file in ``OUT`` (``partial.json`` of a one-process run and the
``partial.rank<r>.json`` of any number of processes), so an interrupted run may be resumed with
another process count; each rank takes over the finished samples it owns in the new sharding.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Callable, Sequence

from kvpress_ada.harness.distributed import World

PARTIAL = "partial.json"


def partial_path(out: Path, world: World) -> Path:
    """This rank's checkpoint: ``partial.json`` for one process, ``partial.rank<r>.json`` otherwise."""
    return out / (PARTIAL if world.size == 1 else f"partial.rank{world.rank}.json")


def partial_files(out: Path) -> list[Path]:
    """Every checkpoint in ``out`` (of any process count), ``partial.json`` first, then by rank."""
    ranked = sorted(out.glob("partial.rank*.json"), key=lambda p: (len(p.name), p.name))
    return [p for p in [out / PARTIAL, *ranked] if p.is_file()]


def foreign_partials(out: Path, world: World) -> list[Path]:
    """Checkpoints in ``out`` that no rank of this run writes (left by a run with another process count)."""
    own = {partial_path(out, World(r, world.size)) for r in range(world.size)}
    return [p for p in partial_files(out) if p not in own]


def resume(files: Sequence[Path], read: Callable[[Path], tuple[list, float]]) -> tuple[list, float, set[int]]:
    """Records, seconds and finished samples of the checkpoints ``files`` (``read`` parses one file and checks
    its settings). A sample found in several files (a stale checkpoint) is taken from the first; seconds are
    the longest of the files (their processes ran side by side)."""
    records: list = []
    seconds = 0.0
    done: set[int] = set()
    for file in files:
        recs, secs = read(file)
        seconds = max(seconds, secs)
        new = {r.sample for r in recs} - done
        records += [r for r in recs if r.sample in new]
        done |= new
    return records, seconds, done


def merge(parts: Sequence[Sequence]) -> list:
    """Every rank's records in the order of one uninterrupted single-process run: by sample, each sample's
    records in the order they were made (all of a sample's records come from one rank)."""
    records = [r for part in parts for r in part]
    records.sort(key=lambda r: r.sample)
    return records


def launch(workers: int, argv: Sequence[str]) -> int:
    """Run ``kvpress-ada <argv>`` in ``workers`` local processes under ``torchrun`` (standalone rendezvous);
    returns its exit code. The workers' command line is ``argv`` itself (without ``--workers``), so the
    ``command`` recorded in ``results.json`` is the single-process one."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
           "-m", "kvpress_ada.harness.cli", "--", *argv]  # "--": torchrun would take "--n" for its own "--nnodes"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return supervise(cmd, env)


def supervise(cmd: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` (torchrun) to its end and return its exit code, or 130 once interrupted.

    Its stderr is relayed as it comes (progress bars included) until Ctrl-C; then ``cmd`` gets one
    SIGINT (the workers checkpoint and exit) and whatever it prints from then on (torchrun's
    ``SignalException`` traceback, each worker's own note) is dropped: the caller says in one line
    what was kept, as a one-process run does."""
    # its own session: Ctrl-C reaches torchrun once (from here), and torchrun hands it to each worker once
    proc = subprocess.Popen(list(cmd), env=env, start_new_session=True, stderr=subprocess.PIPE)
    interrupted = threading.Event()
    relay = threading.Thread(target=_relay, args=(proc.stderr, interrupted), daemon=True)
    relay.start()
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:  # the workers checkpoint and exit; wait for them
            if not interrupted.is_set():
                interrupted.set()
                proc.send_signal(signal.SIGINT)
    relay.join(timeout=5)
    return 130 if interrupted.is_set() else code


def _relay(stream: IO[bytes] | None, stop: threading.Event) -> None:
    """Copy ``stream`` to this process's stderr as bytes arrive, dropping everything once ``stop`` is set."""
    if stream is None:
        return
    out = getattr(sys.stderr, "buffer", None)
    while chunk := os.read(stream.fileno(), 65536):
        if stop.is_set():
            continue  # keep draining, so the child never blocks on a full pipe
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()
    stream.close()


def interrupted_note(out: Path, resume_hint: str) -> str:
    """The one line a ``--workers`` run prints on Ctrl-C: what the ranks' checkpoints in ``out`` keep."""
    done = total = 0
    files = [p for p in partial_files(out) if p.name != PARTIAL]
    for file in files:
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        done += int(data.get("samples_done", 0))
        total = max(total, int(data.get("samples", 0)))
    if done == 0:
        return "kvpress-ada eval: interrupted before the first sample finished; nothing to keep"
    kept = ", ".join(p.name for p in files)
    return (f"kvpress-ada eval: interrupted after {done} of {total} samples, kept in {out} ({kept}); "
            f"continue with: {resume_hint}")


def strip_workers(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--workers N`` / ``--workers=N``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out
