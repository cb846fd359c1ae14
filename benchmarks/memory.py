"""KV-cache bytes and process peak memory: full cache vs SnapKV vs Ada-SnapKV (ragged cache).

For every (context length, config) a fresh subprocess loads the model, warms up on a short
prompt, resets the kernel's RSS high-water mark (``/proc/self/clear_refs``), then runs

  prefill + layer-by-layer compression (``with press(model)``, logits for the last position only)
  -> ``--decode-steps`` greedy decode steps (each appends one token to the cache)

and reports:

* KV bytes held (``RaggedCache.nbytes()``; the dense ``DynamicCache`` tensors for the full cache)
  right after compression and after decoding, absolute and as a fraction of the full cache;
* the documented bound right after compression:
  ``nbytes <= ((1 - r) + 0.03) * full + n_layers * B * H_kv * decode_reserve * head_dim * 2 * itemsize``
  (``decode_reserve`` is read from the library's ``RaggedLayer``);
* peak RSS (``VmHWM``) of the prefill+compression phase and of the decode phase, absolute and as a
  delta over the RSS after model load and warm-up.

Why RSS: on CPU, torch has no caching allocator with statistics (``torch.cuda.max_memory_allocated``
has no CPU counterpart) and ``tracemalloc`` does not see tensor storage (allocated by c10, not by
Python's allocator). The RSS high-water of a dedicated process is what the operating system really had
to provide; a subprocess per config keeps peaks from mixing. With glibc's default policy, freed
tensor memory often stays in the process (the dynamic mmap threshold moves up after the first frees),
which added up to ~100 MiB of config-dependent noise to the peaks in a first run; so by default
(``--allocator strict``) workers run with a fixed 64 KiB mmap threshold and call ``malloc_trim``
before each phase, and the RSS high-water then tracks the peak of live tensor bytes. KV bytes are
exact (tensor sizes); the RSS peak deltas also include activations (and, in the absolute numbers,
the model's weights and the Python runtime).

    python benchmarks/memory.py                 # 2k and 4k, full/snapkv/ada_snapkv x r in {0.5, 0.75, 0.9}
    python benchmarks/memory.py --quick         # smoke run on a tiny random model (< 1 min)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BOUND_SLACK = 0.03


# ----------------------------------------------------------------------------- worker (one config)


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset the RSS high-water mark (Linux >= 4.0); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    hwm = _status_kib("VmHWM")
    if hwm is None:  # not Linux: the lifetime maximum, in KiB on Linux and bytes on macOS
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r / 2**20 if sys.platform == "darwin" else r / 1024
    return hwm / 1024


def rss_mib() -> float:
    rss = _status_kib("VmRSS")
    return rss / 1024 if rss is not None else float("nan")


def release_free_memory() -> None:
    """Collect garbage and hand free heap pages back to the OS (glibc ``malloc_trim``), so that the RSS
    that follows is live memory rather than what the allocator kept from earlier phases."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def worker(cfg: dict) -> dict:
    import torch

    from kvpress_ada import preset

    threads = common.set_threads(cfg["threads"])
    model, tok = common.load_model(cfg["model"])
    geom = common.kv_geometry(model)
    L, steps = cfg["context"], cfg["decode_steps"]
    ids = common.context_ids(tok, L, model.config.vocab_size)
    press = None if cfg["method"] == "full" else preset(cfg["method"], compression_ratio=cfg["ratio"])

    # warm-up on a short prompt: one-time allocations (op registration, lazily built buffers) do not count
    warm_len = min(L, 256)
    cache, nxt = common.prefill(model, ids[:, :warm_len], press)
    common.decode(model, cache, nxt, 2, press)
    del cache, nxt
    release_free_memory()

    supported = reset_peak()
    base = rss_mib()
    t0 = time.perf_counter()
    cache, nxt = common.prefill(model, ids, press)
    t_prefill = time.perf_counter() - t0
    peak_prefill = peak_rss_mib()
    kv_compressed = common.cache_nbytes(cache)
    kept = common.kept_tokens(cache)
    lengths = None
    if hasattr(cache, "head_lengths"):
        per_head = torch.stack([cache.head_lengths(i).flatten() for i in range(len(cache.layers))])
        lengths = {"min": int(per_head.min()), "mean": float(per_head.float().mean()), "max": int(per_head.max())}
    reserve_slots = getattr(cache.layers[0], "decode_reserve", 0) if press is not None else 0

    release_free_memory()
    reset_peak()
    base_decode = rss_mib()
    t0 = time.perf_counter()
    tokens = common.decode(model, cache, nxt, steps, press)
    t_decode = time.perf_counter() - t0
    peak_decode = peak_rss_mib()
    kv_decoded = common.cache_nbytes(cache)

    full = common.full_kv_bytes(geom, ids.shape[0], L)
    reserve = geom["n_layers"] * ids.shape[0] * geom["n_kv_heads"] * reserve_slots * geom["head_dim"] * 2 * geom[
        "itemsize"]
    result = dict(cfg)
    result.update({
        "threads_used": threads,
        "geometry": geom,
        "full_kv_bytes": full,
        "kv_bytes_compressed": kv_compressed,
        "kv_fraction_compressed": kv_compressed / full,
        "kv_bytes_after_decode": kv_decoded,
        "kv_fraction_after_decode": kv_decoded / full,
        "kept_tokens": kept,
        "kept_fraction": kept / (geom["n_layers"] * ids.shape[0] * geom["n_kv_heads"] * L),
        "head_lengths": lengths,
        "decode_reserve": reserve_slots,
        "peak_reset_supported": supported,
        "rss_base_mib": base,
        "peak_rss_prefill_mib": peak_prefill,
        "peak_rss_decode_mib": peak_decode,
        "peak_rss_mib": max(peak_prefill, peak_decode),
        "peak_delta_prefill_mib": peak_prefill - base,
        "peak_delta_decode_mib": peak_decode - base,
        "rss_decode_start_mib": base_decode,
        "peak_delta_decode_vs_start_mib": peak_decode - base_decode,
        "rss_end_mib": rss_mib(),
        "prefill_s": t_prefill,
        "decode_s": t_decode,
        "decoded_tokens": tokens,
    })
    if press is not None:
        bound = ((1 - cfg["ratio"]) + BOUND_SLACK) * full + reserve
        result.update({"bound_bytes": bound, "reserve_bytes": reserve, "bound_ok": kv_compressed <= bound,
                       "bound_margin": kv_compressed / bound})
    return result


# ----------------------------------------------------------------------------- driver


def configs(args) -> list[dict]:
    out = []
    for L in args.contexts:
        out.append(dict(model=args.model, context=L, method="full", ratio=0.0, decode_steps=args.decode_steps,
                        threads=args.threads, allocator=args.allocator))
        for method in args.methods:
            for r in args.ratios:
                out.append(dict(model=args.model, context=L, method=method, ratio=r, decode_steps=args.decode_steps,
                                threads=args.threads, allocator=args.allocator))
    return out


def worker_env(allocator: str) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if allocator == "strict":
        # a fixed mmap threshold: every allocation of 64 KiB or more (all tensors that matter) is its own
        # mapping, returned to the OS on free, so the RSS high-water tracks the peak of live tensor bytes
        env.update({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"})
    return env


def run_one(cfg: dict, timeout: float) -> dict:
    cmd = [common.python(), str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=common.ROOT,
                          env=worker_env(cfg["allocator"]))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed for {cfg} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(results: list[dict]) -> str:
    headers = ["ctx", "method", "r", "KV MiB (compr.)", "frac", "bound MiB", "ok", "KV MiB (+decode)",
               "peak dRSS prefill MiB", "peak dRSS decode MiB", "peak RSS MiB", "kept/head min-mean-max"]
    rows = []
    for x in results:
        hl = x["head_lengths"]
        rows.append([
            x["context"], x["method"], f"{x['ratio']:.2f}" if x["method"] != "full" else "-",
            f"{x['kv_bytes_compressed'] / 2**20:.1f}", f"{x['kv_fraction_compressed']:.3f}",
            f"{x['bound_bytes'] / 2**20:.1f}" if "bound_bytes" in x else "-",
            ("PASS" if x["bound_ok"] else "FAIL") if "bound_ok" in x else "-",
            f"{x['kv_bytes_after_decode'] / 2**20:.1f}",
            f"{x['peak_delta_prefill_mib']:.0f}", f"{x['peak_delta_decode_mib']:.0f}", f"{x['peak_rss_mib']:.0f}",
            f"{hl['min']}-{hl['mean']:.0f}-{hl['max']}" if hl else "-",
        ])
    return common.fmt_table(headers, rows)


def plot(results: list[dict], path: Path, model_name: str) -> None:
    """Per context: KV bytes after compression and peak RSS deltas (prefill, decode) per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({x["context"] for x in results})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6.5 * len(contexts), 4.2), squeeze=False)
    for ax, L in zip(axes[0], contexts):
        rows = [x for x in results if x["context"] == L]
        labels = [x["method"] if x["method"] == "full" else f"{x['method']}\n@{x['ratio']:g}" for x in rows]
        xs = range(len(rows))
        w = 0.27
        ax.bar([i - w for i in xs], [x["kv_bytes_compressed"] / 2**20 for x in rows], w, label="KV bytes (compressed)")
        ax.bar(list(xs), [x["peak_delta_prefill_mib"] for x in rows], w, label="peak RSS delta, prefill+compress")
        ax.bar([i + w for i in xs], [x["peak_delta_decode_mib"] for x in rows], w, label="peak RSS delta, decode")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("MiB")
        ax.set_title(f"context {L}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"KV cache and peak memory over the loaded model, {model_name} model (CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    from kvpress_ada.harness.eval.report import save_figure

    save_figure(fig, path, dpi=110)
    plt.close(fig)


def report(payload: dict, out: Path) -> bool:
    """Print the table and verdict, write the PNG next to the JSON; returns whether the bound held."""
    results, info, settings = payload["results"], payload["machine"], payload["settings"]
    print(f"\nKV cache and peak memory ({settings['model']} model, {settings['decode_steps']} decode steps, "
          f"{info['cpu_count']} CPUs, torch {info['torch']})")
    print(table(results))
    bound_results = [x for x in results if "bound_ok" in x]
    print(f"\nbound nbytes <= ((1-r)+{BOUND_SLACK})*full + reserve right after compression: "
          f"{'PASS' if payload['bound_all_ok'] else 'FAIL'} ({sum(x['bound_ok'] for x in bound_results)}/"
          f"{len(bound_results)})")
    png = out.with_suffix(".png")
    plot(results, png, settings["model"])
    print(f"plot: {png}")
    return payload["bound_all_ok"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__ + "\nSee benchmarks/README.md for the results and their analysis.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=common.MODEL_CHOICES, default=None,
                        help="'default' = embedded SmolLM2-135M-Instruct (fp32), 'tiny' = small random Llama "
                             "(default: 'default', or 'tiny' with --quick)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="context lengths in tokens "
                        "(default: 2048 4096; 256 with --quick)")
    parser.add_argument("--methods", nargs="+", default=["snapkv", "ada_snapkv"],
                        help="presets to compare (default: snapkv ada_snapkv)")
    parser.add_argument("--ratios", type=float, nargs="+", default=None,
                        help="compression ratios (default: 0.5 0.75 0.9; 0.75 with --quick)")
    parser.add_argument("--decode-steps", type=int, default=None, help="decode steps after compression "
                        "(default: 32; 4 with --quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per worker (memory does not depend on it; 1 keeps runs "
                             "robust on a shared machine; default: 1)")
    parser.add_argument("--allocator", choices=["strict", "default"], default="strict",
                        help="'strict': workers run with a fixed glibc mmap threshold (64 KiB) so freed tensors go "
                             "back to the OS and peak RSS tracks live tensor bytes; 'default': the stock glibc "
                             "policy (what an ordinary process sees, including allocator retention). Default: strict")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per worker (default: 900)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (< 1 min)")
    parser.add_argument("--out", default=None, help="JSON output path (default: benchmarks/results/memory.json; "
                        "with --quick a temporary folder, so smoke runs never overwrite results)")
    parser.add_argument("--replot", action="store_true", help="only print the table and redraw the PNG from the "
                        "existing --out JSON (no measurement)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0

    q = args.quick
    args.model = args.model or ("tiny" if q else "default")
    args.contexts = args.contexts or ([256] if q else [2048, 4096])
    args.ratios = args.ratios or ([0.75] if q else [0.5, 0.75, 0.9])
    args.decode_steps = args.decode_steps if args.decode_steps is not None else (4 if q else 32)
    out = Path(args.out) if args.out else (common.QUICK_DIR if q else common.RESULTS) / "memory.json"

    if args.replot:
        return 0 if report(json.loads(out.read_text()), out) else 1

    from tqdm import tqdm

    info = common.machine_info()
    started = time.perf_counter()
    results = []
    for cfg in tqdm(configs(args), desc="memory configs", unit="cfg"):
        results.append(run_one(cfg, args.timeout))
    elapsed = time.perf_counter() - started
    payload = {
        "benchmark": "memory",
        "created": common.now_iso(),
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "replot")},
        "method": "one subprocess per config; RSS high-water (VmHWM) reset after model load + warm-up via "
                  "/proc/self/clear_refs; KV bytes from tensor sizes",
        "bound_all_ok": all(x["bound_ok"] for x in results if "bound_ok" in x),
        "elapsed_s": elapsed,
        "results": results,
    }
    common.write_json(out, payload)
    verdict = report(payload, out)
    print(f"total {elapsed:.0f} s")
    print(f"wrote {out}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
