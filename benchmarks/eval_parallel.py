"""Data-parallel evaluation: the eval grid of this README run by 1 process and by N processes (torchrun, gloo).

    python benchmarks/eval_parallel.py                 # the README's eval grid (snapkv, ada_snapkv x 0.25/0.5/0.75,
                                                       # passkey + multikey, 1k tokens) with --n 8, 1 vs 2 processes
    python benchmarks/eval_parallel.py --n 32          # the full grid (~28 min + ~14 min on 2 idle cores)
    python benchmarks/eval_parallel.py --quick         # tiny random model, a few samples (smoke run)

Each run is the command line a user types (``kvpress-ada eval ... --threads 1``, and the same with
``--workers N``), timed end to end from outside (process start, model load, evaluation, gather,
results.json). Reported: wall time of each, throughput ratio (samples/s of N processes over 1) and
whether the two ``results.json`` agree on everything but the wall-clock ``seconds`` (and ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GRID = ["--presets", "snapkv,ada_snapkv", "--ratios", "0.25,0.5,0.75", "--tasks", "passkey,multikey",
        "--context", "1000", "--threads", "1", "--no-progress"]


def _tiny_model(path: Path) -> None:
    sys.path.insert(0, str(common.ROOT / "tests"))
    from conftest import build_model, build_tokenizer

    build_model("llama", max_position_embeddings=4096).save_pretrained(path)
    build_tokenizer().save_pretrained(path)


def _run(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvpress_ada.harness.cli", *argv], cwd=common.ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8, help="samples per task")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny random model, 2 samples per task, 1 ratio")
    parser.add_argument("--no-warm", action="store_true", help="skip the 1-sample warm-up run")
    parser.add_argument("--out", default=str(common.RESULTS / "eval_parallel.json"))
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="kvpress_ada_eval_parallel_"))
    grid, model = list(GRID), "default"
    if args.quick:
        model = str(work / "tiny")
        _tiny_model(Path(model))
        grid = ["--presets", "snapkv,ada_snapkv", "--ratios", "0.5", "--tasks", "passkey", "--context", "300",
                "--max-new-tokens", "3", "--threads", "1", "--no-progress"]
        args.n = 2
        args.out = str(common.QUICK_DIR / "eval_parallel.json")
    base = ["eval", "--model", model, *grid, "--n", str(args.n)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(common.ROOT)}
    info = common.machine_info()
    if not args.no_warm:  # converts the default model once, warms the disk cache
        _run([*base, "--n", "1", "--out", str(work / "warm")], env)

    one = _run([*base, "--out", str(work / "p1")], env)
    many = _run([*base, "--out", str(work / f"p{args.workers}"), "--workers", str(args.workers)], env)
    a, b = (json.loads((work / d / "results.json").read_text()) for d in ("p1", f"p{args.workers}"))
    same = {key: a[key] == b[key] for key in a if key not in ("seconds", "command")}
    samples = len({r["sample"] for r in a["records"]})
    payload = {
        "benchmark": "eval_parallel", "date": common.now_iso(), "machine": info,
        "loadavg_at_end": list(os.getloadavg()), "command_1": ["kvpress-ada", *base],
        "workers": args.workers, "samples": samples, "configurations": len(a["summary"]),
        "wall_s_1": one, f"wall_s_{args.workers}": many,
        "eval_seconds_1": a["seconds"], f"eval_seconds_{args.workers}": b["seconds"],
        "throughput_ratio": one / many, "eval_throughput_ratio": a["seconds"] / b["seconds"],
        "results_equal_except_seconds": all(same.values()), "fields_compared": same,
    }
    path = common.write_json(args.out, payload)
    print(f"{samples} samples x {len(a['summary'])} cells: 1 process {one:.1f}s, {args.workers} processes {many:.1f}s "
          f"(x{one / many:.2f} throughput end to end; x{a['seconds'] / b['seconds']:.2f} evaluation only); "
          f"results equal except seconds: {all(same.values())}; load average {info['loadavg_at_start']} -> "
          f"{payload['loadavg_at_end']}\nwrote {path}")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
