"""Cache-side cost of a decode step with quantized storage: deferred appends (the layer's default: eager
single-token appends, eager or compiled, go to the residual ring and are quantized in batches before they
leave it) against quantizing every appended token at once (a longer append, or ``defer_appends = False``),
and the full-precision ragged layer; with the fused CPU attention kernel (the default where it builds) and
with the torch reference.

No model: ``--layers`` ragged layers of random entries (a prompt of ``--context`` tokens, ``--keep`` of them
kept per row), then ``--steps`` decode steps, each an append and an attention per layer, timed per
configuration in interleaved repeats (medians). What it isolates is the cache's own work per step.

    python benchmarks/quantized_append.py --out benchmarks/results/quantized_append.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from kvpress_ada.hosts.transformers.quantized_cache import QuantizedRaggedLayer  # noqa: E402
from kvpress_ada.hosts.transformers.ragged_cache import RaggedLayer  # noqa: E402
from kvpress_ada.kernels.quantized.cpu_kernel import cpu_kernel, use_cpu_kernel  # noqa: E402
from kvpress_ada.kernels.quantized.scheme import RecordLayout  # noqa: E402


class ImmediateLayer(QuantizedRaggedLayer):
    """Quantizes every appended token at once (the compiled step's append)."""

    defer_appends = False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30, help="layers (the default model's 30)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--query-heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--keep", type=float, default=0.25, help="fraction of the context kept per row")
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--residual", type=int, default=32)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    B, H, L, D = 1, args.kv_heads, args.context, args.head_dim
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(B, H, L, D, generator=gen), torch.randn(B, H, L, D, generator=gen)
    keep = torch.rand(B, H, L, generator=gen) < args.keep
    steps = [(torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen),
              torch.randn(B, args.query_heads, 1, D, generator=gen)) for _ in range(args.steps)]

    def deferred():
        return QuantizedRaggedLayer(RecordLayout("int", args.bits, 32, args.residual))

    # name -> (layer maker, whether the fused CPU kernel attends)
    makers = {"full precision": (RaggedLayer, True),
              "deferred": (deferred, True),
              "immediate": (lambda: ImmediateLayer(RecordLayout("int", args.bits, 32, args.residual)), True),
              "deferred, torch reference attention": (deferred, False)}
    if not cpu_kernel():
        print("the fused CPU kernel is unavailable: every configuration attends with the torch reference",
              file=sys.stderr)

    def run(make, kernel: bool) -> float:
        layers = [make() for _ in range(args.layers)]
        for layer in layers:
            layer.update(keys, values)
            layer.compress(keep)
        start = time.perf_counter()
        with torch.no_grad(), use_cpu_kernel(kernel):
            for k, v, q in steps:
                for layer in layers:
                    layer.update(k, v)
                    layer._attention(q, D ** -0.5)
        return (time.perf_counter() - start) / args.steps * 1e3

    times: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(args.reps):
        for name, (make, kernel) in makers.items():
            times[name].append(run(make, kernel))
    summary = {name: {"ms_per_step_median": statistics.median(t), "all": t} for name, t in times.items()}
    for name, s in summary.items():
        print(f"{name:36s} {s['ms_per_step_median']:7.2f} ms per step ({args.layers} layers, cache side)")
    if args.out:
        payload = {"benchmark": "quantized_append", "command": " ".join(sys.argv), "machine": common.machine_info(),
                   "cpu_kernel": cpu_kernel(), "args": {k: str(v) for k, v in vars(args).items()}, "results": summary}
        print(f"wrote {common.write_json(args.out, payload)}", file=sys.stderr)


if __name__ == "__main__":
    main()
