"""Quality against bytes held: presses x ratios x storage (full precision, int8, int4), both question settings.

The fan-out evaluator (one prefill per sample; every press x ratio x storage derived from it) on a model and
the synthetic task suite. Rows are labelled ``<preset>/<storage>``; ratio 0 rows with int8 / int4 are "no
eviction, quantized only". Per setting it writes ``storage_quality_<setting>.json`` (records, summary, and
the paired difference of each quantized press against the same press in full precision: mean over the
same samples with a 95% CI) and ``storage_quality_<setting>.png`` (accuracy against the bytes held as a
fraction of the full cache's, measured per sample, one line per press and storage).

Checkpointed after every sample; ``--resume`` keeps the samples of an incomplete JSON of the same
configuration (stop it any time, run it again with ``--resume``).

    python benchmarks/storage_quality.py                                 # the default model's grid (hours)
    python benchmarks/storage_quality.py --model qwen2.5-coder-0.5b --context 4000 --tasks passkey,multikey
    python benchmarks/storage_quality.py --quick                         # smoke run (2 short samples)
    python benchmarks/storage_quality.py --pool A.json B.json            # paired differences over both runs' samples
    python benchmarks/storage_quality.py --pool A.json --versus kvzap/int4@0.9 kvzip/full@0.95 ...  # cell vs cells
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PRESETS = "kvzap,kvzip,ada_kvzip,ada_snapkv,streamingllm"
STORAGES = ("full", "int8", "int4")


def entries_for(presets: list[str], ratios: list[float], storages: list[str], configs: dict | None = None) -> list:
    """One entry per press x ratio x storage, plus ratio 0 (no eviction) for each quantized storage; presses are
    presets by name and ``configs`` (``{label: Pipeline}``, e.g. a model's own KVzap surrogate)."""
    from kvpress_ada.harness.eval.runner import Entry
    from kvpress_ada.presets import preset

    def press(name: str, ratio: float, storage: str):
        if configs and name in configs:
            return configs[name].replace(compression_ratio=ratio, budget=None, storage=storage)
        return preset(name, compression_ratio=ratio, storage=storage)

    out = []
    for name in [*presets, *(configs or {})]:
        for storage in storages:
            for ratio in ([0.0] if storage != "full" else []) + ratios:
                out.append(Entry(f"{name}/{storage}", ratio, press(name, ratio, storage)))
    return out


def paired(records: list) -> list[dict]:
    """Each quantized press minus the same press in full precision at the same ratio (ratio 0: minus the full
    cache), over the samples both ran: mean and 95% CI."""
    score = {(r.sample, r.label, r.ratio): r.score for r in records}
    cells = sorted({(r.label, r.ratio) for r in records if r.label.partition("/")[2] not in ("", "full")})
    rows = []
    for label, ratio in cells:
        base = (f"{label.partition('/')[0]}/full", ratio) if ratio > 0 else ("full", 0.0)
        samples = sorted({r.sample for r in records if (r.label, r.ratio) == (label, ratio)})
        diffs = [score[(s, label, ratio)] - score[(s, *base)] for s in samples if (s, *base) in score]
        if not diffs:
            continue
        mean = statistics.fmean(diffs)
        half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        rows.append({"label": label, "ratio": ratio, "against": base[0], "n": len(diffs), "delta": mean,
                     "ci95": [mean - half, mean + half]})
    return rows


def _difference(records: list, a: tuple[str, float], b: tuple[str, float]) -> dict | None:
    """Cell ``a`` minus cell ``b`` (``(label, ratio)``) over the samples both ran: mean and 95% CI."""
    score = {(r.sample, r.label, r.ratio): r.score for r in records}
    samples = sorted({r.sample for r in records})
    diffs = [score[(s, *a)] - score[(s, *b)] for s in samples if (s, *a) in score and (s, *b) in score]
    if not diffs:
        return None
    mean = statistics.fmean(diffs)
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return {"label": a[0], "ratio": a[1], "against": f"{b[0]} r={b[1]:.2f}", "n": len(diffs), "delta": mean,
            "ci95": [mean - half, mean + half]}


def pool(paths: list[str], versus: list[str] | None = None) -> list[dict]:
    """:func:`paired` over the records of several runs (e.g. both question settings), each run's samples apart;
    with ``versus`` (``["LABEL@RATIO", ...]``), the first cell against each of the others instead."""
    records = []
    for i, path in enumerate(paths):
        for r in json.loads(Path(path).read_text())["records"]:
            records.append(SimpleNamespace(sample=(i, r["sample"]), label=r["label"], ratio=r["ratio"],
                                           score=r["score"]))
    if not versus:
        return paired(records)
    cells = [(spec.rpartition("@")[0], float(spec.rpartition("@")[2])) for spec in versus]
    rows = [_difference(records, cells[0], other) for other in cells[1:]]
    return [row for row in rows if row is not None]


def _print_paired(rows: list[dict]) -> None:
    for row in rows:
        print(f"{row['label']:>24} r={row['ratio']:.2f} - {row['against']}: {row['delta']:+.3f} "
              f"[{row['ci95'][0]:+.3f}, {row['ci95'][1]:+.3f}] (n={row['n']})")


def _write(path: Path, payload: dict, records: list, seconds: float, complete: bool,
           question_aware: bool) -> list[dict]:
    from dataclasses import asdict

    from kvpress_ada.harness.eval.runner import EvalResult

    summary = EvalResult(records, seconds, question_aware).summary()
    common.write_json(path, {**payload, "date": common.now_iso(), "complete": complete,
                             "samples_done": len({r.sample for r in records}), "wall_seconds": seconds,
                             "paired_vs_full_precision": paired(records), "summary": summary,
                             "records": [asdict(r) for r in records]})
    return summary


def _resume(path: Path, config: dict, record_type) -> tuple[list, float]:
    import json

    if not path.exists():
        return [], 0.0
    old = json.loads(path.read_text())
    if old.get("config") != config:
        print(f"[resume] {path} has another configuration; starting over", file=sys.stderr)
        return [], 0.0
    print(f"[resume] {old['samples_done']} samples from {path}", file=sys.stderr)
    return [record_type(**r) for r in old["records"]], float(old["wall_seconds"])


def plot(summary: list[dict], path: Path, title: str) -> None:
    """Accuracy against the fraction of the full cache's bytes held, one line per press and storage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    lines: dict[str, list] = {}
    for row in summary:
        if row["label"] != "full":
            lines.setdefault(row["label"], []).append((row["kv_fraction"], row["accuracy"]))
    styles = {"full": "-", "int8": "--", "int4": ":"}
    for label, points in sorted(lines.items()):
        points.sort()
        ax.plot(*zip(*points), styles.get(label.partition("/")[2], "-"), marker="o", label=label)
    full = next((r["accuracy"] for r in summary if r["label"] == "full"), None)
    if full is not None:
        ax.axhline(full, color="black", lw=0.8, label="full cache")
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes held / full cache bytes (measured)")
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    from kvpress_ada.harness.eval.report import save_figure

    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", choices=[m for m in common.MODEL_CHOICES if m != "tiny"])
    parser.add_argument("--presets", default=PRESETS, help="comma-separated presets ('' for none)")
    parser.add_argument("--config", nargs="*", default=[], metavar="YAML",
                        help="Pipeline files run beside the presets, labelled by file name (e.g. a model's KVzap)")
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--storages", default=",".join(STORAGES))
    parser.add_argument("--tasks", default="passkey,multikey,multivalue,multiquery")
    parser.add_argument("--n", type=int, default=16, help="samples per task (cell n = n x tasks)")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--settings", default="agnostic,aware", help="question-agnostic and/or question-aware")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(common.RESULTS))
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 presets, 1 ratio, 2 short samples")
    parser.add_argument("--pool", nargs="+", metavar="JSON", help="print the paired differences over the records of "
                        "these runs (written by this script, records kept) and exit")
    parser.add_argument("--versus", nargs="+", metavar="LABEL@RATIO",
                        help="with --pool: the first cell (e.g. kvzap/int4@0.9) against each of the others")
    args = parser.parse_args(argv)
    if args.pool:
        _print_paired(pool(args.pool, args.versus))
        return 0
    if args.quick:
        args.presets, args.ratios, args.tasks = "ada_snapkv,streamingllm", "0.75", "passkey"
        args.n, args.context, args.settings, args.out = 2, 300, "agnostic", str(common.QUICK_DIR)

    from kvpress_ada.harness.eval.report import format_table
    from kvpress_ada.harness.eval.runner import Record, evaluate
    from kvpress_ada.harness.eval.tasks import make_samples

    common.set_threads(args.threads)
    presets, storages = [p for p in args.presets.split(",") if p], args.storages.split(",")
    import yaml

    from kvpress_ada.pipeline import Pipeline

    configs = {Path(c).stem: Pipeline.model_validate(yaml.safe_load(Path(c).read_text())) for c in args.config}
    ratios = [float(r) for r in args.ratios.split(",")]
    tasks = args.tasks.split(",")
    model, tok = common.load_model(args.model)
    per_task = [make_samples(t, tok, args.n, args.context, seed=0) for t in tasks]
    samples = [s for group in zip(*per_task) for s in group]  # round robin: a partial run covers every task
    entries = entries_for(presets, ratios, storages, configs)
    config = {"model": args.model, "tasks": tasks, "n_per_task": args.n, "context": args.context,
              "presets": presets + list(configs),
              "ratios": ratios, "storages": storages, "max_new_tokens": args.max_new_tokens}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = common.machine_info()
    print(f"{len(samples)} samples x {len(entries)} entries per setting", file=sys.stderr)
    for setting in args.settings.split(","):
        aware = setting == "aware"
        path = out / f"storage_quality_{setting}.json"
        payload = {"benchmark": "storage_quality", "command": " ".join([common.python(), *sys.argv]),
                   "machine": machine, "config": config, "setting": setting}
        records, seconds = _resume(path, config, Record) if args.resume else ([], 0.0)
        done = {r.sample for r in records}
        start = time.perf_counter()

        def checkpoint(i, new, path=path, payload=payload, records=records, done=done, start=start,
                       before=seconds, aware=aware):
            records.extend(new)
            done.add(i)
            _write(path, payload, records, before + time.perf_counter() - start, False, aware)

        evaluate(model, tok, samples, entries, question_aware=aware, max_new_tokens=args.max_new_tokens,
                 skip=frozenset(done), on_sample=checkpoint)
        seconds += time.perf_counter() - start
        summary = _write(path, payload, records, seconds, len(done) == len(samples), aware)
        print(f"\n== {setting} ==\n{format_table(summary)}")
        _print_paired(paired(records))
        plot(summary, out / f"storage_quality_{setting}.png",
             f"{args.model}, {len(tasks)} tasks, {args.context} tokens, question-{setting}, n={len(done)} per cell")
    return 0


if __name__ == "__main__":
    sys.exit(main())
