"""Quality vs compression ratio for every preset, question-agnostic and question-aware.

Runs the fan-out evaluator (one prefill per sample, every preset x ratio derived from it) on
the default model and the synthetic task suite, and writes per setting:
``benchmarks/results/quality_<setting>.json`` and ``quality_<setting>.png`` (accuracy with a
95% CI vs ratio, one line per preset), plus the Ada-vs-uniform comparison.

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


def _write(path: Path, machine: dict, config: dict, setting: str, records: list, seconds: float,
           complete: bool) -> list[dict]:
    """Write the setting's JSON (a checkpoint while ``complete`` is false) and return its summary."""
    from dataclasses import asdict

    from kvpress_ada.harness.eval.runner import EvalResult

    summary = EvalResult(records, seconds, setting == "aware").summary()
    payload = {"machine": machine, "date": common.now_iso(), **config, "setting": setting,
               "complete": complete, "samples_done": len({r.sample for r in records}),
               "wall_seconds": seconds, "ada_vs_uniform": ada_vs_uniform(summary),
               "summary": summary, "records": [asdict(r) for r in records]}
    common.write_json(path, payload)
    return summary


def _resume(path: Path, config: dict, record_type) -> tuple[list, float]:
    """Records and seconds of an earlier run of the same configuration, or nothing."""
    import json

    if not path.exists():
        return [], 0.0
    old = json.loads(path.read_text())
    if any(old.get(key) != value for key, value in config.items()):
        print(f"[resume] {path} has another configuration; starting over", file=sys.stderr)
        return [], 0.0
    records = [record_type(**r) for r in old["records"]]
    print(f"[resume] {old['samples_done']} samples from {path}", file=sys.stderr)
    return records, float(old["wall_seconds"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=PRESETS, help="comma-separated presets ('' for none)")
    parser.add_argument("--config", action="append", default=[],
                        help="a pipeline file (JSON or YAML, as `kvpress-ada eval --config`); its row label is the "
                             "file name; repeatable")
    parser.add_argument("--ratios", default="0.25,0.5,0.75,0.9")
    parser.add_argument("--tasks", default="passkey,multikey,multivalue,multiquery")
    parser.add_argument("--n", type=int, default=16, help="samples per task (cell n = n x tasks)")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--settings", default="agnostic,aware", help="question-agnostic and/or question-aware")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core box)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 presets, 2 ratios, 2 short samples")
    parser.add_argument("--out", default=str(common.RESULTS))
    parser.add_argument("--checkpoint-every", type=int, default=4,
                        help="rewrite the JSON (marked complete: false) after this many samples")
    parser.add_argument("--resume", action="store_true",
                        help="keep the samples already in an incomplete JSON of the same configuration")
    args = parser.parse_args(argv)

    from kvpress_ada.harness.cli import UsageError, _config_label, _load_config
    from kvpress_ada.harness.eval.report import format_table, plot_accuracy
    from kvpress_ada.harness.eval.runner import Record, evaluate, grid
    from kvpress_ada.harness.eval.tasks import make_samples

    # pipeline files are checked before the model loads, so a bad one fails at once
    presets = "snapkv,ada_snapkv" if args.quick else args.presets
    names = [p for p in presets.split(",") if p]
    try:
        configs = {_config_label(path, names): _load_config(path) for path in args.config}
    except UsageError as err:
        parser.error(str(err))
    if not names and not configs:
        parser.error("give --presets and/or --config")
    common.set_threads(args.threads)
    model_name = "default"
    model, tok = common.load_model(model_name)
    ratios = [float(r) for r in ("0.5,0.75" if args.quick else args.ratios).split(",")]
    tasks = ["passkey"] if args.quick else args.tasks.split(",")
    n = 2 if args.quick else args.n
    context = 300 if args.quick else args.context
    out = Path(common.QUICK_DIR if args.quick else args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Round-robin over tasks, so a run stopped early still covers every task equally.
    per_task = [make_samples(t, tok, n, context, seed=0) for t in tasks]
    samples = [s for group in zip(*per_task) for s in group]
    entries = grid(names, ratios) + grid(configs, ratios)
    config = {"model": model_name, "tasks": tasks, "n_per_task": n, "context": context,
              "presets": names + list(configs), "ratios": ratios, "max_new_tokens": args.max_new_tokens}
    if configs:
        config["configs"] = {label: press.model_dump(exclude={"compression_ratio", "budget"})
                             for label, press in configs.items()}
    machine = common.machine_info()
    for setting in args.settings.split(","):
        path = out / f"quality_{setting}.json"
        records, seconds = _resume(path, config, Record) if args.resume else ([], 0.0)
        done = {r.sample for r in records}
        start = time.perf_counter()

        def checkpoint(i, new):
            records.extend(new)
            done.add(i)
            if len(done) % args.checkpoint_every == 0 and len(done) < len(samples):
                _write(path, machine, config, setting, records, seconds + time.perf_counter() - start, complete=False)

        evaluate(model, tok, samples, entries, question_aware=setting == "aware", max_new_tokens=args.max_new_tokens,
                 skip=frozenset(done), on_sample=checkpoint)
        seconds += time.perf_counter() - start
        summary = _write(path, machine, config, setting, records, seconds, complete=len(done) == len(samples))
        print(f"\n== {setting} ==\n{format_table(summary)}")
        for row in ada_vs_uniform(summary):
            print(f"{row['ada']} - {row['uniform']} at r in {row['ratios']}: {row['delta']:+.3f} ({row['verdict']})")
        plot_accuracy(summary, out / f"quality_{setting}.png",
                      title=f"{model_name} model, {len(tasks)} tasks, {context} tokens, question-{setting}, "
                            f"n={len(done)} per cell")
    return 0


if __name__ == "__main__":
    sys.exit(main())
