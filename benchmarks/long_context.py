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

Stages part (``--stages``; default model ``qwen2.5-coder-0.5b``): on the task suite (passkey) at 16k and 32k,
one subprocess per (context, sample, method) answers the question (question-agnostic) after a prefill
with ``full`` (no press), ``PRESET@chunk`` (``prefill_chunk=--chunk``) or ``PRESET`` (one-shot), every
press at ``--budget`` tokens per kv head; it records the answer's score, the wall time of each stage
(prefill, KVzip's context reconstruction pass, question + greedy answer), the peak KV bytes and the peak
RSS over the loaded model. Combinations the library refuses (``kvzip@chunk``) and one-shot model-pass
presses above ``--pass-max-context`` are reported in one line each and skipped. Checkpointed after every
run (``--resume``): the JSON at ``--out`` and its summary beside it (``X.summary.json``, no per-run records,
each cell listing the runs it ``covers``); on a machine without the JSON, ``--resume`` continues from the
committed summary alone, skipping the runs it covers and merging n-weighted. ``--estimate`` times every
method at 2k and 4k and prints the run's estimated wall time.

    python benchmarks/long_context.py --stages --estimate   # a few minutes: per-stage estimate at 16k / 32k
    python benchmarks/long_context.py --stages --resume     # n = 4 passkey samples at 16k and 32k

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
import summarize  # noqa: E402

METHODS = ("chunked", "oneshot", "full")


# ----------------------------------------------------------------------------- memory worker



def _tracking_peak_kv():
    """Patch ``Cache.update`` to record the largest cache (bytes) and the updates seen: ``(peak, original)``;
    restore with ``Cache.update = original``."""
    from transformers.cache_utils import Cache

    peak = {"bytes": 0, "updates": 0}
    original = Cache.update

    def update(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        peak["bytes"] = max(peak["bytes"], common.cache_nbytes(self))
        peak["updates"] += 1
        return out

    Cache.update = update  # type: ignore[method-assign]
    return peak, original


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

    peak, original = _tracking_peak_kv()
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
    return [dict(base, method=m, context=L) for L in args.contexts for m in args.memory_methods]


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
    from kvpress_ada.harness.eval.report import save_figure

    save_figure(fig, path, dpi=110)
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


# ----------------------------------------------------------------------------- stages at 16k / 32k

STAGED_METHODS = "full,ada_snapkv@chunk,lagkv@chunk,kvzip@chunk,kvzip"
STAGES = ("prefill_s", "pass_s", "decode_s")


def staged_press(method: str, budget: int, chunk: int):
    """``full`` -> None; ``NAME`` -> preset NAME at ``budget`` one-shot; ``NAME@chunk`` -> with
    ``prefill_chunk=chunk``; NAME may also be a Pipeline file (``.yaml``, ``.yml``, ``.json``, e.g. a
    ``benchmarks/configs/<model>/`` press tied to that model). Raises the library's one-line
    ``ValueError`` for a refused combination."""
    from kvpress_ada import Pipeline, preset

    if method == "full":
        return None
    name, _, mode = method.partition("@")
    if mode not in ("", "chunk"):
        raise ValueError(f"method {method!r}: expected NAME or NAME@chunk (NAME a preset or a Pipeline file), "
                         "or full")
    prefill_chunk = chunk if mode == "chunk" else None
    if Path(name).suffix in (".yaml", ".yml", ".json"):
        import yaml

        fields = yaml.safe_load((common.ROOT / name).read_text())  # JSON is YAML
        return Pipeline.model_validate({**fields, "compression_ratio": None, "budget": budget,
                                        "prefill_chunk": prefill_chunk})
    return preset(name, budget=budget, prefill_chunk=prefill_chunk)


def _time_model_passes(timer: dict):
    """Time every call of the library's model pass (KVzip's context reconstruction) into ``timer["pass_s"]``
    by wrapping ``model_pass_scores`` where the integration modules bound it; returns the undo."""
    import kvpress_ada.hosts.transformers.model_pass as defining

    original = defining.model_pass_scores

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timer["pass_s"] += time.perf_counter() - t0
            timer["passes"] += 1

    bound = [m for name, m in list(sys.modules.items())
             if name.startswith("kvpress_ada.") and getattr(m, "model_pass_scores", None) is original]
    for m in bound:
        m.model_pass_scores = timed

    def undo():
        for m in bound:
            m.model_pass_scores = original
    return undo


def staged_worker(cfg: dict) -> dict:
    """One (context, sample, method): prefill (and KVzip's pass) under the press, the question and a greedy
    answer; stage wall times, peak KV bytes (read after every cache update), peak RSS over the loaded model."""
    import torch
    from transformers.cache_utils import Cache

    from kvpress_ada.harness.eval.scoring import score_sample
    from kvpress_ada.harness.eval.tasks import make_samples
    from kvpress_ada.hosts.transformers.generation import continue_rows, eos_ids, split_prompt
    from kvpress_ada.tokens import encode

    threads = common.set_threads(cfg["threads"])
    t_load = time.perf_counter()
    model, tok = common.load_model(cfg["model"])
    press = staged_press(cfg["method"], cfg["budget"], cfg["chunk"])
    sample = make_samples(cfg["task"], tok, cfg["sample"] + 1, cfg["context"], seed=cfg["seed"])[cfg["sample"]]
    head, tail = split_prompt(tok, sample.context, sample.question)
    head_ids, tail_ids = encode(tok, head, "cpu"), encode(tok, tail, "cpu")
    L = head_ids.shape[1]
    geom = common.kv_geometry(model)
    eos = eos_ids(model, tok)

    peak, original = _tracking_peak_kv()
    timer = {"pass_s": 0.0, "passes": 0}
    undo = _time_model_passes(timer)
    # warm-up on the start of the context (two chunks: runs the chunked path, and the model pass too)
    common.prefill(model, head_ids[:, :min(L, cfg["chunk"] + 64)], press)
    setup_s = time.perf_counter() - t_load
    memory.release_free_memory()
    peak.update(bytes=0, updates=0)
    timer.update(pass_s=0.0, passes=0)
    supported = memory.reset_peak()
    base = memory.rss_mib()
    with torch.inference_mode():
        t0 = time.perf_counter()
        cache, _ = common.prefill(model, head_ids, press)
        prefill_total = time.perf_counter() - t0
        pass_s, passes = timer["pass_s"], timer["passes"]
        after_prefill = common.cache_nbytes(cache)
        per_head = None
        if hasattr(cache, "head_lengths"):
            lengths = torch.stack([cache.head_lengths(i).flatten() for i in range(len(cache.layers))])
            per_head = {"min": int(lengths.min()), "mean": float(lengths.float().mean()), "max": int(lengths.max())}
        peak_prefill_rss = memory.peak_rss_mib()
        t0 = time.perf_counter()
        with common.press_context(press, model):
            tokens, cache = continue_rows(model, tail_ids, cache, cfg["max_new_tokens"], eos)
        decode_s = time.perf_counter() - t0
    undo()
    Cache.update = original  # type: ignore[method-assign]
    answer = tok.decode(tokens[0], skip_special_tokens=True).strip()
    result = dict(cfg)
    result.update({
        "threads_used": threads, "context_ids": L, "question_ids": int(tail_ids.shape[1]),
        "answer": answer, "score": score_sample(sample, answer), "answer_tokens": len(tokens[0]),
        "prefill_s": prefill_total - pass_s, "pass_s": pass_s if passes else None, "model_passes": passes,
        "decode_s": decode_s, "setup_s": setup_s,
        "full_kv_bytes": common.full_kv_bytes(geom, 1, L), "peak_kv_bytes": peak["bytes"],
        "kv_bytes_after_prefill": after_prefill, "kept_per_head": per_head, "cache_updates": peak["updates"],
        "peak_reset_supported": supported, "rss_base_mib": base, "peak_rss_mib": memory.peak_rss_mib(),
        "peak_rss_prefill_mib": peak_prefill_rss, "peak_delta_rss_mib": memory.peak_rss_mib() - base,
    })
    return result


def _skip_reason(method: str, context: int, args) -> str | None:
    """Why a (method, context) is not run, in one line; None when it runs."""
    try:
        press = staged_press(method, args.budget, args.chunk)
    except ValueError as err:
        return f"refused by the library: {err}"
    if press is not None and type(press.scorer).needs_model_pass and context > args.pass_max_context:
        return (f"one-shot {type(press.scorer).__name__} not run above --pass-max-context {args.pass_max_context}: "
                f"its context reconstruction runs past the model's positions (context + ~2k pass tokens) and takes "
                "the longest")
    return None


def staged_configs(args) -> list[dict]:
    """Context-major, then sample, then method: a run cut short has whole samples of the shorter context."""
    base = dict(kind="stages", model=args.model, seed=args.seed, budget=args.budget, chunk=args.chunk,
                threads=args.threads, max_new_tokens=args.max_new_tokens)
    return [dict(base, context=L, task=task, sample=i, method=m)
            for L in args.contexts for i in range(args.n) for task in args.tasks for m in args.methods
            if _skip_reason(m, L, args) is None]


def _staged_key(x: dict) -> tuple:
    return (x["context"], x["task"], x["sample"], x["method"], x["budget"], x["chunk"], x["model"], x["seed"],
            x["max_new_tokens"])


# means over a cell's runs, merged n-weighted across machines; the stage times (``STAGES``) depend on the
# processor and are merged only within one: a cell's ``times`` holds them per processor, and its top-level
# stage times are those of its one processor (None when its runs ran on several)
CELL_MEANS = ("accuracy", "answer_tokens", "peak_kv_mib", "kv_after_prefill_mib", "full_kv_mib",
              "peak_delta_rss_mib", "peak_rss_mib")
# the settings a carried summary must share with the run it continues: those that decide a run's result
# besides its (context, task, sample, method), and the thread count (it sets the stage times)
RUN_SETTINGS = ("model", "seed", "budget", "chunk", "max_new_tokens", "threads")


def _n_weighted(a: dict, b: dict, fields: tuple, what: str) -> dict:
    """``fields`` of two means over ``a["n"]`` and ``b["n"]`` runs -> their mean over all runs."""
    n = a["n"] + b["n"]
    out = {}
    for f in fields:
        if (a[f] is None) != (b[f] is None):
            raise ValueError(f"{what}: {f} is measured on one side only")
        out[f] = None if a[f] is None else (a[f] * a["n"] + b[f] * b["n"]) / n
    return out


def _with_stage_times(cell: dict) -> dict:
    """The cell with its top-level ``STAGES`` set from ``times``: its one processor's, or None for several."""
    one = cell["times"][0] if len(cell["times"]) == 1 else None
    return dict(cell, **{k: None if one is None else one[k] for k in STAGES})


def staged_summary(results: list[dict]) -> list[dict]:
    """Per (context, method): accuracy, and means of peak KV / RSS and KV after prefill; ``times`` the mean
    stage times per ``processor`` (each record names its own); ``covers`` lists the ``[task, sample]`` runs
    the cell is over."""
    out = []
    for L in sorted({r["context"] for r in results}):
        for m in dict.fromkeys(r["method"] for r in results if r["context"] == L):
            rows = [r for r in results if r["context"] == L and r["method"] == m]
            mean = lambda key, rs=rows: _mean([r[key] for r in rs if r.get(key) is not None])  # noqa: E731
            times = [{"processor": p, "n": sum(r["processor"] == p for r in rows),
                      **{k: mean(k, [r for r in rows if r["processor"] == p]) for k in STAGES}}
                     for p in dict.fromkeys(r["processor"] for r in rows)]
            out.append(_with_stage_times({
                "context": L, "method": m, "n": len(rows), "accuracy": mean("score"),
                "answer_tokens": mean("answer_tokens"), "peak_kv_mib": mean("peak_kv_bytes") / 2**20,
                "kv_after_prefill_mib": mean("kv_bytes_after_prefill") / 2**20,
                "full_kv_mib": mean("full_kv_bytes") / 2**20, "peak_delta_rss_mib": mean("peak_delta_rss_mib"),
                "peak_rss_mib": mean("peak_rss_mib"), "times": times,
                "covers": sorted([r["task"], r["sample"]] for r in rows)}))
    return out


def merge_staged_summaries(earlier: list[dict], later: list[dict]) -> list[dict]:
    """Cells of two summaries over disjoint runs (an earlier machine's, this one's) -> one cell per
    (context, method): ``n`` added, every ``CELL_MEANS`` field n-weighted, ``times`` n-weighted within each
    processor (kept apart across processors), ``covers`` joined; contexts ascending, methods in first-seen
    order. Raises ``ValueError`` when a run is in both or a mean is measured on one side only."""
    cells: dict[tuple, dict] = {}
    for cell in [*earlier, *later]:
        key = (cell["context"], cell["method"])
        if key not in cells:
            cells[key] = dict(cell)
            continue
        a = cells[key]
        what = f"{cell['method']} @ {cell['context']}"
        both = {tuple(c) for c in a["covers"]} & {tuple(c) for c in cell["covers"]}
        if both:
            raise ValueError(f"{what}: runs {sorted(both)} are in both summaries")
        times = {t["processor"]: t for t in a["times"]}
        for t in cell["times"]:
            old = times.get(t["processor"])
            times[t["processor"]] = t if old is None else dict(old, n=old["n"] + t["n"],
                                                                **_n_weighted(old, t, STAGES, what))
        cells[key] = _with_stage_times(dict(a, n=a["n"] + cell["n"], covers=sorted([*a["covers"], *cell["covers"]]),
                                            times=list(times.values()), **_n_weighted(a, cell, CELL_MEANS, what)))
    return sorted(cells.values(), key=lambda c: c["context"])


def carried_cells(carried: dict) -> list[dict]:
    """A carried summary's cells, each with ``times``; a summary written before cells kept their times per
    processor (all its runs on one machine: no ``earlier``) gets its own machine's processor."""
    cells = carried["summary"]
    if all("times" in c for c in cells):
        return cells
    if len(carried["earlier"]) != 1:
        raise ValueError(f"{carried['from']} has stage times without their processor over several machines: "
                         "move it away to start afresh")
    processor = carried["earlier"][0]["machine"]["processor"]
    return [c if "times" in c else dict(c, times=[{"processor": processor, "n": c["n"], **{k: c[k] for k in STAGES}}])
            for c in cells]


def carried_runs(summary_payload: dict, settings: dict, source: str) -> dict:
    """What an earlier machine's committed summary (``X.summary.json``) carries into ``--resume`` when its
    per-run records are gone: ``{"from", "summary", "earlier"}``. The summary must have been made with the
    same ``RUN_SETTINGS`` (else ``ValueError`` naming the first that differs) and list its cells' runs."""
    made = summary_payload.get("settings") or {}
    for k in RUN_SETTINGS:
        if made.get(k) != settings[k]:
            raise ValueError(f"{source} was made with {k}={made.get(k)!r}, this run asks {k}={settings[k]!r}: "
                             "move it away to start afresh")
    cells = summary_payload.get("summary") or []
    if any("covers" not in c for c in cells):
        raise ValueError(f"{source} does not list the runs of its cells ('covers'): move it away to start afresh")
    here = {k: summary_payload.get(k) for k in ("machine", "started", "updated")}
    return {"from": source, "summary": cells, "earlier": [*summary_payload.get("earlier", []), here]}


def carried_keys(carried: dict, settings: dict) -> set[tuple]:
    """``_staged_key`` of every run a carried summary covers."""
    return {_staged_key(dict(settings, context=c["context"], method=c["method"], task=task, sample=sample))
            for c in carried["summary"] for task, sample in c["covers"]}


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _short_processor(name: str) -> str:
    return " ".join(name.replace("(R)", "").replace("(TM)", "").replace(" Processor", "").split())


def _stage_text(cell: dict, key: str, fmt: str) -> str:
    """A stage time of a cell: its processor's mean, or each processor's joined by " / " (as in ``times``)."""
    return " / ".join(_num(t[key], fmt) for t in cell["times"])


def _processors_text(cell: dict) -> str:
    return " / ".join(f"{_short_processor(t['processor'])} ({t['n']})" for t in cell["times"])


def staged_table(summary: list[dict]) -> str:
    rows = [[s["context"], s["method"], s["n"], _num(s["accuracy"], ".2f"), _stage_text(s, "prefill_s", ".0f"),
             _stage_text(s, "pass_s", ".0f"), _stage_text(s, "decode_s", ".1f"), f"{s['peak_kv_mib']:.1f}",
             f"{s['kv_after_prefill_mib']:.1f}", f"{s['full_kv_mib']:.1f}", _num(s["peak_delta_rss_mib"], ".0f"),
             _processors_text(s)]
            for s in summary]
    return common.fmt_table(["ctx", "method", "n", "accuracy", "prefill s", "KVzip pass s", "decode s",
                             "peak KV MiB", "KV after prefill MiB", "full KV MiB", "peak dRSS MiB",
                             "processor (runs)"], rows)


def staged_plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = payload["summary"]
    processors = list(dict.fromkeys(t["processor"] for s in summary for t in s["times"]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for i, m in enumerate(dict.fromkeys(s["method"] for s in summary)):
        rows = sorted((s for s in summary if s["method"] == m), key=lambda s: s["context"])
        xs = [s["context"] for s in rows]
        style = dict(marker="o", linestyle="-" if "@chunk" in m or m == "full" else "--", color=f"C{i}", label=m)
        axes[0].plot(xs, [s["accuracy"] for s in rows], **style)
        axes[1].plot(xs, [s["peak_kv_mib"] for s in rows], **style)
        for j, p in enumerate(processors):  # stage times only within one processor
            pts = [(s["context"], sum(t[k] or 0.0 for k in STAGES)) for s in rows for t in s["times"]
                   if t["processor"] == p]
            if pts:
                several = {} if len(processors) == 1 else {"linestyle": ("-", ":", "-.", "--")[j % 4],
                                                            "label": f"{m}, {_short_processor(p)}"}
                axes[2].plot(*zip(*pts), **{**style, **several})
    time_title = "wall time per sample" + (" (per processor)" if len(processors) > 1 else "")
    for ax, title, ylabel in zip(axes, ("accuracy (question-agnostic)", "peak KV bytes", time_title),
                                 ("accuracy", "MiB", "s (prefill + pass + decode)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(-0.02, 1.02)
    s = payload["settings"]
    fig.suptitle(f"{s['model']}, {','.join(s['tasks'])}, budget {s['budget']} tokens per kv head, chunk {s['chunk']}, "
                 f"{s['threads']} thread(s)")
    fig.tight_layout()
    from kvpress_ada.harness.eval.report import save_figure

    save_figure(fig, path, dpi=110)
    plt.close(fig)


def staged_readme_rows(summary: list[dict]) -> str:
    lines = ["| context | method | n | accuracy | prefill s | KVzip pass s | decode s | peak KV MiB (full) | "
             "peak dRSS MiB | processor (runs) |", "|--:|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for s in summary:
        lines.append(f"| {s['context']:,} | `{s['method']}` | {s['n']} | {_num(s['accuracy'], '.2f')} | "
                     f"{_stage_text(s, 'prefill_s', '.0f')} | {_stage_text(s, 'pass_s', '.0f')} | "
                     f"{_stage_text(s, 'decode_s', '.1f')} | {s['peak_kv_mib']:.1f} ({s['full_kv_mib']:.0f}) | "
                     f"{_num(s['peak_delta_rss_mib'], '.0f')} | {_processors_text(s)} |")
    return "\n".join(lines)


def _fit_quadratic(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a L + b L^2`` through two ``(L, t)`` points (b = 0 if the fit is not convex)."""
    (l1, t1), (l2, t2) = sorted(points)[:2]
    b = (t2 / l2 - t1 / l1) / (l2 - l1)
    if b <= 0:
        return t2 / l2, 0.0
    return t1 / l1 - b * l1, b


def staged_estimate(args) -> dict:
    """Time every method at the short ``--estimate-contexts`` and extrapolate each stage to ``--contexts``.

    Dense prefill: ``a L + b L^2`` through the two full-cache points (the presses run at the longer context
    only). Chunked prefill: ``a L`` plus the attention of each chunk over what is held before it
    (``min(budget, start)``) and the chunk (at the dense prefill's per query-key cost ``2 b``), plus the
    measured per-chunk scoring overhead. KVzip's pass: linear in L (fixed-size reconstruction chunks).
    Decode: ``d0 + d1 * held tokens`` from the full cache. Setup (load, samples, warm-up): the largest seen.
    """
    pts: dict[str, list[dict]] = {}
    for L in sorted(args.estimate_contexts):
        for m in args.methods:
            if _skip_reason(m, L, args) or (m != "full" and L != max(args.estimate_contexts)):
                continue  # the presses are extrapolated from the longer context and the full cache's fit
            cfg = dict(kind="stages", model=args.model, seed=args.seed, budget=args.budget, chunk=args.chunk,
                       threads=args.threads, max_new_tokens=args.max_new_tokens, context=L, task=args.tasks[0],
                       sample=0, method=m)
            t0 = time.perf_counter()
            r = run_one(cfg, args.timeout)
            r["worker_wall_s"] = time.perf_counter() - t0
            pts.setdefault(m, []).append(r)
            print(f"  timed {m} @ {L}: prefill {r['prefill_s']:.1f} s, pass {r['pass_s'] or 0:.1f} s, decode "
                  f"{r['decode_s']:.1f} s ({r['answer_tokens']} tokens), peak dRSS {r['peak_delta_rss_mib']:.0f} MiB, "
                  f"worker {r['worker_wall_s']:.0f} s", flush=True)
    full = pts["full"]
    a, b = _fit_quadratic([(r["context_ids"], r["prefill_s"]) for r in full])
    d1 = ((full[-1]["decode_s"] - full[0]["decode_s"]) / (full[-1]["context_ids"] - full[0]["context_ids"])
          if len(full) > 1 else 0.0)
    d1 = max(d1, 0.0)
    d0 = max(full[-1]["decode_s"] - d1 * full[-1]["context_ids"], 0.0)
    setup = max(r["worker_wall_s"] - sum(r[k] or 0.0 for k in STAGES) for rs in pts.values() for r in rs)
    rss_per_token = {m: rs[-1]["peak_delta_rss_mib"] / rs[-1]["context_ids"] for m, rs in pts.items()}
    rows, total = [], 0.0
    for L in args.contexts:
        ids = L + (full[-1]["context_ids"] - max(args.estimate_contexts))  # + the chat template's tokens
        for m in args.methods:
            reason = _skip_reason(m, L, args)
            if reason is not None:
                print(f"{m} @ {L}: {reason}")
                continue
            if m not in pts:
                continue
            press = staged_press(m, args.budget, args.chunk)
            last = pts[m][-1]
            if press is not None and press.prefill_chunk is not None:
                from kvpress_ada.runtime import Schedule

                chunks = Schedule(press).chunks
                dense = sum(a * (e - s) for s, e in chunks(ids))
                attn = sum(2 * b * (e - s) * (min(args.budget, s) + (e - s) / 2) for s, e in chunks(ids))
                base_short = a * last["context_ids"] + b * last["context_ids"] ** 2
                overhead = max(last["prefill_s"] - base_short, 0.0) / max(len(chunks(last["context_ids"])), 1)
                prefill = dense + attn + overhead * len(chunks(ids))
            else:
                overhead = max(last["prefill_s"] - (a * last["context_ids"] + b * last["context_ids"] ** 2), 0.0)
                prefill = a * ids + b * ids ** 2 + overhead * ids / last["context_ids"]
            pass_s = (last["pass_s"] or 0.0) * ids / last["context_ids"]
            held = ids if press is None else min(ids, args.budget)
            decode = (d0 + d1 * held) * (last["answer_tokens"] + 1) / (full[-1]["answer_tokens"] + 1)
            per_sample = prefill + pass_s + decode + setup
            cell = per_sample * args.n * len(args.tasks)
            total += cell
            rows.append({"context": L, "method": m, "prefill_s": prefill, "pass_s": pass_s, "decode_s": decode,
                         "setup_s": setup, "per_sample_s": per_sample, "cell_s": cell,
                         "peak_delta_rss_mib": rss_per_token[m] * (ids if press is None or press.prefill_chunk is None
                                                                   else last["context_ids"])})
    print(common.fmt_table(
        ["ctx", "method", "prefill s", "pass s", "decode s", "setup s", "per sample", f"x {args.n * len(args.tasks)}",
         "peak dRSS MiB (rough)"],
        [[r["context"], r["method"], f"{r['prefill_s']:.0f}", f"{r['pass_s']:.0f}", f"{r['decode_s']:.0f}",
          f"{r['setup_s']:.0f}", f"{r['per_sample_s'] / 60:.1f} min", f"{r['cell_s'] / 3600:.2f} h",
          f"{r['peak_delta_rss_mib']:.0f}"] for r in rows]))
    print(f"estimated wall time of the whole run: {total / 3600:.1f} h on {args.threads} thread(s) at this machine's "
          f"current load (dense prefill fit: {a * 1e3:.2f} ms/token + {b * 1e6:.3f} us/token^2)")
    return {"estimate": rows, "total_s": total, "fit": {"a": a, "b": b, "d0": d0, "d1": d1, "setup_s": setup},
            "timings": pts}


def run_staged(args, out: Path) -> int:
    for m in args.methods:
        for L in args.contexts:
            reason = _skip_reason(m, L, args)
            if reason is not None:
                print(f"{m} @ {L}: {reason}", flush=True)
    if args.estimate:
        staged_estimate(args)
        return 0
    payload = json.loads(out.read_text()) if args.resume and out.exists() else None
    settings = {k: getattr(args, k) for k in ("model", "tasks", "contexts", "n", "seed", "methods", "budget", "chunk",
                                               "threads", "max_new_tokens", "pass_max_context")}
    summary_file = summarize.summary_path(out)
    if payload is None:
        payload = {"benchmark": "long_context_stages", "machine": common.machine_info(), "started": common.now_iso(),
                   "settings": settings, "records": [], "failed": []}
        if args.resume and summary_file.exists():  # an earlier machine's runs, kept only as the committed summary
            try:
                payload["carried"] = carried_runs(json.loads(summary_file.read_text()), settings, str(summary_file))
            except ValueError as err:
                raise SystemExit(f"long_context.py: {err}") from None
            payload["earlier"] = payload["carried"]["earlier"]
    payload["settings"] = settings  # results are keyed by everything that decides them
    payload["skipped"] = [{"method": m, "context": L, "reason": _skip_reason(m, L, args)} for m in args.methods
                          for L in args.contexts if _skip_reason(m, L, args) is not None]
    carried = payload.get("carried")
    done = {_staged_key(x) for x in payload["records"]} | (carried_keys(carried, settings) if carried else set())
    todo = [c for c in staged_configs(args) if _staged_key(c) not in done]
    sources = ([str(out)] if payload["records"] else []) + ([carried["from"]] if carried else [])
    print(f"{len(done)} runs kept from {' and '.join(sources) or 'nothing'}, {len(todo)} to run"
          + (" (not run: --summary-only)" if args.summary_only else ""), flush=True)
    if args.summary_only:
        todo = []
    current = {_staged_key(c) for c in staged_configs(args)}  # runs of other settings stay, out of the summary
    cells = {(L, m) for L in args.contexts for m in args.methods}
    processor = common.machine_info()["processor"]  # this machine's, stamped on each run it makes

    def checkpoint() -> None:
        """The JSON at --out, and beside it the summary (no per-run records) and its plot, after every run."""
        payload["updated"] = common.now_iso()
        here = staged_summary([dict(r, processor=r.get("processor", payload["machine"]["processor"]))
                               for r in payload["records"] if _staged_key(r) in current])
        earlier = [c for c in carried_cells(carried) if (c["context"], c["method"]) in cells] if carried else []
        payload["summary"] = merge_staged_summaries(earlier, here)
        common.write_json(out, payload)
        common.write_json(summary_file, summarize.summary({k: v for k, v in payload.items() if k != "carried"}))
        if payload["summary"]:
            staged_plot(payload, out.with_suffix(".png"))

    for cfg in todo:
        print(f"running {cfg['method']} @ {cfg['context']} {cfg['task']} sample {cfg['sample']} ...", flush=True)
        try:
            r = dict(run_one(cfg, args.timeout), processor=processor)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            payload["failed"].append({"config": cfg, "error": str(err)[-500:]})
            print(f"  failed: {str(err)[-300:]}", flush=True)
        else:
            payload["records"].append(r)
            print(f"  answer {r['answer']!r} score {r['score']:.0f}; prefill {r['prefill_s']:.0f} s, pass "
                  f"{r['pass_s'] or 0:.0f} s, decode {r['decode_s']:.1f} s; peak KV {r['peak_kv_bytes'] / 2**20:.1f} "
                  f"MiB; peak dRSS {r['peak_delta_rss_mib']:.0f} MiB", flush=True)
        checkpoint()
    checkpoint()
    if payload["summary"]:
        print(staged_table(payload["summary"]))
        print("\nREADME rows:\n")
        print(staged_readme_rows(payload["summary"]))
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=common.MODEL_CHOICES, default=None,
                        help="default: 'default' (SmolLM2-135M; --quick: tiny); with --stages qwen2.5-coder-0.5b")
    parser.add_argument("--preset", default="ada_snapkv")
    parser.add_argument("--budget", type=int, default=None,
                        help="tokens kept per kv head (default 512; 32 quick; --stages 4096)")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 512; 64 quick; --stages 1024)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="memory part: context lengths (default 2048 4096 8192 16384 32768); --stages: context "
                             "tokens per sample (default 16000 32000)")
    parser.add_argument("--memory-methods", default=",".join(METHODS),
                        help="memory part: comma-separated, from " + ",".join(METHODS))
    parser.add_argument("--quality", action="store_true", help="run the quality part instead of the memory part")
    parser.add_argument("--stages", action="store_true",
                        help="accuracy, peak KV, peak RSS and wall time per stage (prefill, KVzip pass, decode) on "
                             "the task suite at --contexts, one subprocess per (context, sample, method), "
                             "checkpointed after each")
    parser.add_argument("--methods", default=STAGED_METHODS,
                        help="--stages: comma-separated full, PRESET (one-shot) or PRESET@chunk (prefill_chunk="
                             "--chunk); refused combinations are reported in one line and skipped")
    parser.add_argument("--pass-max-context", type=int, default=16384,
                        help="--stages: longest context a one-shot press with a model pass (kvzip) runs at")
    parser.add_argument("--estimate", action="store_true",
                        help="--stages: time every method at --estimate-contexts and print the estimated wall time "
                             "of the run per stage, method and context (a few minutes; writes nothing)")
    parser.add_argument("--estimate-contexts", type=int, nargs=2, default=[2048, 4096])
    parser.add_argument("--summary-only", action="store_true",
                        help="--stages --resume: rewrite the summary and plot from the runs kept, running none")
    parser.add_argument("--quality-contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tasks", nargs="+", default=None,
                        help="default passkey multikey (--stages: passkey)")
    parser.add_argument("--n", type=int, default=None, help="samples per task and context (default 8; --stages 4)")
    parser.add_argument("--question-aware", action="store_true",
                        help="quality: compress context and question together (default: the context alone)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 16 (--stages: 24, as eval)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=5400, help="seconds per memory worker")
    parser.add_argument("--resume", action="store_true", help="keep the configs / samples already in --out")
    parser.add_argument("--replot", action="store_true", help="memory part: table and PNG from --out only")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        cfg = json.loads(args.worker)
        print("RESULT " + json.dumps(staged_worker(cfg) if cfg.get("kind") == "stages" else worker(cfg)), flush=True)
        return 0
    if args.stages:
        args.model = args.model or "qwen2.5-coder-0.5b"
        args.budget, args.chunk = args.budget or 4096, args.chunk or 1024
        args.contexts = args.contexts or [16000, 32000]
        args.tasks, args.n = args.tasks or ["passkey"], args.n or 4
        args.max_new_tokens = args.max_new_tokens or 24
        args.methods = [m for m in args.methods.split(",") if m]
        if args.model == "tiny":
            parser.error("--stages answers the task suite: it needs a model with a tokenizer, not tiny")
        if args.summary_only and not args.resume:
            parser.error("--summary-only rewrites the summary from the runs kept: it needs --resume")
        out = Path(args.out) if args.out else common.RESULTS / "long_context_stages.json"
        return run_staged(args, out)
    args.memory_methods = [m for m in args.memory_methods.split(",") if m]
    if not args.memory_methods or set(args.memory_methods) - set(METHODS):
        parser.error(f"--memory-methods takes a comma-separated subset of {','.join(METHODS)}, "
                     f"got {','.join(args.memory_methods) or 'nothing'}")
    args.tasks, args.n = args.tasks or ["passkey", "multikey"], args.n or 8
    args.max_new_tokens = args.max_new_tokens or 16
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
