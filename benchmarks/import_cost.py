"""What importing the library, building a press and asking the CLI for help cost: wall seconds of fresh
processes (median and min of ``--runs``) and the modules each one imports, with the heavy packages among
them. ``--before DIR`` measures an older checkout too (put first on ``PYTHONPATH``), each case's runs
alternating between the two so that both see the same load:

    mkdir /tmp/before && git archive <commit> | tar -x -C /tmp/before
    python benchmarks/import_cost.py --runs 5 --before /tmp/before
    python benchmarks/import_cost.py --quick       # one run of each, written to a temporary folder
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

HEAVY = ("torch", "pydantic", "transformers", "triton", "vllm")
POLICY = "import kvpress_ada\nkvpress_ada.preset('ada_snapkv', compression_ratio=0.5)"
HELP = "from kvpress_ada.harness.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
# each case: the command timed, and python code doing the same in-process (to read its sys.modules)
CASES = {
    "import kvpress_ada": ([sys.executable, "-c", "import kvpress_ada"], "import kvpress_ada"),
    "import kvpress_ada; build a press": ([sys.executable, "-c", POLICY], POLICY),
    "kvpress-ada --help": ([shutil.which("kvpress-ada") or "kvpress-ada", "--help"], HELP),
}
# a neutral working directory: `python -c` puts it first on sys.path, before PYTHONPATH
CWD = tempfile.gettempdir()
REPORT = "import sys, json\n{code}\nprint(json.dumps([len(sys.modules), [m for m in {heavy!r} if m in sys.modules]]))"


def _env(checkout: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join([checkout, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _seconds(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env, cwd=CWD)
    return time.perf_counter() - start


def _modules(code: str, env: dict) -> tuple[int, list[str]]:
    out = subprocess.run([sys.executable, "-c", REPORT.format(code=code, heavy=HEAVY)], check=True,
                         capture_output=True, text=True, env=env, cwd=CWD).stdout.splitlines()[-1]
    modules, heavy = json.loads(out)
    return modules, heavy


def measure(runs: int, checkouts: dict[str, str | None]) -> dict:
    """``{case: {checkout label: {median_s, min_s, modules, heavy}}}``."""
    result: dict = {}
    for case, (command, code) in CASES.items():
        seconds: dict[str, list[float]] = {label: [] for label in checkouts}
        for _ in range(runs):
            for label, checkout in checkouts.items():
                seconds[label].append(_seconds(command, _env(checkout)))
        result[case] = {}
        for label, checkout in checkouts.items():
            modules, heavy = _modules(code, _env(checkout))
            result[case][label] = {"median_s": round(statistics.median(seconds[label]), 3),
                                   "min_s": round(min(seconds[label]), 3), "modules": modules, "heavy": heavy}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="\n".join(__doc__.splitlines()[4:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="fresh processes timed per case and checkout")
    parser.add_argument("--before", help="an older checkout's root, measured alongside this one")
    parser.add_argument("--quick", action="store_true", help="one run of each, written to a temporary folder")
    parser.add_argument("--out", default=str(common.RESULTS / "import_cost.json"))
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if args.before is not None and not (Path(args.before) / "kvpress_ada" / "__init__.py").is_file():
        parser.error(f"--before {args.before}: no kvpress_ada package there")
    checkouts: dict[str, str | None] = {"after": None} if args.before is None else {"before": args.before,
                                                                                    "after": None}
    machine = common.machine_info()
    result = measure(1 if args.quick else args.runs, checkouts)
    out = common.QUICK_DIR / "import_cost.json" if args.quick else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine, "runs": 1 if args.quick else args.runs, "before": args.before,
               "loadavg_at_end": list(os.getloadavg()), "cases": result}
    out.write_text(common.dumps_json(payload) + "\n")
    print(f"| case | {' | '.join(f'{label}: median / min s, modules' for label in checkouts)} |")
    print(f"|---|{'---|' * len(checkouts)}")
    for case, rows in result.items():
        cells = [f"{r['median_s']:.2f} / {r['min_s']:.2f} s, {r['modules']:,} ({', '.join(r['heavy']) or 'none heavy'})"
                 for r in rows.values()]
        print(f"| `{case}` | {' | '.join(cells)} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
