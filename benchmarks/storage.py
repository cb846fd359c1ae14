"""Bytes held and greedy decode speed of a press per storage (full precision, int8, int4), on CPU.

One prefill (``capture_prefill``); for every repeat and every (storage, ratio) a fresh cache is derived
from it (``Prefill.compressed_cache``, not timed) and ``--steps`` decode forwards run inside the press
(ragged attention over full-precision rows, or over int8 / int4 records dequantized as they are read).
Repeats are interleaved (rep -> config, order rotated every repeat) and each quantized config's speed is
divided by the full-precision ragged cache's *within the same repeat*, then the median over repeats is
reported, so the machine's noise hits every config alike. Bytes held are ``cache.nbytes()`` (records,
scales and zero points, the decode reserve) after the steps, as a fraction of the dense full cache of
the context (measured on the captured prefill). Target: int4 decode no slower than 1.2x full precision.
The report says whether the fused CPU kernel served the quantized attention (``cpu_kernel``;
``KVPRESS_ADA_CPU_KERNEL=0`` measures the torch reference instead).

    python benchmarks/storage.py --model default-random --context 2048      # default model's shape, random weights
    python benchmarks/storage.py --model default --context 1000             # the embedded SmolLM2-135M
    python benchmarks/storage.py --quick                                    # smoke run on a tiny model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kvpress_ada.kernels.quantized.cpu_kernel import cpu_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET_INT4_SLOWDOWN = 1.2


def load(name: str):
    """``(model, tokenizer)``; ``default-random``: the default model's architecture (SmolLM2-135M: 30 layers,
    9 query / 3 kv heads, head dim 64) with random weights, for speed only (no download)."""
    if name != "default-random":
        return common.load_model(name)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model, None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="default-random", choices=(*common.MODEL_CHOICES, "default-random"))
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--ratios", default="0,0.5,0.75", help="comma-separated compression ratios (0: quantize only)")
    p.add_argument("--preset", default="ada_snapkv")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=48, help="decode forwards per timed run")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(common.RESULTS / "storage.json"))
    p.add_argument("--quick", action="store_true", help="tiny random model, short context (smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.context, args.steps, args.reps, args.group_size = "tiny", 256, 8, 2, 16
        args.out = str(common.QUICK_DIR / "storage.json")
    threads = common.set_threads(args.threads)

    from kvpress_ada import Int4, Int8, preset
    from kvpress_ada.hosts.transformers.fanout import capture_prefill

    model, tok = load(args.model)
    ids = common.context_ids(tok, args.context, model.config.vocab_size)
    t0 = time.perf_counter()
    prefill = capture_prefill(model, ids)
    prefill_s = time.perf_counter() - t0
    full_bytes = prefill.nbytes
    first = prefill.logits.argmax(-1, keepdim=True)
    storages = {"full": None, "int8": Int8(group_size=args.group_size), "int4": Int4(group_size=args.group_size)}
    configs = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        for label, storage in storages.items():
            if ratio == 0 and storage is None:
                continue  # the dense full cache: another code path, not what the ratio compares
            extra = {} if storage is None else {"storage": storage}
            configs.append({"storage": label, "ratio": ratio, "press": preset(args.preset, compression_ratio=ratio,
                                                                             **extra), "tps": [], "bytes": None})
    masks = {c["ratio"]: prefill.keep_masks(c["press"]) for c in configs if c["storage"] == "full"}
    print(f"{args.model}: context {args.context}, prefill {prefill_s:.1f}s, full cache {full_bytes / 2**20:.1f} MiB, "
          f"{threads} threads; {len(configs)} configs x {args.reps} repeats x {args.steps} steps", file=sys.stderr)
    for rep in range(args.reps):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for c in order:
            cache = prefill.compressed_cache(c["press"], masks.get(c["ratio"]) if c["ratio"] else None)
            times: list[float] = []
            common.decode(model, cache, first, args.steps, press=c["press"], step_times=times)
            c["tps"].append(args.steps / sum(times))
            c["bytes"] = cache.nbytes()
        print(f"repeat {rep + 1}/{args.reps} done", file=sys.stderr)
    by_key = {(c["storage"], c["ratio"]): c for c in configs}
    rows, records = [], []
    for c in configs:
        ref = by_key.get(("full", c["ratio"]))
        slowdown = None
        if ref is not None and c is not ref:
            slowdown = statistics.median(r / t for r, t in zip(ref["tps"], c["tps"]))
        records.append({"storage": c["storage"], "ratio": c["ratio"], "kv_bytes": c["bytes"],
                        "kv_fraction": c["bytes"] / full_bytes, "tokens_per_s": common.summarize(c["tps"]),
                        "time_vs_full_precision": slowdown})
        rows.append([c["storage"], c["ratio"], f"{c['bytes'] / 2**20:.2f}", f"{c['bytes'] / full_bytes:.3f}",
                     f"{statistics.median(c['tps']):.2f}", "" if slowdown is None else f"{slowdown:.2f}x"])
    print(common.fmt_table(["storage", "ratio", "KV MiB held", "of full cache", "decode tok/s (median)",
                            "step time vs full precision (median of per-repeat ratios)"], rows))
    int4 = [r["time_vs_full_precision"] for r in records if r["storage"] == "int4" and r["time_vs_full_precision"]]
    if int4:
        print(f"target: int4 decode no slower than {TARGET_INT4_SLOWDOWN}x full precision: worst {max(int4):.2f}x "
              f"-> {'met' if max(int4) <= TARGET_INT4_SLOWDOWN else 'NOT met'}")
    payload = {"benchmark": "storage", "command": " ".join([common.python(), *sys.argv]), "when": common.now_iso(),
               "machine": common.machine_info(), "model": args.model, "context": args.context,
               "preset": args.preset, "group_size": args.group_size, "steps": args.steps, "reps": args.reps,
               "threads": threads, "cpu_kernel": cpu_kernel(), "full_kv_bytes": full_bytes, "prefill_s": prefill_s,
               "records": records}
    print(f"wrote {common.write_json(args.out, payload)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
