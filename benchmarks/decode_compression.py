"""Decode-phase compression over a long generation: KV bytes over time, tokens/s, agreement.

From a short chat prompt, the full-cache model generates ``--steps`` tokens greedily (EOS
suppressed so the continuation has the requested length); its log-probs are kept. Every
configuration then teacher-forces that same continuation one token per forward (so all see the
same token ids) and records, at every step, the KV bytes held, KL(full || press) and whether its
top-1 token equals the full-cache one, plus the forward times (tokens/s):

* ours: ``Pipeline(scorer, allocator, decode_budget=B, decode_interval=K)``, decode-only (the
  short prompt is not compressed), ragged cache; scorers SnapKV (uniform and Ada heads),
  StreamingLLM and KNorm;
* kvpress (``--kvpress``): ``DecodingPress(base, compression_interval=K, target_size=B)`` with the
  same bases, in its own virtualenv (``benchmarks/decode_compression_worker.py``), true RoPE
  positions passed explicitly as kvpress's pipeline does.

``--config FILE`` (repeatable; ``FILE@R`` sets its compression ratio, e.g. ``kvzap.yaml@0.9375``): a pipeline file
(YAML or JSON, as ``kvpress-ada eval --config``) teacher-forced like the others, its prompt compressed at the prefill
by its own ratio and its reader (sparse page reads, if any) used at every step; the row label is the file name (with
``@R``). With ``--config`` the built-in decode-compression configs run only when ``--only`` names them.

``--prompt-tokens N`` replaces the short prompt by ~N tokens of real text (the Python manual, as the
task suite's haystack) followed by a request to summarise it, so decoding starts over a long prompt
that the decode-only pipelines then compact too. The JSON at ``--out`` is rewritten after the full-cache
generation and after every configuration (with ``complete: false`` until the end); ``--resume`` keeps
the configurations already there (the full-cache generation is rerun and must give the same tokens).

    python benchmarks/decode_compression.py                    # default model, 2048 tokens
    python benchmarks/decode_compression.py --kvpress          # + kvpress DecodingPress side by side
    python benchmarks/decode_compression.py --quick            # tiny random model, 96 tokens
    python benchmarks/decode_compression.py --model qwen2.5-coder-0.5b --prompt-tokens 4000 --kvpress --resume
    python benchmarks/decode_compression.py --model qwen2.5-coder-0.5b --prompt-tokens 4000 --steps 1024 \
        --config benchmarks/configs/qwen2.5-coder-0.5b/kvzap.yaml@0.9375 \
        --config benchmarks/configs/qwen2.5-coder-0.5b/kvzap_ada_read256.yaml --resume
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", choices=common.MODEL_CHOICES)
    p.add_argument("--steps", type=int, default=2048, help="generated tokens")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="a prompt of about this many tokens of real text plus a request to summarise it "
                        "(0: the short story prompt)")
    p.add_argument("--budget", type=int, default=256, help="decode_budget: tokens per kv head after compaction")
    p.add_argument("--interval", type=int, default=64, help="decode_interval: generated tokens between compactions")
    p.add_argument("--window", type=int, default=32, help="SnapKV observation window (generated queries)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default="", help="comma-separated configurations of ours to run (default: all); "
                                              "kvzap and kvzap_layerwise need the default model's surrogate")
    p.add_argument("--config", action="append", default=[], metavar="FILE[@R]",
                   help="a pipeline file (YAML or JSON, as `kvpress-ada eval --config`), its prompt compressed at "
                        "the prefill; FILE@R sets its compression ratio R; repeatable")
    p.add_argument("--kvpress", action="store_true", help="also run kvpress's DecodingPress (its own venv)")
    p.add_argument("--venv", type=Path, default=None, help="kvpress virtualenv (see benchmarks/kvpress_compare.py)")
    p.add_argument("--quick", action="store_true", help="tiny random model, 96 steps, budget 16, interval 8")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--resume", action="store_true",
                   help="keep the configs already in --out (same settings and continuation; a config whose KL has "
                        "NaN is rerun) and run only the missing ones")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.budget, args.interval, args.window = "tiny", 96, 16, 8, 4
    if args.kvpress and args.model == "tiny":
        p.error("--kvpress runs a named model in kvpress's venv: use it with --model default or another named "
                "model (no --quick)")
    if args.prompt_tokens < 0:
        p.error(f"--prompt-tokens must be >= 0, got {args.prompt_tokens}")
    try:  # pipeline files are checked before the model loads
        args.pipelines = common.config_pipelines(args.config)
    except ValueError as err:
        p.error(str(err))
    return args


SUMMARY_REQUEST = "\n\nSummarise the text above in detail, section by section."


def make_prompt(args, tok, model) -> torch.Tensor:
    """The chat prompt's ids ``[1, T]``: the short story request, or ~``--prompt-tokens`` of the Python
    manual followed by a request to summarise it."""
    if tok is None:
        return common.context_ids(None, max(args.prompt_tokens, 24), vocab_size=model.config.vocab_size)
    content = PROMPT
    if args.prompt_tokens:
        text = tok.decode(common.context_ids(tok, args.prompt_tokens)[0])
        content = text + SUMMARY_REQUEST
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
    return tok(rendered, add_special_tokens=False, return_tensors="pt")["input_ids"]


def presses(args):
    from kvpress_ada import Pipeline
    from kvpress_ada.allocators import AdaHead
    from kvpress_ada.scorers import KNorm, SnapKV, StreamingLLM

    common_fields = dict(decode_budget=args.budget, decode_interval=args.interval)
    configs = {
        "snapkv": Pipeline(scorer=SnapKV(window=args.window, kernel=5), **common_fields),
        "ada_snapkv": Pipeline(scorer=SnapKV(window=args.window, kernel=5), allocator=AdaHead(alpha=0.2),
                               **common_fields),
        "streamingllm": Pipeline(scorer=StreamingLLM(sinks=4), **common_fields),
        "knorm": Pipeline(scorer=KNorm(), **common_fields),
    }
    if args.model == "default":  # the shipped surrogate is the default model's; new tokens scored as they arrive
        from kvpress_ada.allocators import AdaLayer
        from kvpress_ada.scorers import KVzap

        kvzap = KVzap(window=args.window)
        configs["kvzap"] = Pipeline(scorer=kvzap, layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0),
                                    **common_fields)
        configs["kvzap_layerwise"] = Pipeline(scorer=kvzap, allocator=AdaHead(alpha=0.0), **common_fields)
    only = [x for x in args.only.split(",") if x]
    unknown = sorted(set(only) - set(configs))
    if unknown:
        raise SystemExit(f"--only: unknown configuration(s) {', '.join(unknown)}; known: {', '.join(configs)}")
    if args.pipelines and not only:  # with --config, a built-in runs only when --only names it
        only = ["-"]
    clash = sorted(set(args.pipelines) & set(configs))
    if clash:
        raise SystemExit(f"--config: label(s) {', '.join(clash)} are built-in configurations; rename the file(s)")
    return {**{k: v for k, v in configs.items() if not only or k in only}, **args.pipelines}


def progress(steps, desc: str):
    """A progress bar on stderr over decode steps (a 4k-prompt run takes minutes per configuration)."""
    from tqdm.auto import tqdm

    return tqdm(steps, desc=desc, unit="tok", file=sys.stderr, mininterval=5)


@torch.inference_mode()
def full_generation(model, prompt: torch.Tensor, steps: int, suppress: list[int]):
    """Greedy full-cache generation: (tokens [steps], log-probs [steps, V] fp32, kv bytes, step seconds)."""
    key = common.cache_kwarg(model)
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{key: None})
    cache = common.output_cache(out)
    tokens, logps, kv, step_s = [], [], [], []
    logits = out.logits[0, -1].float()
    for step in progress(range(steps), "full cache"):
        logits[suppress] = float("-inf")
        logp = torch.log_softmax(logits, -1)
        token = int(logp.argmax())
        tokens.append(token)
        logps.append(logp)
        if step + 1 == steps:
            break
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{key: cache})
        step_s.append(time.perf_counter() - t0)
        cache = common.output_cache(out)
        kv.append(common.cache_nbytes(cache))
        logits = out.logits[0, -1].float()
    return torch.tensor(tokens), torch.stack(logps), kv, step_s


@torch.inference_mode()
def teacher_forced(model, press, prompt: torch.Tensor, tokens: torch.Tensor, full_logp: torch.Tensor) -> dict:
    key = common.cache_kwarg(model)
    kl, top1, kv, step_s = [], [], [], []
    with press(model):
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{key: None})
        cache = common.output_cache(out)
        for i in progress(range(tokens.numel() - 1), "teacher-forcing"):
            t0 = time.perf_counter()
            out = model(input_ids=tokens[i].view(1, 1), use_cache=True, **{key: cache})
            step_s.append(time.perf_counter() - t0)
            cache = common.output_cache(out)
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            ref = full_logp[i + 1]
            p = ref.exp()  # tokens the reference run suppressed (EOS: -inf) have p = 0 and add nothing
            kl.append(float(torch.where(p > 0, p * (ref - logp), torch.zeros_like(p)).sum()))
            top1.append(int(logp.argmax()) == int(tokens[i + 1]))
            kv.append(cache.nbytes())
    return {"kl": kl, "top1": top1, "kv_bytes": kv, "step_s": step_s,
            "compactions": list(cache.state.compactions)}


def summarize(run: dict, warm: int) -> dict:
    steps = run["step_s"][warm:]
    kv = run["kv_bytes"]
    return {"tokens_per_s": len(steps) / sum(steps) if steps else None,
            "mean_kl": sum(run["kl"]) / len(run["kl"]) if run.get("kl") else 0.0,
            "top1": sum(run["top1"]) / len(run["top1"]) if run.get("top1") else 1.0,
            "kv_bytes_max": max(kv), "kv_bytes_final": kv[-1],
            "kv_bytes_max_after_first_compaction": max(kv[len(kv) // 8:]) if kv else None}


KVPRESS_METHODS = ("snapkv", "streamingllm", "knorm")


def run_kvpress(args, prompt, tokens, full_logp, method: str) -> dict:
    """kvpress's ``DecodingPress(<method>)`` teacher-forced in its own venv: ``{"versions", "runs": {method}}``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kvpress_compare import DEFAULT_VENV, ensure_kvpress_venv

    from kvpress_ada.harness.default_model import ensure_model

    python = ensure_kvpress_venv(args.venv or DEFAULT_VENV)
    with tempfile.TemporaryDirectory() as tmp:
        inputs, out = Path(tmp) / "inputs.pt", Path(tmp) / "out.json"
        torch.save({"prompt": prompt, "tokens": tokens, "logp": full_logp}, inputs)
        cmd = [str(python), str(Path(__file__).resolve().parent / "decode_compression_worker.py"),
               "--model", str(ensure_model(args.model)), "--inputs", str(inputs), "--out", str(out),
               "--methods", method, "--budget", str(args.budget), "--interval", str(args.interval),
               "--window", str(args.window), "--threads", str(args.threads)]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": ""})
        import json

        return json.loads(out.read_text())


def previous_series(out: Path, args, prompt: torch.Tensor, tokens: torch.Tensor,
                    current: dict | None = None) -> tuple[dict, dict | None]:
    """The series of an earlier run in ``out`` that can be kept (same settings and prompt, the same
    full-cache continuation, checked when the file records it, a KL without NaN, and for a config of ours
    in ``current`` ({label: pipeline dump}) the same pipeline), and the kvpress versions that run recorded."""
    import json
    import math

    if not out.exists():
        return {}, None
    old = json.loads(out.read_text())
    settings = old.get("settings", {})
    same = (old.get("model") == args.model and settings.get("steps") == args.steps
            and settings.get("prompt_request_tokens", 0) == args.prompt_tokens
            and settings.get("budget") == args.budget and settings.get("interval") == args.interval
            and settings.get("window") == args.window and settings.get("prompt_tokens") == int(prompt.shape[1]))
    if not same:
        print(f"[resume] {out} has other settings; running every config", file=sys.stderr)
        return {}, None
    if "tokens" in old and old["tokens"] != tokens.tolist():
        print(f"[resume] {out} was teacher-forced on another continuation; running every config", file=sys.stderr)
        return {}, None
    if "tokens" not in old:
        print(f"[resume] {out} does not record its continuation (older file); keeping its configs on the "
              "settings match (greedy decoding of the same model and prompt)", file=sys.stderr)
    old_presses = old.get("presses")
    now = json.loads(json.dumps(current or {}))

    def same_press(label: str) -> bool:
        return old_presses is None or label not in now or old_presses.get(label) == now[label]

    kept = {label: run for label, run in old.get("series", {}).items()
            if label != "full" and run.get("kl") and not any(math.isnan(x) for x in run["kl"]) and same_press(label)}
    return kept, old.get("kvpress")


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, run in payload["series"].items():
        ax.plot(range(1, len(run["kv_bytes"]) + 1), [b / 2**20 for b in run["kv_bytes"]], label=label,
                linestyle="--" if label.startswith("kvpress") else "-")
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV cache (MiB)")
    s = payload["settings"]
    ax.set_title(f"decode compression: budget {s['budget']}/kv head, every {s['interval']} tokens "
                 f"({payload['model']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    from kvpress_ada.harness.eval.report import save_figure

    save_figure(fig, path, dpi=120)


def readme_rows(payload: dict) -> str:
    """The benchmarks/README.md rows: KV held after the last token, mean KL and top-1 agreement, tok/s."""
    lines = ["| config | KV held after the last token | mean KL(full \\|\\| press) | top-1 = full | tok/s (its run) |",
             "|---|--:|--:|--:|--:|"]
    for label, s in payload["summary"].items():
        name = f"kvpress `DecodingPress({label.removeprefix('kvpress_')})`" if label.startswith("kvpress") \
            else ("full cache" if label == "full" else f"`{label}` (ours)")
        lines.append(f"| {name} | {s['kv_bytes_final'] / 2**20:.2f} MiB | {s['mean_kl']:.3f} | {s['top1']:.3f} | "
                     f"{s['tokens_per_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    common.set_threads(args.threads)
    model, tok = common.load_model(args.model)
    prompt = make_prompt(args, tok, model)
    if tok is not None:
        eos = model.generation_config.eos_token_id
        suppress = sorted({i for i in [tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])] if i is not None})
    else:
        suppress = []
    geom = common.kv_geometry(model)
    out = args.out or (common.QUICK_DIR if args.quick else common.RESULTS) / "decode_compression.json"
    print(f"prompt: {prompt.shape[1]} tokens; generating {args.steps} with the full cache ...", file=sys.stderr)
    t0 = time.perf_counter()
    tokens, full_logp, full_kv, full_s = full_generation(model, prompt, args.steps, suppress)
    full_seconds = time.perf_counter() - t0
    warm = min(8, len(full_s) // 4)
    ours = presses(args)
    dumps = {k: v.model_dump(mode="json") for k, v in ours.items()}
    kept, kept_versions = previous_series(out, args, prompt, tokens, dumps) if args.resume else ({}, None)
    series = {"full": {"kv_bytes": full_kv, "step_s": full_s, "kl": [], "top1": []}}
    series.update(kept)
    todo = [label for label in ours if label not in series]
    if args.kvpress:
        todo += [f"kvpress_{m}" for m in KVPRESS_METHODS if f"kvpress_{m}" not in series]
    # a config costs about one full-cache generation (prefill + as many single-token forwards)
    print(f"full-cache generation took {full_seconds:.0f} s; {len(todo)} configs to run ({', '.join(todo) or '-'}): "
          f"about {len(todo) * full_seconds / 60:.0f} min more (decode-compressed caches decode faster)",
          file=sys.stderr)
    from kvpress_ada.kernels.ragged.reference import CHUNK

    # each row's room (kept + K) is rounded up to whole chunks: at most CHUNK - 1 more slots per row
    bound = common.full_kv_bytes(geom, 1, args.budget + args.interval + CHUNK - 1)
    kvpress_versions = kept_versions if any(k.startswith("kvpress") for k in kept) else None

    def write(complete: bool) -> dict:
        payload = {
            "benchmark": "decode_compression", "date": common.now_iso(), "model": args.model, "complete": complete,
            "machine": common.machine_info(), "threads": args.threads, "kvpress": kvpress_versions,
            "settings": {"steps": args.steps, "budget": args.budget, "interval": args.interval, "window": args.window,
                         "prompt_tokens": int(prompt.shape[1]), "prompt_request_tokens": args.prompt_tokens,
                         "eos_suppressed": suppress},
            "bound_bytes": bound, "geometry": geom, "full_generation_s": full_seconds,
            "presses": dumps,
            "summary": {label: summarize(run, warm) for label, run in series.items()},
            "tokens": tokens.tolist(),
            "series": series,
        }
        common.write_json(out, payload)
        return payload

    write(complete=False)
    for label, press in ours.items():
        if label in kept:
            print(f"{label}: kept from {out}", file=sys.stderr)
            continue
        print(f"teacher-forcing {label} ...", file=sys.stderr)
        series[label] = teacher_forced(model, press, prompt, tokens, full_logp)
        print(f"  {summarize(series[label], warm)}", file=sys.stderr)
        write(complete=False)
    if args.kvpress:
        for method in KVPRESS_METHODS:
            label = f"kvpress_{method}"
            if label in kept:
                print(f"{label}: kept from {out}", file=sys.stderr)
                continue
            print(f"kvpress DecodingPress({method}) (its own venv) ...", file=sys.stderr)
            result = run_kvpress(args, prompt, tokens, full_logp, method)
            kvpress_versions = result["versions"]
            series[label] = result["runs"][method]
            write(complete=False)
    payload = write(complete=True)
    plot(payload, out.with_suffix(".png"))
    rows = [[label, f"{s['tokens_per_s']:.1f}", f"{s['kv_bytes_final'] / 2**20:.2f}",
             f"{s['kv_bytes_max'] / 2**20:.2f}", f"{s['mean_kl']:.3f}", f"{s['top1']:.3f}"]
            for label, s in payload["summary"].items()]
    print(common.fmt_table(["config", "tok/s", "KV final MiB", "KV max MiB", "mean KL", "top-1"], rows))
    print(f"bound (n_layers * H_kv * (B + K + 31) slots): {bound / 2**20:.2f} MiB; wrote {out}")
    print("\nREADME rows:\n")
    print(readme_rows(payload))


if __name__ == "__main__":
    main()
