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
    return out


def measure(args, kernels, qt, tk, bench, context, B, dtype, device, gen, cuda) -> dict:
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
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
