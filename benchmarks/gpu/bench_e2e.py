#!/usr/bin/env python
"""End-to-end decode on a CUDA GPU: full cache vs SnapKV vs Ada-SnapKV (ragged cache, Triton kernels).

A randomly initialised Llama of a public shape (``--shape``; no weights can reach the GPU
machine): speed and memory do not depend on the weights, but Ada's head allocation does
(random weights give flatter attention, so rows differ less than with a trained model).

Per (context, batch) and config (``full``, and each press at each ratio), in one process:

1. prefill (+ layer-by-layer compression under a press), logits of the last position only;
   wall time (synchronised), peak CUDA memory above the model's weights, KV bytes held;
2. ``--steps`` greedy decode steps, tokens/s after 2 warm-up steps (their time, ``warmup_s``, holds the
   compile / CUDA-graph recording of the compiled rows); each press runs eager (``press(model,
   compile=False)``) and compiled (``<method>+compile``: ``press(model, compile=True)``, the library's
   ``torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")`` decode step, CUDA graphs);
3. peak CUDA memory over the whole job.

Then (first, with ``--check-first``) a correctness check on the GPU: the ragged cache (TopK evictor, Triton
kernels) and the masked reference (Mask evictor, dense SDPA over masked keys) decode the same tokens in fp32.

Results: ``benchmarks/results/gpu_e2e.json`` (``--out``), written after each row (``"complete": true`` once all
ran). Without CUDA it exits 0 with a
message, except with ``--cpu-smoke`` (tiny shape, CPU, torch reference kernels) to check the
code paths.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_e2e.json"

SHAPES = {  # public configs (hidden, intermediate, layers, q heads, kv heads, head dim, vocab)
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=256),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b", help="model shape (default llama-3.2-1b)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--methods", nargs="+", default=["snapkv", "ada_snapkv"])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75])
    p.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    p.add_argument("--check-context", type=int, default=2048, help="context of the ragged-vs-masked check")
    p.add_argument("--check-steps", type=int, default=16)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--check-first", action="store_true",
                   help="the ragged-vs-masked check before the timings (a timeout then cuts timings, not it)")
    p.add_argument("--compiled-only", action="store_true",
                   help="time only the compiled press configs (+compile rows: press(model, compile=True), CUDA graphs)")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny shapes on CPU to exercise the code")
    return p.parse_args(argv)


def build_model(shape: str, dtype, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model


class Clock:
    """Wall time with CUDA synchronisation; peak CUDA memory when on a GPU."""

    def __init__(self, device: str):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def reset_peak(self) -> int:
        if not self.cuda:
            return 0
        gc.collect()
        self.torch.cuda.empty_cache()
        self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.memory_allocated()

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else 0


class Compiled:
    """``press`` applied with an explicit ``compile`` choice (on CUDA ``compile=True`` is the library's default:
    one ``torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")`` decode step, CUDA graphs)."""

    def __init__(self, press, compile: bool):
        self.press, self.compile = press, compile

    def __call__(self, model):
        return self.press(model, compile=self.compile)


def run_config(model, ids, press, steps: int, clock: Clock) -> dict:
    import common

    base = clock.reset_peak()
    t0 = clock.now()
    cache, nxt = common.prefill(model, ids, press)
    prefill_s = clock.now() - t0
    peak_prefill = clock.peak() - base
    kv_bytes = common.cache_nbytes(cache)
    t0 = clock.now()
    warm = common.decode(model, cache, nxt, 2, press)  # compiled configs compile (or re-record) here
    warm_s = clock.now() - t0
    nxt = clock.torch.tensor([[warm[-1]]] * ids.shape[0], device=ids.device)
    t0 = clock.now()
    tokens = common.decode(model, cache, nxt, steps, press)
    decode_s = clock.now() - t0
    row = {"prefill_s": prefill_s, "kv_bytes": kv_bytes, "peak_prefill_bytes": peak_prefill,
           "peak_total_bytes": clock.peak() - base, "decode_s": decode_s, "warmup_s": warm_s,
           "tokens_per_s": steps * ids.shape[0] / decode_s, "steps_per_s": steps / decode_s, "tokens": tokens}
    del cache
    return row


def check_ragged_vs_masked(args, device: str, clock: Clock) -> list[dict]:
    """TopK (ragged, Triton on CUDA) vs Mask (masked SDPA) on the same press: same greedy tokens in fp32."""
    import common
    import torch

    from kvpress_ada import preset
    from kvpress_ada.evictors import Mask

    model = build_model(args.shape if not args.cpu_smoke else "tiny", torch.float32, device)
    B = 2
    ids = torch.randint(4, model.config.vocab_size, (B, args.check_context), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    rows = []
    for method in args.methods:
        for ratio in args.ratios:
            out = {}
            for evictor in ("topk", "mask"):
                press = preset(method, compression_ratio=ratio) if evictor == "topk" else \
                    preset(method, compression_ratio=ratio, evictor=Mask())
                cache, nxt = common.prefill(model, ids, press)
                with torch.inference_mode(), press(model):
                    logits = []
                    tokens = []
                    key = common.cache_kwarg(model)
                    for _ in range(args.check_steps):
                        o = model(input_ids=nxt, use_cache=True, **{key: cache})
                        cache = common.output_cache(o)
                        logits.append(o.logits[:, -1].float())
                        nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                        tokens.append(nxt[:, 0].tolist())
                out[evictor] = (tokens, torch.stack(logits))
                del cache
            same = sum(a == b for a, b in zip(out["topk"][0], out["mask"][0])) / len(out["topk"][0])
            diff = (out["topk"][1] - out["mask"][1]).abs().max().item()
            rows.append({"method": method, "ratio": ratio, "context": args.check_context, "batch": B,
                         "token_agreement": same, "max_abs_logit_diff": diff})
            print(f"[check] {method}@{ratio:g}: ragged vs masked token agreement {same:.3f}, "
                  f"max |logit diff| {diff:.2e}", flush=True)
    del model
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import common
    import torch

    from kvpress_ada import preset

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("no CUDA device: nothing to measure (use --cpu-smoke to exercise the code on CPU)")
        return 0
    device = "cuda" if not args.cpu_smoke else "cpu"
    if args.cpu_smoke:
        args.shape, args.dtype, args.contexts, args.batches, args.steps = "tiny", "fp32", [256], [1, 2], 4
        args.ratios, args.check_context, args.check_steps = [0.75], 128, 4
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    out_path = args.out or (Path("/tmp/gpu_e2e_smoke.json") if args.cpu_smoke else DEFAULT_OUT)
    clock = Clock(device)
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "date": common.now_iso(), "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        import transformers
        import triton

        info.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    payload = {"benchmark": "gpu_e2e", "machine": info, "results": [], "check": [], "errors": []}

    def save(complete: bool = False):
        payload["complete"] = complete
        common.write_json(out_path, payload)

    def run_check():
        try:
            payload["check"] = check_ragged_vs_masked(args, device, clock)
        except Exception as exc:
            payload["errors"].append({"config": "check", "error": repr(exc),
                                      "traceback": traceback.format_exc()[-3000:]})
            print(f"[error] check: {exc!r}", flush=True)
        save()

    if args.check_first and not args.no_check:
        run_check()

    model = build_model(args.shape, dtype, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    info["weights_bytes"] = weights
    print(f"[model] {args.shape} {args.dtype}: {weights / 2**30:.2f} GiB of weights on {info['device']}", flush=True)
    configs = [("full", 0.0, None)] + [(m + suffix, r, Compiled(preset(m, compression_ratio=r), compile))
                                       for m in args.methods for r in args.ratios
                                       for suffix, compile in (("", False), ("+compile", True))
                                       if compile or not args.compiled_only]
    warm_ids = torch.randint(4, model.config.vocab_size, (1, 256), device=device)
    for _, _, press in configs:  # compile Triton kernels and warm allocators outside the timed runs
        run_config(model, warm_ids, press, 2, clock)
    for L in args.contexts:
        for B in args.batches:
            ids = torch.randint(4, model.config.vocab_size, (B, L), device=device,
                                generator=torch.Generator(device).manual_seed(L + B))
            full = None
            for name, ratio, press in configs:
                label = name if press is None else f"{name}@{ratio:g}"
                try:
                    row = run_config(model, ids, press, args.steps, clock)
                except Exception as exc:  # keep measuring the other configs; the error is reported
                    if clock.cuda:
                        torch.cuda.empty_cache()
                    payload["errors"].append({"context": L, "batch": B, "config": label, "error": repr(exc),
                                              "traceback": traceback.format_exc()[-3000:]})
                    print(f"[error] ctx={L} B={B} {label}: {exc!r}", flush=True)
                    save()
                    continue
                full = row if press is None else full
                row.update(context=L, batch=B, config=label, method=name, ratio=ratio)
                if full is not None:
                    row["kv_fraction"] = row["kv_bytes"] / full["kv_bytes"]
                    row["x_full_tokens_per_s"] = row["tokens_per_s"] / full["tokens_per_s"]
                    row["prefill_overhead"] = row["prefill_s"] / full["prefill_s"] - 1
                    row["peak_total_vs_full"] = (row["peak_total_bytes"] / full["peak_total_bytes"]
                                                 if full["peak_total_bytes"] else None)
                payload["results"].append(row)
                print(f"[run] ctx={L:6d} B={B} {label:16s} prefill {row['prefill_s']*1e3:8.1f} ms  "
                      f"decode {row['tokens_per_s']:8.1f} tok/s (x{row.get('x_full_tokens_per_s', 1):.2f})  "
                      f"KV {row['kv_bytes'] / 2**20:9.1f} MiB (x{row.get('kv_fraction', 1):.3f})  "
                      f"peak {row['peak_total_bytes'] / 2**20:9.1f} MiB", flush=True)
                save()
    del model
    if clock.cuda:
        torch.cuda.empty_cache()
    if not args.no_check and not args.check_first:
        run_check()
    save(complete=True)
    print(f"wrote {out_path}")
    return 1 if payload["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
