"""Tables and plots for evaluation results."""

from __future__ import annotations

from pathlib import Path


def format_table(summary: list[dict]) -> str:
    """A plain-text table: accuracy (95% CI), KL, top-1, eviction loss, KV bytes held, KV bytes read per decode step
    (``-`` where not measured, e.g. records written before it was), the achieved ratio (fraction of entries evicted)
    per label x ratio."""
    header = (f"{'press':<24}{'ratio':>6}{'n':>5}{'accuracy':>17}{'KL':>9}{'top1':>7}{'evict L1':>10}{'KV MB':>9}"
              f"{'read MB':>9}{'KV frac':>9}{'achieved':>9}")
    lines = [header, "-" * len(header)]
    for row in sorted(summary, key=lambda r: (r["label"] != "full", r["label"], r["ratio"])):
        acc = f"{row['accuracy']:.3f} ± {row['ci95']:.3f}" if row["ci95"] == row["ci95"] else f"{row['accuracy']:.3f}"
        lines.append(f"{row['label']:<24}{row['ratio']:>6.2f}{row['n']:>5}{acc:>17}{row['kl']:>9.4f}{row['top1']:>7.3f}"
                     f"{row['eviction_loss']:>10.4f}{row['kv_bytes'] / 2**20:>9.2f}{_megabytes(row):>9}"
                     f"{row['kv_fraction']:>9.3f}{_number(row.get('achieved_ratio')):>9}")
    return "\n".join(lines)


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure as a 256-colour palette PNG (a plot's few colours survive; the file is about a
    third of an RGBA one, so committed plots stay small)."""
    import io

    from PIL import Image

    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    image = Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(path, format="PNG", optimize=True)
    return path


def _number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _megabytes(row: dict) -> str:
    """A summary row's KV bytes read per decode step in MiB (``-``: not measured)."""
    read = row.get("read_bytes_per_step")
    return _number(None if read is None else read / 2**20)


def plot_accuracy(summary: list[dict], path: str | Path, title: str = "") -> Path:
    """PNG of accuracy vs compression ratio, one line per press (full cache as a dashed line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    full = [r for r in summary if r["label"] == "full"]
    labels = sorted({r["label"] for r in summary} - {"full"})
    for label in labels:
        rows = sorted((r for r in summary if r["label"] == label), key=lambda r: r["ratio"])
        x = [r["ratio"] for r in rows]
        y = [r["accuracy"] for r in rows]
        err = [0.0 if r["ci95"] != r["ci95"] else r["ci95"] for r in rows]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label, linestyle="--" if "ada" not in label else "-")
    if full:
        ax.axhline(full[0]["accuracy"], color="black", linestyle=":", label="full cache")
    ax.set_xlabel("compression ratio (fraction of KV entries evicted)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def paired_difference(records: list[dict], a: str, b: str, ratio: float,
                      ratio_b: float | None = None) -> dict | None:
    """Accuracy of ``a`` minus ``b`` at ``ratio`` on the samples both ran, with a paired 95% CI
    (``ratio_b``: ``b``'s ratio when it differs, e.g. a threshold press against a fixed ratio).

    ``records`` are :class:`~kvpress_ada.harness.eval.runner.Record` dicts; samples pair by (task, sample). The
    full cache (label ``"full"``) pairs at any ratio. ``None`` when no sample has both."""
    def cell(label: str, at: float) -> dict[tuple[str, int], float]:
        return {(r["task"], r["sample"]): r["score"] for r in records
                if r["label"] == label and (label == "full" or abs(r["ratio"] - at) < 1e-9)}

    left, right = cell(a, ratio), cell(b, ratio if ratio_b is None else ratio_b)
    keys = sorted(left.keys() & right.keys())
    if not keys:
        return None
    diffs = [left[k] - right[k] for k in keys]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1)
    half = 1.96 * (var / n) ** 0.5 if n > 1 else float("nan")
    verdict = "a better" if mean - half > 0 else ("b better" if mean + half < 0 else "no significant difference")
    other = {} if ratio_b is None else {"ratio_b": ratio_b}
    return {"a": a, "b": b, "ratio": ratio, **other, "n": n, "delta": mean, "ci95": half, "verdict": verdict}
