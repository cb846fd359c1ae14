"""Quality vs compression ratio for every preset, question-agnostic and question-aware.

Runs the fan-out evaluator (one prefill per sample, every preset x ratio derived from it) on
the default model and the synthetic task suite, and writes per setting:
``benchmarks/results/quality_<setting>.json`` and ``quality_<setting>.png`` (accuracy with a
95% CI vs ratio, one line per preset), plus the Ada-vs-uniform comparison the issue asks for.

    python benchmarks/quality.py                       # full grid (hours on 2 CPU cores)
    python benchmarks/quality.py --quick                # smoke run (2 short samples)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PRESETS = ("snapkv,ada_snapkv,pyramidkv,ada_pyramidkv,expected_attention,ada_expected_attention,streamingllm,"
           "criticalkv,ada_criticalkv")
PAIRS = [("snapkv", "ada_snapkv"), ("pyramidkv", "ada_pyramidkv"), ("expected_attention", "ada_expected_attention"),
         ("criticalkv", "ada_criticalkv")]


def ada_vs_uniform(summary: list[dict], ratios=(0.5, 0.75)) -> list[dict]:
    """Accuracy of each Ada variant minus its uniform counterpart, averaged over ``ratios``."""
    acc = {(r["label"], r["ratio"]): r["accuracy"] for r in summary}
    rows = []
    for uniform, ada in PAIRS:
        deltas = [acc[(ada, r)] - acc[(uniform, r)] for r in ratios if (ada, r) in acc and (uniform, r) in acc]
        if deltas:
            delta = sum(deltas) / len(deltas)
            silent = all(acc[(name, r)] == 0 for name in (ada, uniform) for r in ratios if (name, r) in acc)
            verdict = "no signal (both at 0)" if silent else ("PASS" if delta >= 0 else "MISS")
            rows.append({"uniform": uniform, "ada": ada, "ratios": list(ratios), "delta": delta, "verdict": verdict})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--ratios", default="0.25,0.5,0.75,0.9")
    parser.add_argument("--tasks", default="passkey,multikey,multivalue,multiquery")
    parser.add_argument("--n", type=int, default=16, help="samples per task (cell n = n x tasks)")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--settings", default="agnostic,aware", help="question-agnostic and/or question-aware")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core box)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 presets, 2 ratios, 2 short samples")
    parser.add_argument("--out", default=str(common.RESULTS))
    args = parser.parse_args(argv)

    from kvpress_ada.eval.report import format_table, plot_accuracy
    from kvpress_ada.eval.runner import evaluate, grid
    from kvpress_ada.eval.tasks import make_samples

    common.set_threads(args.threads)
    model_name = "default"
    model, tok = common.load_model(model_name)
    presets = "snapkv,ada_snapkv" if args.quick else args.presets
    ratios = [float(r) for r in ("0.5,0.75" if args.quick else args.ratios).split(",")]
    tasks = ["passkey"] if args.quick else args.tasks.split(",")
    n = 2 if args.quick else args.n
    context = 300 if args.quick else args.context
    out = Path(common.QUICK_DIR if args.quick else args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples = [s for t in tasks for s in make_samples(t, tok, n, context, seed=0)]
    entries = grid(presets.split(","), ratios)
    for setting in args.settings.split(","):
        start = time.perf_counter()
        result = evaluate(model, tok, samples, entries, question_aware=setting == "aware",
                          max_new_tokens=args.max_new_tokens)
        summary = result.summary()
        comparison = ada_vs_uniform(summary)
        print(f"\n== {setting} ==\n{format_table(summary)}")
        for row in comparison:
            print(f"{row['ada']} - {row['uniform']} at r in {row['ratios']}: {row['delta']:+.3f} ({row['verdict']})")
        payload = {"machine": common.machine_info(), "date": common.now_iso(), "model": model_name,
                   "tasks": tasks, "n_per_task": n, "context": context, "setting": setting,
                   "wall_seconds": time.perf_counter() - start, "ada_vs_uniform": comparison,
                   "summary": summary, "records": result.to_dict()["records"]}
        common.write_json(out / f"quality_{setting}.json", payload)
        plot_accuracy(summary, out / f"quality_{setting}.png",
                      title=f"{model_name}, {','.join(tasks)}, {context} tokens, question-{setting}, n={len(samples)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
