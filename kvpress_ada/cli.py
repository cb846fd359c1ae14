"""``kvpress-ada``: the demo and the quality-vs-compression evaluation on the default model."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_PRESETS = "snapkv,ada_snapkv"
DEFAULT_RATIOS = "0.25,0.5,0.75"


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ratios(value: str) -> list[float]:
    try:
        ratios = [float(v) for v in _split(value)]
    except ValueError:
        raise UsageError(f"--ratios must be comma-separated numbers in [0, 1), got {value!r}") from None
    bad = [r for r in ratios if not 0.0 <= r < 1.0]
    if bad or not ratios:
        raise UsageError(f"--ratios must be in [0, 1) (fraction of KV entries evicted), got {bad or value!r}")
    return ratios


def _load_config(path: str):
    from pydantic import ValidationError

    from .pipeline import Pipeline

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    text = file.read_text()
    try:
        if file.suffix in (".yaml", ".yml"):
            import yaml

            return Pipeline.model_validate(yaml.safe_load(text))
        return Pipeline.model_validate_json(text)
    except (ValidationError, ValueError) as err:
        first = str(err).strip().splitlines()
        raise UsageError(f"--config {path}: invalid pipeline: {' '.join(first[:3])}") from None


def _check_context(model, context: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and context + 64 > limit:
        raise UsageError(f"--context {context} is longer than the model supports ({limit} positions, "
                         "minus room for the question and answer)")


def _load_model(name: str):
    from .models import load

    print(f"loading model {name!r} ...", file=sys.stderr)
    return load(name)


# --------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    import torch

    from .eval.tasks import make_samples
    from .integration.fanout import capture_prefill
    from .integration.generation import encode, eos_ids, greedy_continue, greedy_decode, split_prompt
    from .presets import preset

    press = preset(args.preset, compression_ratio=args.ratio)
    model, tok = _load_model(args.model)
    _check_context(model, args.context)
    sample = make_samples("passkey", tok, 1, args.context, seed=args.seed)[0]
    head, tail = split_prompt(tok, sample.context, sample.question)
    head_ids, tail_ids = encode(tok, head, "cpu"), encode(tok, tail, "cpu")
    prompt = torch.cat([head_ids, tail_ids], 1) if args.question_aware else head_ids
    eos = eos_ids(model, tok)
    mode = "question-aware" if args.question_aware else "question-agnostic (the question comes after compression)"
    print(f"document: {prompt.shape[1]} tokens of Python reference manual with a hidden pass key; {mode}")
    print(f"question: {sample.question}   (expected: {sample.answers[0]})\n")

    t0 = time.perf_counter()
    prefill = capture_prefill(model, prompt)
    t_prefill = time.perf_counter() - t0

    def answer(cache, pressing):
        with pressing:
            if args.question_aware:
                tokens, _ = greedy_decode(model, prefill.logits, cache, args.max_new_tokens, eos)
            else:
                tokens, _ = greedy_continue(model, tail_ids, cache, args.max_new_tokens, eos)
        return tok.decode(tokens, skip_special_tokens=True).strip()

    t0 = time.perf_counter()
    full_bytes = sum(t.numel() * t.element_size() for c in prefill.layers for t in (c.keys, c.values))
    full_answer = answer(prefill.compressed_cache(None), torch.inference_mode())
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = prefill.compressed_cache(press)
    t_compress = time.perf_counter() - t0
    kept_bytes = cache.nbytes()
    t0 = time.perf_counter()
    pressed_answer = answer(cache, press(model))
    t_pressed = time.perf_counter() - t0
    lengths = cache.head_lengths(model.config.num_hidden_layers // 2)[0].tolist()

    print(f"{'':<28}{'answer':<40}{'KV cache':>12}{'time':>10}")
    print(f"{'full cache':<28}{full_answer[:38]:<40}{full_bytes / 2**20:>9.2f} MB{t_full:>9.2f}s")
    print(f"{args.preset + f' @ {args.ratio:.0%}':<28}{pressed_answer[:38]:<40}{kept_bytes / 2**20:>9.2f} MB"
          f"{t_pressed:>9.2f}s")
    print(f"\nKV bytes: {full_bytes:,} -> {kept_bytes:,} ({kept_bytes / full_bytes:.1%} of full, really freed: "
          f"ragged per-head cache)")
    print(f"tokens kept per kv head in layer {model.config.num_hidden_layers // 2}: {lengths} (Ada-KV budgets differ per head)")
    print(f"prefill {t_prefill:.2f}s, scoring + allocation + compaction {t_compress:.2f}s (all layers)")
    return 0


# --------------------------------------------------------------------------- eval
def cmd_eval(args) -> int:
    from .eval.report import format_table, plot_accuracy
    from .eval.runner import evaluate, grid
    from .eval.tasks import TASKS, make_samples
    from .presets import preset_names

    presets = _split(args.presets) if args.presets else []
    unknown = [p for p in presets if p not in preset_names()]
    if unknown:
        raise UsageError(f"unknown preset {unknown[0]!r}; valid presets: {', '.join(preset_names())}")
    tasks = _split(args.tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(f"unknown task {(unknown or [args.tasks])[0]!r}; valid tasks: {', '.join(TASKS)}")
    ratios = _ratios(args.ratios)
    if args.n < 1:
        raise UsageError(f"--n must be >= 1 samples per task, got {args.n}")
    if args.context < 64:
        raise UsageError(f"--context must be >= 64 tokens, got {args.context}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    configs = {}
    if args.config:
        configs[Path(args.config).stem] = _load_config(args.config)
    if not presets and not configs:
        raise UsageError("give --presets and/or --config")

    model, tok = _load_model(args.model)
    _check_context(model, args.context)
    entries = grid(presets, ratios) + grid(configs, ratios)
    samples = [s for task in tasks for s in make_samples(task, tok, args.n, args.context, seed=args.seed)]
    result = evaluate(model, tok, samples, entries, question_aware=args.question_aware,
                      max_new_tokens=args.max_new_tokens, progress=not args.no_progress)
    summary = result.summary()
    print(format_table(summary))
    print(f"\n{len(samples)} samples x {len(entries)} configurations in {result.seconds:.1f}s "
          f"(one prefill per sample, fan-out)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"command": sys.argv, "model": args.model, "tasks": tasks, "context": args.context, "n": args.n,
               **result.to_dict()}
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    setting = "question-aware" if args.question_aware else "question-agnostic"
    plot_accuracy(summary, out / "accuracy.png", title=f"{args.model}, {','.join(tasks)}, {args.context} tokens, {setting}")
    print(f"wrote {out / 'results.json'} and {out / 'accuracy.png'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpress-ada", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    threads_help = ("CPU threads for torch (default: torch's choice); 1 is much faster on a busy machine, "
                    "where spinning OpenMP threads slow small decode matmuls down 10x")

    demo = sub.add_parser("demo", help="find a hidden fact in a long document with a compressed KV cache")
    demo.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M) or a path / hub id")
    demo.add_argument("--preset", default="ada_snapkv")
    demo.add_argument("--ratio", type=float, default=0.75, help="fraction of KV entries evicted, in [0, 1)")
    demo.add_argument("--context", type=int, default=1000, help="document length in tokens")
    demo.add_argument("--question-aware", action="store_true", help="compress context and question together")
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--threads", type=int, help=threads_help)
    demo.set_defaults(func=cmd_demo)

    ev = sub.add_parser("eval", help="accuracy / fidelity / eviction loss / KV bytes for presets x ratios")
    ev.add_argument("--presets", default=DEFAULT_PRESETS, help="comma-separated preset names")
    ev.add_argument("--ratios", default=DEFAULT_RATIOS, help="comma-separated compression ratios in [0, 1)")
    ev.add_argument("--tasks", default="passkey,multikey", help="comma-separated synthetic tasks")
    ev.add_argument("--n", type=int, default=32, help="samples per task")
    ev.add_argument("--context", type=int, default=1000, help="context length in tokens")
    ev.add_argument("--question-aware", action="store_true", help="compress context and question together")
    ev.add_argument("--model", default="default")
    ev.add_argument("--config", help="a Pipeline as JSON or YAML (custom compositions, registered scorers)")
    ev.add_argument("--max-new-tokens", type=int, default=24)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--out", default="kvpress_ada_eval", help="output directory for results.json and the plot")
    ev.add_argument("--no-progress", action="store_true")
    ev.add_argument("--threads", type=int, help=threads_help)
    ev.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            print(f"kvpress-ada {args.command}: error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    try:
        if args.command == "demo" and not 0.0 <= args.ratio < 1.0:
            raise UsageError(f"--ratio must be in [0, 1) (fraction of KV entries evicted), got {args.ratio}")
        return args.func(args)
    except UsageError as err:
        print(f"kvpress-ada {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # model loading and other user-facing failures: one paragraph, no traceback
        from .models import ModelLoadError

        if isinstance(err, (ModelLoadError, ValueError)):
            print(f"kvpress-ada {args.command}: error: {err}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
