#!/usr/bin/env python
"""Benchmark the ragged (Ada-KV) decode attention kernel on a CUDA GPU.

1. Correctness: Triton vs the torch reference in bf16 and fp16 (Ada-shaped rows, Q in
   {1, 4}, GQA), attention over selected pages vs its reference (and, all pages selected, vs
   ragged attention), plus compaction vs its reference.
2. Bandwidth: one decode step (Q=1) of one layer, H_kv=8, G=4, D=128, at contexts
   8k..128k and B in {1, 8}. Row lengths are Ada-shaped: drawn log-uniformly so rows
   differ ~10x, scaled so they average (1 - ratio) * context. Achieved bandwidth = bytes of
   K and V read / kernel time (CUDA-graph replay, caches rotated so reads come from HBM),
   reported as a fraction of --peak-bw (default 4.8e12 B/s, H200 HBM3e). Side by side:
   torch SDPA over a dense cache of the same kept size (the same bytes), and, if
   ``flash_attn`` is importable, ``flash_attn_varlen_func`` with each kv row as a sequence.
   The goal is >= 70% of peak at 32k.
   Beside it, attention over selected pages (Quest-style sparse reads, ``sparse_triton_kernel``) over the same
   rows laid out on ``--page-size`` pages, each row reading ``--read-fraction`` of its pages: its time, and its
   bandwidth over the bytes of the pages it reads (the number that should match the dense kernel's).
3. ``--sweep``: try launch configs (split size, block_n, warps, stages) at 32k and report
   the best ones (to retune ``triton_kernels.default_config``).

Results go to benchmarks/results/gpu_kernels.json (``--out``), written after each part (``"complete": true``
once all ran). Without CUDA the script
prints a message and exits 0, except with ``--cpu-smoke``: tiny shapes through the Triton
interpreter (fp32/fp16) to check that the correctness and measuring code paths run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_kernels.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072],
                   help="context lengths before compression (default: 8k 16k 32k 64k 128k)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    p.add_argument("--ratio", type=float, default=0.5,
                   help="compression ratio r: rows keep (1 - r) * context tokens on average (default 0.5)")
    p.add_argument("--spread", type=float, default=10.0, help="max/min row length ratio (default 10)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per kv head (GQA group, default 4)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="dtype of the timed runs")
    p.add_argument("--peak-bw", type=float, default=4.8e12, help="peak HBM bandwidth in B/s (default 4.8e12, H200)")
    p.add_argument("--iters", type=int, default=50, help="graph replays per measurement")
    p.add_argument("--goal", type=float, default=0.70, help="target fraction of peak at 32k (default 0.70)")
    p.add_argument("--page-size", type=int, default=16, help="entries per page of the sparse reads (default 16)")
    p.add_argument("--read-fraction", type=float, default=0.25,
                   help="fraction of each row's pages the sparse reads select (default 0.25)")
    p.add_argument("--sweep", action="store_true", help="also sweep launch configs at 32k")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: run the checks and the measuring code on tiny shapes via TRITON_INTERPRET=1")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- shapes


def ada_lengths(rows: int, context: int, ratio: float, spread: float, gen) -> list[int]:
    """Ada-KV-shaped row lengths: log-uniform over a ``spread``x range, clipped to the
    context, scaled (bisection) so the mean is ``(1 - ratio) * context``."""
    import torch

    target = max(1.0, (1.0 - ratio) * context)
    x = torch.exp(torch.rand(rows, generator=gen, dtype=torch.float64) * math.log(spread))
    lo, hi = 0.0, float(context)
    for _ in range(60):
        a = (lo + hi) / 2
        if torch.clamp(a * x, max=context).mean().item() < target:
            lo = a
        else:
            hi = a
    lens = torch.clamp((hi * x).round(), 1, context).to(torch.int64)
    return lens.tolist()


def randn(shape, dtype, device, gen):
    """Random data made on the device itself (fast for GB-sized caches); ``gen`` (a CPU
    generator) is only used on CPU, CUDA draws from the global seed."""
    import torch

    if device.type == "cpu":
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randn(shape, device=device, dtype=dtype)


def make_ragged(B, H_kv, G, D, Q, lens, dtype, device, gen, gaps=0, align=1):
    """Packed ragged cache (``gaps`` spare slots after each row, each row's capacity rounded up to a multiple of
    ``align``: rows start on page boundaries) and queries."""
    import torch

    R = B * H_kv
    caps = [-(-(n + gaps) // align) * align for n in lens]
    offs = [0] * R
    for r in range(1, R):
        offs[r] = offs[r - 1] + caps[r - 1]
    N = sum(caps)
    k = randn((N, D), dtype, device, gen)
    v = randn((N, D), dtype, device, gen)
    q = randn((B, H_kv * G, Q, D), dtype, device, gen)
    ti = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return q, k, v, ti(offs), ti(lens)


# ----------------------------------------------------------------------------- timing


def time_fns(fns, iters, cuda: bool) -> float:
    """Seconds per call of each of ``fns`` (called in turn). CUDA: one CUDA graph that
    runs all of them, replayed ``iters`` times (no launch/Python overhead in the number).
    CPU (smoke): wall clock."""
    import torch

    if not cuda:
        for f in fns:
            f()
        t = time.perf_counter()
        for _ in range(iters):
            for f in fns:
                f()
        return (time.perf_counter() - t) / (iters * len(fns))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        run = g.replay
    except Exception as e:  # noqa: BLE001 - fall back to plain launches
        print(f"  (graph capture failed: {type(e).__name__}: {e}; timing eager launches)")
        torch.cuda.synchronize()

        def run():
            for f in fns:
                f()

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (iters * len(fns))


def replicas_for(bytes_per_call: int, cuda: bool, l2_bytes: int = 60 << 20) -> int:
    """How many cache copies to rotate through so one graph replay reads >= 4x the L2."""
    if not cuda:
        return 1
    return max(1, min(16, math.ceil(4 * l2_bytes / max(1, bytes_per_call))))


# ----------------------------------------------------------------------------- checks


def sparse_case(lens, offs, n_slots, page, fraction, device, gen):
    """The page table of a page-aligned ragged layout and a random selection of about ``fraction`` of each row's
    pages (at least one where the row holds any), with the bytes-read count: entries held in selected pages."""
    import torch

    from kvpress_ada.kernels.ragged.sparse import page_table

    table = page_table(offs, n_slots, page)
    R, W = table.shape
    held = (torch.arange(W, device=device) * page)[None, :] < lens.long()[:, None]  # pages holding an entry
    pick = (torch.rand(R, W, generator=gen) < fraction).to(device) & held
    first = held & (torch.cumsum(held, -1) == 1)
    selected = pick | (first & ~pick.any(-1, keepdim=True))
    entries = torch.clamp(lens.long()[:, None] - torch.arange(W, device=device) * page, 0, page)
    return table, selected, int((entries * selected).sum())


def check_correctness(kernels, tk, dtypes, device, gen, small: bool, page: int = 16) -> list[dict]:
    import torch

    from kvpress_ada.kernels.ragged import sparse_triton_kernel as st
    from kvpress_ada.kernels.ragged.sparse import sparse_attention_ref

    out = []
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
    ctx = 64 if small else 4096
    D = 32 if small else 128
    for dtype in dtypes:
        for Q in (1, 4):
            for split in (0, 16 if small else 256):
                B, H_kv, G = 2, 2 if small else 8, 4
                lens = ada_lengths(B * H_kv, ctx, 0.5, 10.0, gen)
                lens[0] = 0  # an empty row
                q, k, v, offs, lens_t = make_ragged(B, H_kv, G, D, Q, lens, dtype, device, gen, gaps=3)
                scale = D**-0.5
                got = tk.ragged_attention_triton(q, k, v, offs, lens_t, scale, split_size=split)
                ref = kernels.ragged_attention_ref(q, k, v, offs, lens_t, scale)
                err = (got.float() - ref.float()).abs().max().item()
                ok = bool(torch.isfinite(got).all()) and err <= tol[dtype] * max(1.0, ref.float().abs().max().item())
                out.append(dict(op="ragged_attention", dtype=str(dtype), Q=Q, split_size=split, max_abs_err=err, ok=ok))
                print(f"  check ragged_attention {str(dtype):15s} Q={Q} split={split or 'auto':>4}: "
                      f"max|err|={err:.2e} {'ok' if ok else 'FAIL'}")
        # attention over selected pages (a third of them; then all: ragged attention)
        for Q in (1, 4):
            B, H_kv, G = 2, 2 if small else 8, 4
            lens = ada_lengths(B * H_kv, ctx, 0.5, 10.0, gen)
            lens[0] = 0
            q, k, v, offs, lens_t = make_ragged(B, H_kv, G, D, Q, lens, dtype, device, gen, gaps=3, align=page)
            table, selected, _ = sparse_case(lens_t, offs, k.shape[0], page, 0.33, device, gen)
            scale = D**-0.5
            for name, sel, ref in (
                    ("some", selected, sparse_attention_ref(q, k, v, offs, lens_t, table, selected, page, scale)),
                    ("all", torch.ones_like(selected), kernels.ragged_attention_ref(q, k, v, offs, lens_t, scale))):
                got = st.sparse_attention_triton(q, k, v, lens_t, table, sel, page, scale)
                err = (got.float() - ref.float()).abs().max().item()
                ok = bool(torch.isfinite(got).all()) and err <= tol[dtype] * max(1.0, ref.float().abs().max().item())
                out.append(dict(op="sparse_attention", dtype=str(dtype), Q=Q, pages=name, max_abs_err=err, ok=ok))
                print(f"  check sparse_attention {str(dtype):15s} Q={Q} pages={name:>4}: max|err|={err:.2e} "
                      f"{'ok' if ok else 'FAIL'}")
        # compaction
        B, H, L = 2, 2 if small else 8, ctx
        keys = randn((B, L, H, D), dtype, device, gen).transpose(1, 2)
        vals = randn((B, H, L, D), dtype, device, gen)
        keep = torch.rand(B, H, L, generator=gen).to(device) < 0.3
        counts = keep.sum(-1).flatten()
        offs = (torch.cumsum(counts, 0) - counts).to(torch.int32)
        N = int(counts.sum()) + 1
        kf1, vf1, kf2, vf2 = (torch.zeros(N, D, device=device, dtype=dtype) for _ in range(4))
        tk.compact_triton(keys, vals, keep, offs, kf1, vf1)
        kernels.compact_ref(keys, vals, keep, offs, kf2, vf2)
        ok = bool(torch.equal(kf1, kf2) and torch.equal(vf1, vf2))
        out.append(dict(op="compact", dtype=str(dtype), ok=ok))
        print(f"  check compact          {str(dtype):15s}: {'ok' if ok else 'FAIL'}")
    return out


# ----------------------------------------------------------------------------- measure


def measure(args, kernels, tk, context, B, dtype, device, gen, cuda, flash_varlen=None, configs=None):
    import torch
    import torch.nn.functional as F

    H_kv, G, D = args.kv_heads, args.group, args.head_dim
    R = B * H_kv
    lens = ada_lengths(R, context, args.ratio, args.spread, gen)
    kept = sum(lens)
    elem = torch.tensor([], dtype=dtype).element_size()
    bytes_kv = 2 * kept * D * elem
    n_rep = replicas_for(bytes_kv, cuda)
    caches = [make_ragged(B, H_kv, G, D, 1, lens, dtype, device, gen) for _ in range(n_rep)]
    scale = D**-0.5
    row = dict(context=context, B=B, rows=R, kept_tokens=kept, min_len=min(lens), max_len=max(lens),
               mean_len=kept / R, bytes_kv=bytes_kv, replicas=n_rep,
               default_config=tk.default_config(D, G, caches[0][1].shape[0], dtype, device))

    def report(name, sec):
        bw = bytes_kv / sec
        row[f"{name}_us"] = sec * 1e6
        row[f"{name}_bw"] = bw
        row[f"{name}_frac_peak"] = bw / args.peak_bw
        return f"{name} {sec * 1e6:8.1f} us {bw / 1e12:5.2f} TB/s ({100 * bw / args.peak_bw:4.1f}%)"

    parts = []
    # Triton ragged attention (default launch config, or each of `configs`)
    for cfg in configs or [None]:
        kw = cfg or {}
        fns = [lambda c=c: tk.ragged_attention_triton(c[0], c[1], c[2], c[3], c[4], scale, **kw) for c in caches]
        try:
            sec = time_fns(fns, args.iters, cuda)
        except Exception as e:  # noqa: BLE001 - a config may not fit (shared memory)
            print(f"  config {kw} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        if cfg is None:
            parts.append(report("triton", sec))
        else:
            row.setdefault("sweep", []).append(dict(kw, us=sec * 1e6, frac_peak=bytes_kv / sec / args.peak_bw))
    if configs:
        return row
    # attention over selected pages: the same rows on page boundaries, each reading about read_fraction of its pages
    from kvpress_ada.kernels.ragged import sparse_triton_kernel as st

    P = args.page_size
    paged = [make_ragged(B, H_kv, G, D, 1, lens, dtype, device, gen, align=P) for _ in range(n_rep)]
    table, selected, read_entries = sparse_case(paged[0][4], paged[0][3], paged[0][1].shape[0], P,
                                                args.read_fraction, device, gen)
    fns = [lambda c=c: st.sparse_attention_triton(c[0], c[1], c[2], c[4], table, selected, P, scale) for c in paged]
    sec = time_fns(fns, args.iters, cuda)
    bytes_read = 2 * read_entries * D * elem
    row.update(sparse_read_entries=read_entries, sparse_us=sec * 1e6, sparse_bw=bytes_read / sec,
               sparse_frac_peak=bytes_read / sec / args.peak_bw)
    parts.append(f"sparse({read_entries / kept:.2f} read) {sec * 1e6:8.1f} us {bytes_read / sec / 1e12:5.2f} TB/s "
                 f"({100 * bytes_read / sec / args.peak_bw:4.1f}%)")
    del paged
    # dense SDPA over a cache of the same kept size (same bytes)
    n_dense = max(1, round(kept / R))
    dense = []
    for _ in range(n_rep):
        kd = randn((B, H_kv, n_dense, D), dtype, device, gen)
        vd = randn((B, H_kv, n_dense, D), dtype, device, gen)
        dense.append((caches[0][0], kd, vd))
    fns = [lambda d=d: F.scaled_dot_product_attention(d[0], d[1], d[2], scale=scale, enable_gqa=True) for d in dense]
    parts.append(report("sdpa_dense", time_fns(fns, args.iters, cuda)))
    if flash_varlen is not None:
        cu_q = torch.arange(R + 1, dtype=torch.int32, device=device)
        cu_k = torch.zeros(R + 1, dtype=torch.int32, device=device)
        cu_k[1:] = torch.cumsum(torch.tensor(lens, device=device), 0)
        fns = []
        for c in caches:
            qv = c[0].view(B, H_kv, G, D).reshape(R, G, D)
            kv_k, kv_v = c[1].view(-1, 1, D), c[2].view(-1, 1, D)
            fns.append(lambda qv=qv, kk=kv_k, vv=kv_v: flash_varlen(
                qv, kk, vv, cu_q, cu_k, 1, max(lens), softmax_scale=scale, causal=False))
        parts.append(report("flash_varlen", time_fns(fns, args.iters, cuda)))
    print(f"  ctx={context:>6} B={B} kept={kept:>8} (rows {min(lens)}..{max(lens)}): " + " | ".join(parts))
    return row


def measure_copy_bw(device) -> float:
    import torch

    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    sec = time_fns([lambda: y.copy_(x)], 20, True)
    return 2 * x.numel() / sec


SWEEP = [
    dict(split_size=s, block_n=bn, num_warps=w, num_stages=st)
    for s in (256, 512, 1024, 2048, 4096)
    for (bn, w, st) in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 8, 3), (64, 2, 3))
]


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel module is imported
    sys.path.insert(0, str(ROOT))
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("bench_kernels: no CUDA device available; nothing to benchmark (use --cpu-smoke "
              "to exercise the code paths on CPU through the Triton interpreter).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_kernels: triton is not installed; nothing to benchmark.")
        return 0

    from kvpress_ada import kernels
    from kvpress_ada.kernels.ragged import triton_kernel as tk

    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    flash_varlen = None
    try:
        from flash_attn import flash_attn_varlen_func as flash_varlen  # noqa: F811
    except Exception:  # noqa: BLE001 - optional
        flash_varlen = None
    if args.cpu_smoke:
        args.contexts = [c for c in args.contexts if c <= 512] or [128]
        args.batches = [b for b in args.batches if b <= 2] or [1]
        args.kv_heads, args.head_dim, args.iters = 2, 32, 1
        check_dtypes = [torch.float32, torch.float16]  # interpreter: tl.dot on bf16 is broken
        time_dtype = torch.float32
    else:
        check_dtypes = [torch.bfloat16, torch.float16]
        time_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16

    result = dict(
        device=torch.cuda.get_device_name(device) if cuda else f"cpu-smoke ({platform.processor() or 'cpu'})",
        torch=torch.__version__, triton=__import__("triton").__version__,
        flash_attn=flash_varlen is not None, peak_bw=args.peak_bw, dtype=str(time_dtype), ratio=args.ratio,
        spread=args.spread, kv_heads=args.kv_heads, group=args.group, head_dim=args.head_dim,
        page_size=args.page_size, read_fraction=args.read_fraction,
    )
    if cuda:
        result["copy_bw"] = measure_copy_bw(device)
        print(f"device {result['device']}: copy bandwidth {result['copy_bw'] / 1e12:.2f} TB/s "
              f"(peak given {args.peak_bw / 1e12:.2f} TB/s)")
    out = args.out if args.out is not None else (None if args.cpu_smoke else DEFAULT_OUT)

    def save(complete: bool = False):
        """Write what was measured so far (a timeout keeps it); ``complete`` once everything ran."""
        if out is not None:
            result["complete"] = complete
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))

    ok = True
    if not args.no_check:
        print("correctness (Triton vs torch reference):")
        result["checks"] = check_correctness(kernels, tk, check_dtypes, device, gen, small=not cuda,
                                             page=args.page_size)
        ok = all(c["ok"] for c in result["checks"])
        save()
    print(f"ragged decode attention, {time_dtype}, H_kv={args.kv_heads} G={args.group} D={args.head_dim}, "
          f"ratio={args.ratio}, spread={args.spread}x:")
    result["results"] = []
    for B in args.batches:
        for ctx in args.contexts:
            result["results"].append(measure(args, kernels, tk, ctx, B, time_dtype, device, gen, cuda, flash_varlen))
            save()
            if cuda:
                torch.cuda.empty_cache()
    goal_ctx = 32768 if 32768 in args.contexts else args.contexts[len(args.contexts) // 2]
    fracs = {r["B"]: r.get("triton_frac_peak") for r in result["results"] if r["context"] == goal_ctx}
    result["goal"] = dict(context=goal_ctx, target_frac=args.goal, frac_by_batch=fracs,
                          met=all(f is not None and f >= args.goal for f in fracs.values()))
    print(f"goal: >= {100 * args.goal:.0f}% of peak at {goal_ctx}: "
          + ", ".join(f"B={b}: {100 * (f or 0):.1f}%" for b, f in fracs.items())
          + (" (met)" if result["goal"]["met"] else " (not met)"))
    if args.sweep:
        print(f"sweep of launch configs at context {goal_ctx}:")
        result["sweep"] = []
        for B in args.batches:
            configs = SWEEP if cuda else SWEEP[:2]
            row = measure(args, kernels, tk, goal_ctx, B, time_dtype, device, gen, cuda, configs=configs)
            best = sorted(row.get("sweep", []), key=lambda c: c["us"])[:5]
            for c in best:
                print(f"  B={B} {c}")
            result["sweep"].append(dict(B=B, best=best, all=row.get("sweep", [])))
            save()
    if out is not None:
        save(complete=True)
        print(f"wrote {out}")
    if not ok:
        print("CORRECTNESS CHECK FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
