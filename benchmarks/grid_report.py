"""Grid report: accuracy per preset and ratio (question-agnostic or question-aware, as the inputs
were run), paired comparisons, KV bytes held and KV bytes read per decode step (``read MB``, the
records' ``read_bytes_per_step``: ``-`` for records that did not measure it, e.g. older files).

Reads one or more ``quality_<setting>.json`` files written by ``benchmarks/quality.py``, or
``results.json`` / ``partial.json`` (a checkpoint) of ``kvpress-ada eval`` (runs over the same samples,
e.g. a second run adding presets; records pair by task and sample index), and writes ``report.json``
with the accuracy table (overall with the per-layer eviction loss and hidden-state error, per task without
them), the paired 95% CIs of ``--pairs`` and the targets' verdicts, next to an accuracy plot (and, with
``--plot-reads``, accuracy by bytes read per step: for grids with a reader). No per-sample records are written.

    python benchmarks/grid_report.py benchmarks/results/grid_kvzip/quality_agnostic.json [more.json] \
        --out benchmarks/results/grid_report_agnostic
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PAIRS = ("kvzip:streamingllm,ada_kvzip:streamingllm,kvzip:kvzip_layerwise,ada_kvzip:kvzip,"
         "ada_kvzip:kvzip_layerwise,kvzip_plus:kvzip,calibrated_streamingllm:streamingllm,ada_lagkv:lagkv,"
         "lagkv:streamingllm,full:kvzip,full:ada_kvzip")


def merge(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """Records of every file (a later file's record replaces an earlier one for the same cell) and sources."""
    cells: dict[tuple, dict] = {}
    sources = []
    for path in paths:
        data = json.loads(path.read_text())
        meta = {**data.get("settings", {}), **data}  # `kvpress-ada eval`'s checkpoint keeps them under "settings"
        setting = meta.get("setting") or ("aware" if meta.get("question_aware") else "agnostic")
        sources.append({"path": str(path), "complete": meta.get("complete", "settings" not in data),
                        "samples_done": meta.get("samples_done"), "presets": meta.get("presets"),
                        "ratios": meta.get("ratios"), "tasks": meta.get("tasks"), "context": meta.get("context"),
                        "setting": setting, "model": meta.get("model"), "seconds": meta.get("seconds"),
                        "machine": meta.get("machine", {}).get("cpu")})
        for r in data["records"]:
            cells[(r["label"], r["ratio"], r["task"], r["sample"])] = r
    return list(cells.values()), sources


PER_LAYER = ("eviction_loss_per_layer", "hidden_error_per_layer")


def without_per_layer(rows: list[dict]) -> list[dict]:
    """Summary rows without their per-layer arrays (the per-task tables: the overall table keeps them)."""
    return [{k: v for k, v in row.items() if k not in PER_LAYER} for row in rows]


def plot_reads(summary: list[dict], path: Path, title: str) -> Path | None:
    """Accuracy (95% CI) against the KV bytes read per decode step, one labelled point per (label, ratio) that
    measured it; rows without a reader or an eviction read what they hold (the full cache: its KV bytes, dashed).
    ``None`` (nothing written) when no row measured its reads or matplotlib is missing."""
    rows = [s for s in summary if s.get("read_bytes_per_step")]
    if not rows:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for s in rows:
        x = s["read_bytes_per_step"] / 2**20
        ax.errorbar([x], [s["accuracy"]], yerr=[s["ci95"]], fmt="o", capsize=3)
        ax.annotate(f"{s['label']}@{s['ratio']:g}", (x, s["accuracy"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    full = next((s for s in summary if s["label"] == "full"), None)
    if full is not None:
        ax.axhline(full["accuracy"], color="k", linestyle=":", label="full cache")
        ax.axvline(full["kv_bytes"] / 2**20, color="k", linestyle="--", linewidth=0.8,
                   label="full cache's KV (what it reads)")
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes read per decode step (MiB, measured)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--pairs", default=PAIRS, help="comma-separated a:b (accuracy of a minus b, paired, at "
                                                       "every ratio) or a@r:b@s (one pair at those ratios)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot-reads", action="store_true",
                        help="also write report_reads.png (accuracy by KV bytes read per decode step): for grids with "
                             "a reader; without one every row reads what it holds")
    args = parser.parse_args(argv)

    from kvpress_ada.harness.eval.report import format_table, paired_difference, plot_accuracy
    from kvpress_ada.harness.eval.runner import EvalResult, Record

    records, sources = merge(args.inputs)
    summary = EvalResult([Record(**r) for r in records], 0.0, False).summary()
    tasks = sorted({r["task"] for r in records})
    by_task = {task: without_per_layer(EvalResult([Record(**r) for r in records if r["task"] == task], 0.0,
                                                  False).summary())
               for task in tasks} if len(tasks) > 1 else {}
    ratios = sorted({r["ratio"] for r in records if r["label"] != "full"})
    pairs = []
    for pair in args.pairs.split(","):
        a, b = pair.split(":")
        if "@" in a and "@" in b:  # label@ratio:label@ratio: one pair at those ratios (threshold vs a fixed ratio)
            (a, at), (b, bt) = a.split("@"), b.split("@")
            found = paired_difference(records, a, b, float(at), float(bt))
            pairs += [found] if found is not None else []
            continue
        pairs += [d for d in (paired_difference(records, a, b, ratio) for ratio in ratios) if d is not None]
    # our best composition per ratio (highest accuracy; ties: fewer bytes), against StreamingLLM and the full cache
    best = []
    for ratio in ratios:
        rows = [s for s in summary if s["ratio"] == ratio and s["label"] != "full"]
        if not rows:
            continue
        top = max(rows, key=lambda s: (s["accuracy"], -s["kv_fraction"]))
        best.append({"ratio": ratio, "label": top["label"], "accuracy": top["accuracy"],
                     "kv_fraction": top["kv_fraction"], "bytes_bound": (1 - ratio) + 0.03,
                     "read_bytes_per_step": top.get("read_bytes_per_step"),
                     "vs_streamingllm": paired_difference(records, top["label"], "streamingllm", ratio),
                     "vs_full": paired_difference(records, top["label"], "full", ratio)})
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / "report.json", common.rounded({  # 5 significant digits: a summary, not records
        "date": common.now_iso(), "sources": sources, "summary": summary, "summary_by_task": by_task, "paired": pairs,
        "best": best}))
    title = (f"question-{sources[0].get('setting') or 'agnostic'}, {', '.join(sources[0]['tasks'] or [])},\n"
             f"{sources[0]['context']} tokens (merged: {len(sources)} runs)")
    plot_accuracy(summary, args.out / "report.png", title=title)
    if args.plot_reads:
        plot_reads(summary, args.out / "report_reads.png", title)
    print(format_table(summary))
    for task, rows in by_task.items():
        print(f"\n{task}:\n{format_table(rows)}")
    print("\npaired (a - b, 95% CI):")
    for p in pairs:
        at = f"r={p['ratio']:.2f}" + (f" vs {p['ratio_b']:.2f}" if "ratio_b" in p else "")
        print(f"  {p['a']:>24} - {p['b']:<24} {at} n={p['n']:>3} {p['delta']:+.3f} ± {p['ci95']:.3f}"
              f"  {p['verdict']}")
    for b in best:
        read = "-" if b["read_bytes_per_step"] is None else f"{b['read_bytes_per_step'] / 2**20:.3f}"
        print(f"best at r={b['ratio']:.2f}: {b['label']} {b['accuracy']:.3f}, KV {b['kv_fraction']:.3f} of full "
              f"(bound {b['bytes_bound']:.2f}), read {read} MiB per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
