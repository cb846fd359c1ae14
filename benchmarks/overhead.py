"""Compression overhead at prefill: wall time of a prefill with a press (dense attention +
scoring + allocation + compaction, layer by layer) vs the same prefill without one.

    python benchmarks/overhead.py                 # 4k context, snapkv and ada_snapkv at r=0.75
    python benchmarks/overhead.py --quick         # 512-token smoke run

Runs are interleaved (none, snapkv, ada_snapkv, none, ...) and the median of ``--reps`` is kept;
the target is an overhead <= 5% of prefill at 4k, and <= 2.2x the plain prefill (+120%) for a
scorer that runs a model pass of its own (KVzip's reconstruction):

    python benchmarks/overhead.py --presets snapkv,kvzip --out benchmarks/results/overhead_kvzip.json

The plain prefill is ``model(input_ids)``, logits for every position; ``--last-logits`` measures
the prefill as ``generate()`` runs it (logits of the last position only), a smaller denominator.

``--decode-steps N`` also times N greedy decode steps on each configuration's cache right after its
prefill (tokens/s and the ratio to the full cache of the same repetition). ``--contexts`` runs several
lengths in one run (the ratios are always within one length and repetition); ``--config FILE`` adds a
Pipeline from YAML/JSON (labelled with the file name, ``--ratio`` applied). Every measurement is
checkpointed in ``--out`` (``complete: false`` until the end); ``--resume`` keeps those already there.

    python benchmarks/overhead.py --model qwen2.5-coder-0.5b --contexts 4000 8000 --last-logits \\
        --presets snapkv,ada_snapkv,kvzip,ada_kvzip,lagkv --decode-steps 32 --resume
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def load_configs(args) -> dict:
    """``{"none": None, label: Pipeline, ...}``: the presets at ``--ratio`` and the ``--config`` files."""
    from kvpress_ada import Pipeline, preset

    configs: dict = {"none": None}
    for name in (n for n in args.presets.split(",") if n):
        configs[name] = preset(name, compression_ratio=args.ratio)
    for path in args.config:
        text = Path(path).read_text()
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        data = {**data, "compression_ratio": args.ratio, "budget": None}
        configs[Path(path).stem] = Pipeline.model_validate(data)
    return configs


def measure(model, ids, press, last_logits: bool, decode_steps: int) -> dict:
    """One prefill (and ``decode_steps`` greedy steps on its cache): seconds and tokens/s."""
    import torch

    key = common.cache_kwarg(model)
    logits = {"logits_to_keep": 1} if last_logits else {}
    with torch.inference_mode(), common.press_context(press, model):
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, **logits, **{key: None})
        row = {"prefill_s": time.perf_counter() - start}
    if decode_steps:
        cache = common.output_cache(out)
        row["kv_bytes"] = common.cache_nbytes(cache)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        start = time.perf_counter()
        common.decode(model, cache, nxt, decode_steps, press)
        row["decode_s"] = time.perf_counter() - start
        row["decode_tok_s"] = decode_steps / row["decode_s"]
    return row


def summarise(measurements: list[dict], contexts: list[int], configs: list[str], args) -> dict:
    out = {}
    for L in contexts:
        rows = {}
        reps = sorted({m["rep"] for m in measurements if m["context"] == L})
        by = {(m["rep"], m["config"]): m for m in measurements if m["context"] == L}
        for name in configs:
            ts = [by[(r, name)]["prefill_s"] for r in reps if (r, name) in by]
            if not ts:
                continue
            base = [by[(r, "none")]["prefill_s"] for r in reps if (r, name) in by and (r, "none") in by]
            ratios = [by[(r, name)]["prefill_s"] / by[(r, "none")]["prefill_s"] for r in reps
                      if (r, name) in by and (r, "none") in by]
            row = {"seconds": ts, "median_s": statistics.median(ts),
                   "overhead": statistics.median(ts) / statistics.median(base) - 1.0 if base else None,
                   "ratio_per_rep": ratios}
            dec = [by[(r, name)]["decode_tok_s"] for r in reps if "decode_tok_s" in by.get((r, name), {})]
            if dec:
                full = [by[(r, "none")]["decode_tok_s"] for r in reps
                        if "decode_tok_s" in by.get((r, name), {}) and (r, "none") in by]
                row.update({"decode_tok_s": dec, "decode_tok_s_median": statistics.median(dec),
                            "decode_x_full_median": statistics.median(a / b for a, b in zip(dec, full))
                            if len(full) == len(dec) else None,
                            "kv_bytes": next(by[(r, name)]["kv_bytes"] for r in reps
                                             if "kv_bytes" in by.get((r, name), {}))})
            rows[name] = row
        out[str(L)] = rows
    return out


def readme_rows(summary: dict, configs: dict) -> str:
    lines = ["| context | press | prefill (median) | x no press (per-rep range) | decode tok/s | x full |",
             "|--:|---|--:|---|--:|--:|"]
    for L, rows in summary.items():
        for name, row in rows.items():
            rng = (f" ({min(row['ratio_per_rep']):.2f}-{max(row['ratio_per_rep']):.2f})"
                   if row["ratio_per_rep"] and name != "none" else "")
            x = "-" if name == "none" else f"{row['overhead'] + 1:.2f}x{rng}"
            dec = row.get("decode_tok_s_median")
            xf = row.get("decode_x_full_median")
            lines.append(f"| {int(L):,} | {'none' if configs.get(name) is None else f'`{name}`'} | "
                         f"{row['median_s']:.2f} s | {x} | {'-' if dec is None else f'{dec:.2f}'} | "
                         f"{'-' if xf is None else f'{xf:.2f}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=common.MODEL_CHOICES, default="default")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="several lengths (replaces --context)")
    parser.add_argument("--presets", default="snapkv,ada_snapkv")
    parser.add_argument("--config", action="append", default=[], help="a Pipeline YAML/JSON file (repeatable)")
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=0, help="greedy decode steps timed after each prefill")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="512-token smoke run, 1 repetition")
    parser.add_argument("--last-logits", action="store_true",
                        help="prefill as generate() runs it: logits of the last position only "
                             "(default: model(input_ids) with logits for every position)")
    parser.add_argument("--resume", action="store_true", help="keep the measurements already in --out (same settings)")
    parser.add_argument("--out", default=str(common.RESULTS / "overhead.json"))
    args = parser.parse_args(argv)

    common.set_threads(args.threads)
    model, tok = common.load_model(args.model)
    contexts = [512] if args.quick else (args.contexts or [args.context])
    reps = 1 if args.quick else args.reps
    configs = load_configs(args)
    out = common.QUICK_DIR / "overhead.json" if args.quick else Path(args.out)
    settings = {"model": args.model, "contexts": contexts, "ratio": args.ratio, "threads": args.threads, "reps": reps,
                "last_logits": args.last_logits, "decode_steps": args.decode_steps,
                "configs": {k: None if v is None else v.model_dump(mode="json") for k, v in configs.items()}}
    measurements: list[dict] = []
    if args.resume and out.exists():
        old = json.loads(out.read_text())
        if old.get("settings") == json.loads(json.dumps(settings)):
            measurements = old.get("measurements", [])
            print(f"[resume] {len(measurements)} measurements kept from {out}", file=sys.stderr)
        else:
            print(f"[resume] {out} has other settings; starting over", file=sys.stderr)
    done = {(m["context"], m["rep"], m["config"]) for m in measurements}
    ids_by_len = {L: common.context_ids(tok, L, getattr(model.config, "vocab_size", None)) for L in contexts}

    def write(complete: bool) -> dict:
        summary = summarise(measurements, contexts, list(configs), args)
        payload = {"machine": common.machine_info(), "date": common.now_iso(), "complete": complete,
                   "settings": settings, "context": contexts[0], "ratio": args.ratio, "threads": args.threads,
                   "reps": reps, "logits": "last position" if args.last_logits else "every position",
                   "results": summary[str(contexts[0])], "by_context": summary, "measurements": measurements}
        common.write_json(out, payload)
        return payload

    todo = [(L, rep, name) for L in contexts for rep in range(reps)
            for name in (list(configs) if rep % 2 == 0 else list(configs)[::-1]) if (L, rep, name) not in done]
    if todo:  # warm-up (not recorded): every configuration once on a short prompt
        for name, press in configs.items():
            measure(model, ids_by_len[contexts[0]][:, :256], press, args.last_logits, min(args.decode_steps, 2))
    start = time.perf_counter()
    for n_done, (L, rep, name) in enumerate(todo, 1):
        row = measure(model, ids_by_len[L], configs[name], args.last_logits, args.decode_steps)
        measurements.append({"context": L, "rep": rep, "config": name, **row})
        write(complete=False)
        left = (time.perf_counter() - start) / n_done * (len(todo) - n_done)
        print(f"{L} rep {rep} {name:<24} prefill {row['prefill_s']:.2f} s"
              + (f", decode {row['decode_tok_s']:.2f} tok/s" if "decode_tok_s" in row else "")
              + f"  (~{left / 60:.0f} min left)", flush=True)
    payload = write(complete=True)
    for L, rows in payload["by_context"].items():
        for name, row in rows.items():
            press = configs[name]
            if press is None or row["overhead"] is None:
                continue
            # one-pass presses: <= 5% of prefill; a scorer with its own model pass (KVzip): <= 2.2x prefill
            target = 1.2 if type(press.scorer).needs_model_pass else 0.05
            row["target_overhead"] = target
            verdict = "PASS" if row["overhead"] <= target else "MISS"
            print(f"{L:>6} {name:<24} prefill {row['median_s']:.2f}s  overhead {row['overhead']:+.1%} "
                  f"(target <= {target:+.0%}) {verdict}")
    common.write_json(out, payload)
    print("\nREADME rows:\n")
    print(readme_rows(payload["by_context"], configs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
