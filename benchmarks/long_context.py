"""Long contexts: peak KV bytes and peak RSS of chunked prefill vs one-shot compression vs the full cache.

Memory part (default): for every context length and method a fresh subprocess loads the model, warms
up on a short prompt, resets the RSS high-water mark, then prefills the context (logits for the last
position only) with

* ``full``: no press (dense ``DynamicCache``);
* ``oneshot``: ``ada_snapkv`` at a fixed ``--budget`` (tokens per kv head), one-shot prefill (each
  layer is compressed right after its dense prefill attention);
* ``chunked``: the same press with ``prefill_chunk=--chunk``.

Measured: the peak KV bytes the cache held at any moment of the prefill (``Cache.update`` is wrapped in
the worker: the cache's bytes are read after every layer update, i.e. with the layer's new tokens
appended and before it is compressed), the KV bytes after the prefill, and the peak RSS (``VmHWM``)
over the loaded, warmed-up model (glibc with a fixed mmap threshold so freed tensors go back to the
OS; see ``benchmarks/memory.py``). Results are checkpointed to the JSON after every config; a rerun
with ``--resume`` skips the configs already there.

Quality part (``--quality``): on the synthetic task suite (``kvpress_ada.harness.eval.tasks``) at the given
contexts, each sample is answered with the full cache, the one-shot press and the chunked press at
the same budget (question-agnostic unless ``--question-aware``), through the eval's fan-out
(``evaluate_sample``): accuracy, and KL / top-1 against the full cache on its teacher-forced
continuation. Per-sample differences (chunked - one-shot) are paired and get a 95% bootstrap CI.
Checkpointed per sample, in sample-major order (every context and task covered early).

    python benchmarks/long_context.py                       # 2k..32k, budget 512, chunk 512
    python benchmarks/long_context.py --quality --n 8       # 4k and 8k quality, n samples per task
    python benchmarks/long_context.py --quick               # smoke run on a tiny random model
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import memory  # noqa: E402

METHODS = ("chunked", "oneshot", "full")


# ----------------------------------------------------------------------------- memory worker


def worker(cfg: dict) -> dict:
    import torch
    from transformers.cache_utils import Cache

    from kvpress_ada import preset

    threads = common.set_threads(cfg["threads"])
    model, tok = common.load_model(cfg["model"])
    geom = common.kv_geometry(model)
    L = cfg["context"]
    ids = common.context_ids(tok, L, model.config.vocab_size)
    press = None
    if cfg["method"] != "full":
        chunk = cfg["chunk"] if cfg["method"] == "chunked" else None
        press = preset(cfg["preset"], budget=cfg["budget"], prefill_chunk=chunk)

    peak = {"bytes": 0, "updates": 0}
    original = Cache.update

    def update(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        peak["bytes"] = max(peak["bytes"], common.cache_nbytes(self))
        peak["updates"] += 1
        return out

    Cache.update = update  # type: ignore[method-assign]
    warm = min(L, 2 * cfg["chunk"] + 7)  # the warm-up runs the chunked path too
    common.prefill(model, ids[:, :warm], press)
    memory.release_free_memory()
    peak.update(bytes=0, updates=0)
    supported = memory.reset_peak()
    base = memory.rss_mib()
    t0 = time.perf_counter()
    cache, nxt = common.prefill(model, ids, press)
    seconds = time.perf_counter() - t0
    peak_rss = memory.peak_rss_mib()
    Cache.update = original  # type: ignore[method-assign]
    result = dict(cfg)
    per_head = None
    if hasattr(cache, "head_lengths"):
        lengths = torch.stack([cache.head_lengths(i).flatten() for i in range(len(cache.layers))])
        per_head = {"min": int(lengths.min()), "mean": float(lengths.float().mean()), "max": int(lengths.max())}
    result.update({
        "threads_used": threads, "geometry": geom, "full_kv_bytes": common.full_kv_bytes(geom, 1, L),
        "peak_kv_bytes": peak["bytes"], "cache_updates": peak["updates"],
        "final_kv_bytes": common.cache_nbytes(cache), "kept_per_head": per_head,
        "peak_reset_supported": supported, "rss_base_mib": base, "peak_rss_mib": peak_rss,
        "peak_delta_rss_mib": peak_rss - base, "prefill_s": seconds, "next_token": int(nxt[0, 0]),
    })
    return result


def run_one(cfg: dict, timeout: float) -> dict:
    cmd = [common.python(), str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=common.ROOT,
                          env=memory.worker_env("strict"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed for {cfg} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def memory_configs(args) -> list[dict]:
    base = dict(model=args.model, preset=args.preset, budget=args.budget, chunk=args.chunk, threads=args.threads)
    # by increasing length, every method at each (a run cut short still compares them)
    return [dict(base, method=m, context=L) for L in args.contexts for m in METHODS]


def _key(x: dict) -> tuple:
    return (x["method"], x["context"], x["budget"], x["chunk"], x["preset"], x["model"])


def flatness(results: list[dict], method: str, lo: int, hi: int) -> float | None:
    """Relative growth of the peak KV bytes of ``method`` from context ``lo`` to ``hi``."""
    peaks = {x["context"]: x["peak_kv_bytes"] for x in results if x["method"] == method}
    if lo not in peaks or hi not in peaks:
        return None
    return peaks[hi] / peaks[lo] - 1.0


def memory_table(results: list[dict]) -> str:
    headers = ["ctx", "method", "peak KV MiB", "final KV MiB", "full KV MiB", "peak dRSS MiB", "prefill s",
               "kept/head min-mean-max"]
    rows = []
    for x in sorted(results, key=lambda r: (r["context"], METHODS.index(r["method"]))):
        hl = x["kept_per_head"]
        rows.append([x["context"], x["method"], f"{x['peak_kv_bytes'] / 2**20:.1f}",
                     f"{x['final_kv_bytes'] / 2**20:.1f}", f"{x['full_kv_bytes'] / 2**20:.1f}",
                     f"{x['peak_delta_rss_mib']:.0f}", f"{x['prefill_s']:.1f}",
                     f"{hl['min']}-{hl['mean']:.0f}-{hl['max']}" if hl else "-"])
    return common.fmt_table(headers, rows)


def memory_plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = payload["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for method, style in zip(METHODS, ("o-", "s--", "^:")):
        rows = sorted((x for x in payload["results"] if x["method"] == method), key=lambda r: r["context"])
        if not rows:
            continue
        xs = [x["context"] for x in rows]
        axes[0].plot(xs, [x["peak_kv_bytes"] / 2**20 for x in rows], style, label=method)
        axes[1].plot(xs, [x["peak_delta_rss_mib"] for x in rows], style, label=method)
    for ax, title in zip(axes, ("peak KV bytes during prefill", "peak RSS over the loaded model")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("MiB")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{s['preset']}, budget {s['budget']} tokens per kv head, chunk {s['chunk']}, {s['model']} model "
                 "(CPU, fp32)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_report(payload: dict, out: Path) -> None:
    print(memory_table(payload["results"]))
    growth = flatness(payload["results"], "chunked", 4096, 32768)
    payload["chunked_peak_growth_4k_to_32k"] = growth
    if growth is not None:
        print(f"chunked peak KV growth 4k -> 32k: {growth:+.1%} ({'PASS' if abs(growth) <= 0.10 else 'FAIL'} "
              "within 10%)")
    memory_plot(payload, out.with_suffix(".png"))
    print(f"plot: {out.with_suffix('.png')}")


def run_memory(args, out: Path) -> int:
    payload = json.loads(out.read_text()) if args.resume and out.exists() else None
    if payload is None:
        payload = {"benchmark": "long_context_memory", "machine": common.machine_info(), "started": common.now_iso(),
                   "settings": {k: getattr(args, k) for k in ("model", "preset", "budget", "chunk", "contexts",
                                                              "threads")},
                   "results": [], "failed": []}
    done = {_key(x) for x in payload["results"]}
    for cfg in memory_configs(args):
        if _key(cfg) in done:
            continue
        print(f"running {cfg['method']} @ {cfg['context']}", flush=True)
        try:
            payload["results"].append(run_one(cfg, args.timeout))
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            payload["failed"].append({"config": cfg, "error": str(err)[-500:]})
            print(f"  failed: {str(err)[-300:]}", flush=True)
        payload["updated"] = common.now_iso()
        common.write_json(out, payload)
    memory_report(payload, out)
    common.write_json(out, payload)
    return 0


# ----------------------------------------------------------------------------- quality


def bootstrap_ci(diffs: list[float], reps: int = 10000, seed: int = 0) -> tuple[float, float]:
    import random

    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def run_quality(args, out: Path) -> int:

    from kvpress_ada import preset
    from kvpress_ada.harness.eval.runner import Entry, evaluate_sample
    from kvpress_ada.harness.eval.tasks import make_samples

    common.set_threads(args.threads)
    model, tok = common.load_model(args.model)
    payload = json.loads(out.read_text()) if args.resume and out.exists() else None
    if payload is None:
        payload = {"benchmark": "long_context_quality", "machine": common.machine_info(), "started": common.now_iso(),
                   "settings": {k: getattr(args, k) for k in ("model", "preset", "budget", "chunk", "tasks",
                                                              "quality_contexts", "n", "seed",
                                                              "question_aware")},
                   "records": []}
    done = {(r["context"], r["task"], r["sample"]) for r in payload["records"]}
    entries = [Entry("oneshot", 0.0, preset(args.preset, budget=args.budget)),
               Entry("chunked", 0.0, preset(args.preset, budget=args.budget, prefill_chunk=args.chunk))]
    samples = {(L, task): make_samples(task, tok, args.n, L, seed=args.seed)
               for L in args.quality_contexts for task in args.tasks}
    # sample-major order: an interrupted run still covers every context and task
    for i in range(args.n):
        for (L, task), cell in samples.items():
            if (L, task, i) in done:
                continue
            t0 = time.perf_counter()
            # one dense prefill gives the full cache's answer and continuation and the one-shot press's
            # cache (fan-out); the chunked press runs its own chunked prefill. KL and top-1 are against
            # the full cache on its teacher-forced continuation (question then answer).
            records = evaluate_sample(model, tok, cell[i], entries, i, question_aware=args.question_aware,
                                      max_new_tokens=args.max_new_tokens)
            row: dict = {"context": L, "task": task, "sample": i, "seconds": time.perf_counter() - t0}
            for r in records:
                row[r.label] = {"answer": r.answer, "score": r.score, "kl": r.kl, "top1": r.top1,
                                "kv_bytes": r.kv_bytes}
            payload["records"].append(row)
            payload["updated"] = common.now_iso()
            common.write_json(out, payload)
            print(f"{L} {task} {i}: score full {row['full']['score']:.2f} oneshot {row['oneshot']['score']:.2f} "
                  f"chunked {row['chunked']['score']:.2f}; KL oneshot {row['oneshot']['kl']:.3f} "
                  f"chunked {row['chunked']['kl']:.3f} ({row['seconds']:.0f} s)", flush=True)
    payload["summary"] = quality_summary(payload["records"])
    common.write_json(out, payload)
    print(quality_table(payload["summary"]))
    return 0


def quality_summary(records: list[dict]) -> list[dict]:
    out = []
    for L in sorted({r["context"] for r in records}):
        rows = [r for r in records if r["context"] == L]
        diffs = [r["chunked"]["score"] - r["oneshot"]["score"] for r in rows]
        lo, hi = bootstrap_ci(diffs)
        kl_diffs = [r["chunked"]["kl"] - r["oneshot"]["kl"] for r in rows if "kl" in r["chunked"]]
        out.append({"context": L, "n": len(rows), "oneshot": sum(r["oneshot"]["score"] for r in rows) / len(rows),
                    "chunked": sum(r["chunked"]["score"] for r in rows) / len(rows),
                    "diff": sum(diffs) / len(diffs), "ci95": [lo, hi],
                    "full": _mean([r["full"]["score"] for r in rows if "full" in r]),
                    "kl_oneshot": _mean([r["oneshot"]["kl"] for r in rows if "kl" in r["oneshot"]]),
                    "kl_chunked": _mean([r["chunked"]["kl"] for r in rows if "kl" in r["chunked"]]),
                    "kl_diff_ci95": list(bootstrap_ci(kl_diffs)) if kl_diffs else None,
                    "top1_oneshot": _mean([r["oneshot"]["top1"] for r in rows if "top1" in r["oneshot"]]),
                    "top1_chunked": _mean([r["chunked"]["top1"] for r in rows if "top1" in r["chunked"]]),
                    "tasks": sorted({r["task"] for r in rows})})
    return out


def quality_table(summary: list[dict]) -> str:
    def num(value, fmt=".3f"):
        return "-" if value is None else format(value, fmt)

    rows = [[s["context"], s["n"], num(s.get("full")), f"{s['oneshot']:.3f}", f"{s['chunked']:.3f}",
             f"{s['diff']:+.3f} [{s['ci95'][0]:+.3f}, {s['ci95'][1]:+.3f}]",
             f"{num(s.get('kl_oneshot'))} / {num(s.get('kl_chunked'))}",
             "-" if not s.get("kl_diff_ci95") else f"[{s['kl_diff_ci95'][0]:+.3f}, {s['kl_diff_ci95'][1]:+.3f}]",
             f"{num(s.get('top1_oneshot'))} / {num(s.get('top1_chunked'))}"] for s in summary]
    return common.fmt_table(["ctx", "n", "full acc", "one-shot acc", "chunked acc", "chunked - one-shot (95% CI)",
                             "KL one-shot / chunked", "KL diff 95% CI", "top-1 one-shot / chunked"], rows)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=common.MODEL_CHOICES, default=None)
    parser.add_argument("--preset", default="ada_snapkv")
    parser.add_argument("--budget", type=int, default=None, help="tokens kept per kv head (default 512; 32 quick)")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 512; 64 quick)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="memory part: context lengths (default 2048 4096 8192 16384 32768)")
    parser.add_argument("--quality", action="store_true", help="run the quality part instead of the memory part")
    parser.add_argument("--quality-contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tasks", nargs="+", default=["passkey", "multikey"])
    parser.add_argument("--n", type=int, default=8, help="quality: samples per task and context")
    parser.add_argument("--question-aware", action="store_true",
                        help="quality: compress context and question together (default: the context alone)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=5400, help="seconds per memory worker")
    parser.add_argument("--resume", action="store_true", help="keep the configs / samples already in --out")
    parser.add_argument("--replot", action="store_true", help="memory part: table and PNG from --out only")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    q = args.quick
    args.model = args.model or ("tiny" if q else "default")
    args.budget = args.budget or (32 if q else 512)
    args.chunk = args.chunk or (64 if q else 512)
    args.contexts = args.contexts or ([256, 512, 1024] if q else [2048, 4096, 8192, 16384, 32768])
    name = "long_context_quality.json" if args.quality else "long_context.json"
    out = Path(args.out) if args.out else (common.QUICK_DIR if q else common.RESULTS) / name
    if args.replot:
        payload = json.loads(out.read_text())
        memory_report(payload, out)
        common.write_json(out, payload)
        return 0
    return run_quality(args, out) if args.quality else run_memory(args, out)


if __name__ == "__main__":
    raise SystemExit(main())
