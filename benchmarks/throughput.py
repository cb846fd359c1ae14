"""Evaluation throughput: wall time of a presets x ratios grid with fan-out vs one prefill per
configuration, on the same samples (answers are checked identical).

    python benchmarks/throughput.py            # 2 presets x 3 ratios, 4 samples, default model
    python benchmarks/throughput.py --quick    # smoke run (2 short samples)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="snapkv,ada_snapkv")
    parser.add_argument("--ratios", default="0.25,0.5,0.75")
    parser.add_argument("--n", type=int, default=4, help="passkey samples")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 short samples")
    parser.add_argument("--out", default=str(common.RESULTS / "throughput.json"))
    args = parser.parse_args(argv)

    from kvpress_ada.harness.eval.runner import evaluate, evaluate_separately, grid
    from kvpress_ada.harness.eval.tasks import make_samples

    common.set_threads(args.threads)
    model, tok = common.load_model("default")
    context = 300 if args.quick else args.context
    samples = make_samples("passkey", tok, 2 if args.quick else args.n, context, seed=1)
    entries = grid(args.presets.split(","), [float(r) for r in args.ratios.split(",")])
    t0 = time.perf_counter()
    fanned = evaluate(model, tok, samples, entries, max_new_tokens=args.max_new_tokens)
    t_fan = time.perf_counter() - t0
    t0 = time.perf_counter()
    separate = evaluate_separately(model, tok, samples, entries, max_new_tokens=args.max_new_tokens)
    t_sep = time.perf_counter() - t0
    identical = all([r.answer for r in fanned.records if r.sample == i and r.label != "full"] == row
                    for i, row in enumerate(separate))
    payload = {"machine": common.machine_info(), "date": common.now_iso(), "samples": len(samples),
               "context": context, "configurations": len(entries), "fanout_seconds": t_fan,
               "separate_seconds": t_sep, "speedup": t_sep / t_fan, "answers_identical": identical,
               "note": "fan-out also computes the full-cache answer, fidelity and eviction loss; "
                       "the separate runs compute answers only"}
    common.write_json(args.out, payload)
    print(f"{len(samples)} samples x {len(entries)} configurations: fan-out {t_fan:.1f}s, separate {t_sep:.1f}s "
          f"-> {t_sep / t_fan:.2f}x, answers identical: {identical}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
