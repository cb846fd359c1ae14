"""Compression overhead at prefill: wall time of a prefill with a press (dense attention +
scoring + allocation + compaction, layer by layer) vs the same prefill without one.

    python benchmarks/overhead.py                 # 4k context, snapkv and ada_snapkv at r=0.75
    python benchmarks/overhead.py --quick         # 512-token smoke run

Runs are interleaved (none, snapkv, ada_snapkv, none, ...) and the median of ``--reps`` is kept;
the target is an overhead <= 5% of prefill at 4k, and <= 2.2x the plain prefill (+120%) for a
scorer that runs a model pass of its own (KVzip's reconstruction):

    python benchmarks/overhead.py --presets snapkv,kvzip --out benchmarks/results/overhead_kvzip.json

The plain prefill is ``model(input_ids)``, logits for every position; ``--last-logits`` measures
the prefill as ``generate()`` runs it (logits of the last position only), a smaller denominator.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--presets", default="snapkv,ada_snapkv")
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="512-token smoke run, 1 repetition")
    parser.add_argument("--last-logits", action="store_true",
                        help="prefill as generate() runs it: logits of the last position only "
                             "(default: model(input_ids) with logits for every position)")
    parser.add_argument("--out", default=str(common.RESULTS / "overhead.json"))
    args = parser.parse_args(argv)

    import torch

    from kvpress_ada import preset

    common.set_threads(args.threads)
    model, tok = common.load_model("default")
    context = 512 if args.quick else args.context
    reps = 1 if args.quick else args.reps
    ids = common.context_ids(tok, context)
    configs = {"none": None, **{name: preset(name, compression_ratio=args.ratio) for name in args.presets.split(",")}}
    times: dict[str, list[float]] = {name: [] for name in configs}
    logits = {"logits_to_keep": 1} if args.last_logits else {}
    for _ in range(reps):
        for name, press in configs.items():
            with torch.inference_mode(), common.press_context(press, model):
                start = time.perf_counter()
                model(input_ids=ids, use_cache=True, **logits)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["none"])
    rows = {name: {"seconds": ts, "median_s": statistics.median(ts),
                   "overhead": statistics.median(ts) / base - 1.0} for name, ts in times.items()}
    for name, row in rows.items():
        press = configs[name]
        # one-pass presses: <= 5% of prefill; a scorer with its own model pass (KVzip): <= 2.2x prefill
        target = 1.2 if press is not None and type(press.scorer).needs_model_pass else 0.05
        row["target_overhead"] = target
        verdict = "" if press is None else ("PASS" if row["overhead"] <= target else "MISS")
        print(f"{name:<16} prefill {row['median_s']:.2f}s  overhead {row['overhead']:+.1%} "
              f"(target <= {target:+.0%}) {verdict}")
    common.write_json(args.out if not args.quick else common.QUICK_DIR / "overhead.json",
                      {"machine": common.machine_info(), "date": common.now_iso(), "context": context,
                       "ratio": args.ratio, "threads": args.threads, "reps": reps,
                       "logits": "last position" if args.last_logits else "every position", "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
