"""Press-by-press table against NVIDIA kvpress 0.5.5: for each preset with a kvpress press, the kept-set agreement
on the tiny test models (the recorded cases of ``benchmarks/kvpress_agreement.py``, ours computed now), the accuracy
of both libraries at one ratio on identical token ids and the KV bytes each holds (summaries written by
``benchmarks/kvpress_compare.py``); then every kvpress press without a row, and why.

Run from the repository root (about a minute: the agreement cases are recomputed on our side)::

    python benchmarks/press_table.py --ratio 0.75 --out benchmarks/results/press_table \
        --compare benchmarks/results/kvpress_compare_leverage_cur.summary.json \
                  benchmarks/results/kvpress_compare_agnostic.summary.json \
                  benchmarks/results/kvpress_compare.summary.json

A preset takes its accuracy from the first summary (in the order given) that holds both its row and its kvpress
counterpart's at the ratio, per setting; the table names that file. A preset that sets its own budget
(``kvpress_compare.RATIO_FREE``: a threshold, lazy layers, streaming heads) takes its cells at ratio 0 (no cap), marked
``own budget``. Writes ``OUT.json``, ``OUT.md`` (the table) and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

SETTINGS = ("agnostic", "aware")


def preset_of(label: str) -> str:
    """The preset an agreement case label checks (``snapkv/window16`` -> ``snapkv``)."""
    return label.split("/", 1)[0]


def agreement(check_results: dict[str, dict], cases: dict) -> dict[str, dict]:
    """Per preset: cases, exact (asserted) cases, identical (layer, kv head) rows over every case, mean Jaccard."""
    out: dict[str, dict] = {}
    for label, res in check_results.items():
        row = out.setdefault(preset_of(label), {"cases": 0, "exact": 0, "identical": 0, "rows": 0, "jaccard": [],
                                                "presses": []})
        case = cases[label]
        whole = res.get("all_layers", res)  # over every layer, also where only some are asserted
        row["cases"] += 1
        row["exact"] += int(case.exact)
        row["identical"] += whole["identical_heads"]
        row["rows"] += whole["heads"]
        row["jaccard"].append(whole["jaccard"])
        if case.press not in row["presses"]:
            row["presses"].append(case.press)
    for row in out.values():
        row["jaccard"] = sum(row["jaccard"]) / len(row["jaccard"])
    return out


def load_summaries(paths: list[Path]) -> list[tuple[str, dict]]:
    """``(name, summary)`` per readable file; a missing one is reported and skipped (a run not made yet)."""
    found = []
    for path in paths:
        if not path.exists():
            print(f"skipped (not found): {path}", file=sys.stderr)
            continue
        found.append((path.name, json.loads(path.read_text())))
    return found


def cell(summary: dict, library: str, method: str, ratio: float, setting: str) -> dict | None:
    for row in summary["table"]:
        if row["library"] == library and row["method"] == method and abs(row["ratio"] - ratio) < 1e-9:
            acc = row["accuracy"].get(setting)
            if acc is not None:
                return {"name": row["name"], **acc}
    return None


def accuracy(summaries: list[tuple[str, dict]], preset: str, counterpart: str, ratio: float,
             own_budget: bool = False) -> dict[str, dict]:
    """Per setting: ours and kvpress's cells (mean, ci95, n, kv_fraction) from the first summary holding both; at
    ratio 0 (no cap, marked ``own_budget``) for a preset that sets its own budget."""
    out = {}
    if own_budget:
        ratio = 0.0
    for setting in SETTINGS:
        for name, summary in summaries:
            ours = cell(summary, "kvpress_ada", preset, ratio, setting)
            theirs = cell(summary, "kvpress", counterpart, ratio, setting)
            if ours is not None and theirs is not None:
                out[setting] = {"source": name, "complete": bool(summary.get("complete")), "ours": ours,
                                "kvpress": theirs, **({"own_budget": True} if own_budget else {})}
                break
    return out


def build(ratio: float, summaries: list[tuple[str, dict]]) -> dict:
    import kvpress_agreement as ka
    import kvpress_compare as kc

    recorded = ka.load()
    cases = ka._cases()
    agreed = agreement(ka.check(recorded), cases)
    presets = sorted(set(agreed) | (set(kc.KVPRESS_NAMES) - {"full"}) | set(kc.KVPRESS_COUNTERPART))
    rows = []
    for preset in presets:
        counterpart = kc.kvpress_counterpart(preset) or preset
        kv_name = kc.KVPRESS_NAMES.get(counterpart)
        if kv_name is None and preset not in agreed:
            continue
        rows.append({"preset": preset, "kvpress": kv_name or ", ".join(agreed[preset]["presses"]),
                     "paired_with": counterpart if counterpart != preset else None,
                     "agreement": agreed.get(preset),
                     "accuracy": accuracy(summaries, preset, counterpart, ratio, preset in kc.RATIO_FREE)})
    covered = {p for row in rows for p in (row["agreement"] or {}).get("presses", [])}
    covered |= {press for name in kc.KVPRESS_NAMES.values() for press in re.findall(r"\w+Press", name)}
    without = {press: reason for table in (ka.NOT_HERE, ka.ELSEWHERE, ka.DIFFERENCES)
               for press, reason in table.items() if press not in covered}
    return {"ratio": ratio, "kvpress": recorded["versions"], "presses_kvpress_exports": recorded["presses"],
            "rows": rows, "without_row": dict(sorted(without.items())), "sources": [n for n, _ in summaries]}


def fmt_acc(cell_: dict | None) -> str:
    if not cell_:
        return "-"
    o, k = cell_["ours"], cell_["kvpress"]
    star = "" if cell_["complete"] else "*"
    own = ", own budget" if cell_.get("own_budget") else ""
    return f"{o['mean']:.2f} / {k['mean']:.2f} (n = {o['n']}{star}{own})"


def fmt_bytes(acc: dict) -> str:
    for setting in SETTINGS:
        if setting in acc:
            o, k = acc[setting]["ours"], acc[setting]["kvpress"]
            return f"{o['kv_fraction']:.2f} / {k['kv_fraction']:.2f}"
    return "-"


def markdown(report: dict) -> str:
    r = report["ratio"]
    lines = [f"| preset | kvpress press | kept sets (tiny models): exact cases, identical (layer, kv head) rows, "
             f"Jaccard | accuracy at r = {r}, agnostic: ours / kvpress | aware: ours / kvpress | KV held (of the "
             f"full cache): ours / kvpress | source |", "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        a = row["agreement"]
        if a:
            agree = f"{a['exact']}/{a['cases']}, {a['identical']}/{a['rows']}, {a['jaccard']:.3f}"
        elif row["paired_with"]:
            agree = f"no case: paired with `{row['paired_with']}`'s press"
        elif row["preset"].startswith("ada_"):
            agree = "no case: kvpress's AdaKV safeguard differs"
        else:
            agree = "no tiny-model case (kept sets in kvpress_compare.py)"
        sources = sorted({c["source"] for c in row["accuracy"].values()})
        lines.append(f"| `{row['preset']}` | {row['kvpress']} | {agree} | {fmt_acc(row['accuracy'].get('agnostic'))} "
                     f"| {fmt_acc(row['accuracy'].get('aware'))} | {fmt_bytes(row['accuracy'])} | "
                     f"{', '.join(sources) or '-'} |")
    lines.append("")
    lines.append("`*`: the summary is partial (its run continues). kvpress presses without a row:")
    lines.append("")
    for press, reason in report["without_row"].items():
        lines.append(f"- {press}: {reason}")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [row for row in report["rows"] if "agnostic" in row["accuracy"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(rows) + 1.2))
    ys = range(len(rows))
    ours = [row["accuracy"]["agnostic"]["ours"]["mean"] for row in rows]
    theirs = [row["accuracy"]["agnostic"]["kvpress"]["mean"] for row in rows]
    ax.barh([y + 0.2 for y in ys], ours, height=0.4, label="kvpress_ada")
    ax.barh([y - 0.2 for y in ys], theirs, height=0.4, label="kvpress 0.5.5")
    for y, row in zip(ys, rows):
        o, k = row["accuracy"]["agnostic"]["ours"], row["accuracy"]["agnostic"]["kvpress"]
        ax.text(1.01, y, f"{o['kv_fraction']:.2f} / {k['kv_fraction']:.2f}", va="center", fontsize=7)
    ax.set_yticks(list(ys), [row["preset"] for row in rows], fontsize=8)
    ax.set_xlim(0, 1.2)
    ax.set_xlabel(f"accuracy at r = {report['ratio']} (question-agnostic); right: KV held, ours / kvpress")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", nargs="*", type=Path, default=[],
                        help="benchmarks/kvpress_compare.py summaries, the first holding a preset wins")
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--out", type=Path, required=True, help="OUT.json, OUT.md and OUT.png are written")
    args = parser.parse_args(argv)
    if not 0 < args.ratio < 1:
        parser.error(f"--ratio {args.ratio}: expected a compression ratio in (0, 1)")
    import torch

    torch.set_num_threads(1)
    report = build(args.ratio, load_summaries(args.compare))
    import common

    common.write_json(args.out.with_suffix(".json"), report)
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text)
    png = plot(report, args.out.with_suffix(".png"))
    print(text)
    print(f"wrote {args.out.with_suffix('.json')}, {args.out.with_suffix('.md')}" + (f", {png}" if png else ""))


if __name__ == "__main__":
    main()
