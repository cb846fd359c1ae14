#!/usr/bin/env python
"""Check and time the quantized ragged decode attention (int8 / int4 / fp8 records) on a CUDA GPU.

1. Correctness: the Triton kernel against the torch reference (which dequantizes the records and runs
   the full-precision reference) in bf16 and fp16, int8, int4 and fp8, Q in {1, 4}, Ada-shaped rows with an
   empty one; and against full-precision attention over the original entries (the quantization error,
   reported, not a pass/fail criterion).
2. Time of one decode step (Q=1) of one layer, H_kv=8, G=4, D=128, B=1 and 8, at the contexts given
   (default 32k and 128k), Ada-shaped rows: full-precision Triton kernel, int8, int4, fp8 records (CUDA-graph
   replay, caches rotated so the reads come from HBM). Reported: microseconds, bytes held per layer, and
   the ratio to the full-precision kernel (the records hold ``bits / 16`` of a 16-bit cache plus scales,
   so a memory-bound kernel should run faster, not slower).
3. Attention over selected pages of the records (``sparse_quantized_attention_triton``, Quest-style reads): checked
   against its torch reference (``sparse_quantized_attention_ref``) with a residual ring of 8 and an empty row, Q in
   {1, 4}, a third of the pages, soft-cap and sinks; every page selected against the dense kernel above. Timed in
   part 2 over the same rows on ``--page-size`` pages, each row reading ``--read-fraction`` of its pages (no ring,
   no logit extras; its output against the reference's there too): its time, its ratio to the dense kernel over the
   same records, and the torch reference's time (gather and dequantize the selected pages, then attend: what CUDA
   ran before the kernel; eager, it syncs the host).

Results go to benchmarks/results/gpu_quantized.json (``--out``), written after each part (``"complete": true``
once all ran). Without CUDA the script prints a message and exits 0, except with ``--cpu-smoke`` (tiny shapes
through the Triton interpreter, fp32/fp16, one timed call each; default output /tmp/gpu_quantized_smoke.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_quantized.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--group-size", type=int, default=32, help="channels per scale and zero point (default 32)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--page-size", type=int, default=16, help="entries per page of the sparse reads (default 16)")
    p.add_argument("--read-fraction", type=float, default=0.25,
                   help="fraction of each row's pages the sparse reads select (default 0.25)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny shapes via TRITON_INTERPRET=1")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _layouts(group: int) -> dict:
    """The record layouts measured, by name: the storage kinds' own (int groups of ``group`` channels)."""
    from kvpress_ada.storage import Fp8, Int4, Int8

    return {"int8": Int8(group_size=group, residual=0).layout, "int4": Int4(group_size=group, residual=0).layout,
            "fp8": Fp8().layout}


def check(kernels, qt, tk, bench, dtypes, device, gen, small: bool, group: int) -> list[dict]:
    import torch

    out = []
    D = 32 if small else 128
    group = min(group, D)
    ctx = 64 if small else 4096
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
    for dtype in dtypes:
        for name, layout in _layouts(group).items():
            for Q in (1, 4):
                B, H_kv, G = 2, 2 if small else 8, 4
                lens = bench.ada_lengths(B * H_kv, ctx, 0.5, 10.0, gen)
                lens[0] = 0
                q, k, v, offs, lens_t = bench.make_ragged(B, H_kv, G, D, Q, lens, dtype, device, gen, gaps=3)
                k_rec, v_rec, side = kernels.quantized.scheme.quantize_rows(k, v, offs, lens_t, layout)
                scale = D ** -0.5
                got = qt.quantized_attention_triton(q, k_rec, v_rec, offs, lens_t, side, scale, layout)
                scheme = kernels.quantized.scheme
                ref = scheme.quantized_attention_ref(q, k_rec, v_rec, offs, lens_t, side, scale, layout)
                full = kernels.ragged_attention_ref(q, k, v, offs, lens_t, scale)
                err = (got.float() - ref.float()).abs().max().item()
                quant_err = (ref.float() - full.float()).abs().max().item()
                ok = bool(torch.isfinite(got).all()) and err <= tol[dtype] * max(1.0, ref.float().abs().max().item())
                out.append(dict(dtype=str(dtype), storage=name, Q=Q, max_abs_err=err, quantization_err=quant_err,
                                ok=ok))
                print(f"  check {name} {str(dtype):15s} Q={Q}: max|triton - ref|={err:.2e} "
                      f"(|quantized - full precision| {quant_err:.2e}) {'ok' if ok else 'FAIL'}")
                out.append(check_sparse(kernels, qt, bench, layout, name, dtype, Q, device, gen, small, tol[dtype]))
    return out


def with_ring(side, residual: int, gen):
    """``side`` with a residual ring of ``residual`` random keys and values per row (what a row's newest entries read
    as; any values serve a check against the reference, which reads the same)."""
    import torch

    ring = torch.randn((2 * residual, *side.shape[1:]), generator=gen).to(side.dtype).to(side.device)
    return torch.cat((side, ring)).contiguous()


def check_sparse(kernels, qt, bench, layout, name, dtype, Q, device, gen, small: bool, tol: float,
                 page: int = 16) -> dict:
    """Attention over a third of the pages of Ada-shaped rows of records (an empty row, a ring of 8, soft-cap and
    sinks) against its torch reference, and over every page against the dense Triton kernel."""
    import torch

    from kvpress_ada.kernels.quantized import sparse_triton_kernel as sq
    from kvpress_ada.kernels.ragged.sparse import sparse_quantized_attention_ref

    D = 32 if small else 128
    B, H_kv, G = 2, 2 if small else 8, 4
    lens = bench.ada_lengths(B * H_kv, 64 if small else 4096, 0.5, 10.0, gen)
    lens[0] = 0
    q, k, v, offs, lens_t = bench.make_ragged(B, H_kv, G, D, Q, lens, dtype, device, gen, gaps=3, align=page)
    k_rec, v_rec, side = kernels.quantized.scheme.quantize_rows(k, v, offs, lens_t, layout)
    side = with_ring(side, 8, gen)
    table, selected, _ = bench.sparse_case(lens_t, offs, k.shape[0], page, 0.33, device, gen)
    scale = D ** -0.5
    softcap, sinks = 5.0, torch.randn(H_kv * G, generator=gen).to(device)
    got = sq.sparse_quantized_attention_triton(q, k_rec, v_rec, lens_t, side, table, selected, page, scale, layout,
                                               softcap=softcap, sinks=sinks)
    ref = sparse_quantized_attention_ref(q, k_rec, v_rec, offs, lens_t, side, table, selected, page, scale, layout,
                                         softcap, sinks)
    every = sq.sparse_quantized_attention_triton(q, k_rec, v_rec, lens_t, side, table, torch.ones_like(selected),
                                                 page, scale, layout, softcap=softcap, sinks=sinks)
    dense = qt.quantized_attention_triton(q, k_rec, v_rec, offs, lens_t, side, scale, layout, softcap=softcap,
                                          sinks=sinks)
    err = (got.float() - ref.float()).abs().max().item()
    err_all = (every.float() - dense.float()).abs().max().item()
    ok = bool(torch.isfinite(got).all() and torch.isfinite(every).all()) \
        and err <= tol * max(1.0, ref.float().abs().max().item()) \
        and err_all <= tol * max(1.0, dense.float().abs().max().item())
    print(f"  check sparse {name} {str(dtype):15s} Q={Q}: max|triton - ref|="
          f"{err:.2e}, every page: max|sparse - dense|={err_all:.2e} {'ok' if ok else 'FAIL'}")
    return dict(op="sparse_quantized_attention", dtype=str(dtype), storage=name, Q=Q, max_abs_err=err,
                every_page_vs_dense_err=err_all, ok=ok)


def time_eager(fns, iters: int, cuda: bool) -> float:
    """Seconds per call of each of ``fns`` launched eagerly (for calls that sync the host: no CUDA graph)."""
    import time

    import torch

    for f in fns:
        f()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        for f in fns:
            f()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / (iters * len(fns))


def measure(args, kernels, qt, tk, bench, context, B, dtype, device, gen, cuda) -> dict:
    import torch

    H_kv, G, D = (8, 4, 128) if cuda else (2, 4, 32)
    R = B * H_kv
    lens = bench.ada_lengths(R, context, args.ratio, 10.0, gen)
    scale = D ** -0.5
    full_bytes = 2 * sum(lens) * D * dtype.itemsize
    n_rep = bench.replicas_for(full_bytes, cuda)
    caches = [bench.make_ragged(B, H_kv, G, D, 1, lens, dtype, device, gen) for _ in range(n_rep)]
    row = dict(context=context, B=B, kept_tokens=sum(lens), bytes_full=full_bytes)
    fns = [lambda c=c: tk.ragged_attention_triton(c[0], c[1], c[2], c[3], c[4], scale) for c in caches]
    row["full_us"] = bench.time_fns(fns, args.iters, cuda) * 1e6
    parts = [f"full {row['full_us']:8.1f} us"]
    for name, layout in _layouts(args.group_size).items():
        recs = [(c[0], *kernels.quantized.scheme.quantize_rows(c[1], c[2], c[3], c[4], layout), c[3], c[4])
                for c in caches]  # (q, k_rec, v_rec, side, offsets, lengths)
        fns = [lambda c=c, lay=layout: qt.quantized_attention_triton(c[0], c[1], c[2], c[4], c[5], c[3], scale, lay)
               for c in recs]
        us = bench.time_fns(fns, args.iters, cuda) * 1e6
        row[f"{name}_us"] = us
        row[f"{name}_bytes"] = 2 * recs[0][1].shape[0] * recs[0][1].shape[1] + recs[0][3].nbytes
        row[f"{name}_vs_full"] = us / row["full_us"]
        parts.append(f"{name} {us:8.1f} us ({us / row['full_us']:.2f}x, "
                     f"{row[f'{name}_bytes'] / full_bytes:.2f} of the bytes)")
    print(f"  ctx={context:>6} B={B}: " + " | ".join(parts))
    # attention over selected pages of the records: the same rows on page boundaries
    from kvpress_ada.kernels.quantized import sparse_triton_kernel as sq
    from kvpress_ada.kernels.ragged.sparse import sparse_quantized_attention_ref

    P = args.page_size
    paged = [bench.make_ragged(B, H_kv, G, D, 1, lens, dtype, device, gen, align=P) for _ in range(n_rep)]
    table, selected, read_entries = bench.sparse_case(paged[0][4], paged[0][3], paged[0][1].shape[0], P,
                                                      args.read_fraction, device, gen)
    row["sparse_read_entries"] = read_entries
    parts = [f"sparse ({read_entries / sum(lens):.2f} read)"]
    for name, layout in _layouts(args.group_size).items():
        recs = [(c[0], *kernels.quantized.scheme.quantize_rows(c[1], c[2], c[3], c[4], layout), c[3], c[4])
                for c in paged]  # (q, k_rec, v_rec, side, offsets, lengths)
        fns = [lambda c=c, lay=layout: sq.sparse_quantized_attention_triton(c[0], c[1], c[2], c[5], c[3], table,
                                                                            selected, P, scale, lay) for c in recs]
        us = bench.time_fns(fns, args.iters, cuda) * 1e6
        refs = [lambda c=c, lay=layout: sparse_quantized_attention_ref(c[0], c[1], c[2], c[4], c[5], c[3], table,
                                                                       selected, P, scale, lay) for c in recs[:1]]
        ref_us = time_eager(refs, max(1, args.iters // 10), cuda) * 1e6
        got, want = fns[0]().float(), refs[0]().float()
        err = (got - want).abs().max().item()
        ok = bool(torch.isfinite(got).all()) and err <= 3e-2 * max(1.0, want.abs().max().item())  # bf16's tolerance
        row.update({f"{name}_sparse_us": us, f"{name}_sparse_vs_dense": us / row[f"{name}_us"],
                    f"{name}_sparse_ref_us": ref_us, f"{name}_sparse_max_abs_err": err, f"{name}_sparse_ok": ok})
        parts.append(f"{name} {us:8.1f} us ({us / row[f'{name}_us']:.2f}x dense {name}; torch reference "
                     f"{ref_us:8.1f} us; max|err| {err:.1e})")
    print(f"  ctx={context:>6} B={B}: " + " | ".join(parts))
    del paged, recs, fns, refs
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("no CUDA device: nothing to measure (use --cpu-smoke to exercise the code on CPU)")
        return 0
    import bench_kernels as bench

    from kvpress_ada import kernels
    from kvpress_ada.kernels.quantized import triton_kernel as qt
    from kvpress_ada.kernels.ragged import triton_kernel as tk

    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    dtypes = [torch.bfloat16, torch.float16] if cuda else [torch.float32, torch.float16]
    result = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
              "torch": torch.__version__, "group_size": args.group_size}
    out = args.out or (Path("/tmp/gpu_quantized_smoke.json") if args.cpu_smoke else DEFAULT_OUT)

    def save(complete: bool = False):
        """Write what was measured so far (a timeout keeps it); ``complete`` once everything ran."""
        result["complete"] = complete
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))

    print("correctness:")
    result["checks"] = check(kernels, qt, tk, bench, dtypes, device, gen, not cuda, args.group_size)
    save()
    print("time per decode step of one layer:")
    contexts = args.contexts if cuda else [128]
    batches = args.batches if cuda else [1]
    if not cuda:
        args.iters = 1
    result["timings"] = []
    for c in contexts:
        for B in batches:
            result["timings"].append(measure(args, kernels, qt, tk, bench, c, B,
                                             dtypes[0] if cuda else torch.float32, device, gen, cuda))
            save()
    save(complete=True)
    print(f"wrote {out}")
    sparse_ok = all(v for t in result["timings"] for k, v in t.items() if k.endswith("_sparse_ok"))
    return 0 if all(c["ok"] for c in result["checks"]) and sparse_ok else 1


if __name__ == "__main__":
    sys.exit(main())
