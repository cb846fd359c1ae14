"""Greedy decode throughput: full cache vs SnapKV vs Ada-SnapKV (ragged cache) vs a dense shrink.

One prefill per context length (``capture_prefill``); every config's cache is derived from it
(keep masks computed once per press, a fresh cache compacted for every timed repeat), so the
expensive prefill runs once. Configs:

* ``full``: the plain model (stock ``sdpa`` attention) with a dense ``DynamicCache`` of the context;
* ``snapkv`` / ``ada_snapkv`` at each ratio: ``with press(model)`` decoding from the press's
  ``RaggedCache`` (ragged attention kernels; the torch reference path on CPU);
* ``dense_snapkv`` at each ratio (reference row): SnapKV's kept tokens (uniform per head) gathered
  into a plain dense ``DynamicCache`` and decoded with the stock ``sdpa`` path, RoPE positions
  continuing from the context length. Same tokens as ``snapkv``, stock code: it shows what a dense
  shrink achieves on this machine;
* ``--config FILE`` (repeatable): a pipeline file (YAML or JSON, as ``kvpress-ada eval --config``; e.g. an
  eviction with a ``reader`` that reads selected pages at each step), at the file's own ``compression_ratio``,
  labelled by the file's name.

``--batch B`` decodes B rows at once: the prefill of the one context is repeated B times (its captured keys,
values and queries; the same prompt in every row, so every row keeps and reads what row 0 does), so a batch of
long contexts costs one prefill; tokens/s counts every row's tokens.

Each timed run is ``--steps`` decode forwards (one token each) from the same first token.
Repeats are interleaved (rep -> thread setting -> config, config order rotated every repeat) and
ratios between configs are taken within a repeat, then the median over repeats, so the machine's
noise (other processes) hits every config alike. Targets at r=0.75 and the longest context:
``ada_snapkv >= 1.5x full`` and ``ada_snapkv >= 0.97x snapkv`` tokens/s, eager and compiled.

    python benchmarks/decode.py                # 2k and 4k, r in {0.5, 0.75, 0.9}, threads 1 and 2
    python benchmarks/decode.py --quick        # smoke run on a tiny random model (< 1 min)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TARGET_RATIO = 0.75
TARGET_VS_FULL = 1.5
TARGET_VS_SNAPKV = 0.97
PROFILE_STEPS = 8


@dataclass
class Config:
    name: str  # full | <preset> | dense_snapkv
    ratio: float
    make_cache: Callable
    press: object = None
    position_start: int | None = None
    kv_bytes: int = 0
    setup_s: float = 0.0
    warmup_s: float = 0.0
    tps: dict = field(default_factory=dict)  # threads -> [tokens/s per repeat]
    step_ms: dict = field(default_factory=dict)  # threads -> [median step ms per repeat]
    tokens: list | None = None
    forward: Callable | None = None  # a torch.compile'd model.forward (full cache), or None
    compile: bool = False  # press configs: decode through the library's compiled step (press(model, compile=True))
    row_loop: bool = False  # eager reference attention with one matmul pair per row (for the comparison row)
    # for the comparison rows: "reads", a reader's page selection and summary appends by the torch code; "records",
    # its attention over quantized records by the torch reference (gather and dequantize); "": the fused kernels
    unfused: str = ""

    @property
    def label(self) -> str:
        return self.name if self.name.startswith("full") else f"{self.name}@{self.ratio:g}"


@contextmanager
def forward_of(model, forward):
    """Run ``model`` with ``forward`` (a compiled ``model.forward``) in place of its own, if given."""
    if forward is None:
        yield
        return
    model.forward = forward
    try:
        yield
    finally:
        del model.forward  # back to the class's forward


class _Press:
    """``press`` applied with an explicit ``compile`` choice (what ``common.decode`` calls as ``press(model)``)."""

    def __init__(self, press, compile: bool):
        self.press, self.compile = press, compile

    def __call__(self, model):
        return self.press(model, compile=self.compile)


def press_of(cfg: "Config"):
    return None if cfg.press is None else _Press(cfg.press, cfg.compile)


@contextmanager
def row_loop(enabled: bool):
    """Eager CPU attention with the per-row loop instead of the loop-free pass (for the comparison row)."""
    from kvpress_ada.kernels.ragged import reference

    before = reference.LOOP_FREE
    reference.LOOP_FREE = not enabled
    try:
        yield
    finally:
        reference.LOOP_FREE = before


@contextmanager
def unfused_reads(part: str):
    """``"reads"``: a reader's page selection (bounds by their kernel, then TopPages' torch code: shares, budgets,
    top-k) and the page-summary appends by the torch code instead of the fused CPU kernels; ``"records"``: its
    attention over quantized records by the torch reference (the selected pages gathered and dequantized) instead of
    the fused kernel; ``""``: as they are (for the comparison rows)."""
    from kvpress_ada.kernels.ragged import sparse
    from kvpress_ada.readers import Reader, TopPages

    if part == "records":
        fused = sparse.sparse_quantized_attention_cpu
        sparse.sparse_quantized_attention_cpu = lambda *args: None
        try:
            yield
        finally:
            sparse.sparse_quantized_attention_cpu = fused
        return
    if part != "reads":
        yield
        return
    select, append = TopPages.select_fused, sparse.append_summaries_cpu
    TopPages.select_fused = Reader.select_fused
    sparse.append_summaries_cpu = lambda *args: False
    try:
        yield
    finally:
        TopPages.select_fused, sparse.append_summaries_cpu = select, append


def compiled_variants(model, configs: list[Config]) -> list[Config]:
    """The same configs decoded compiled. Press configs use the library's compiled decode step
    (``with press(model, compile=True)``: one ``torch.compile(model.forward, fullgraph=True)`` shared by all of
    them); the full cache (a ``DynamicCache``, not compileable by the library) uses
    ``torch.compile(model.forward, dynamic=True)``."""
    forward = torch.compile(model.forward, dynamic=True)
    return [Config(f"{c.name}+compile", c.ratio, c.make_cache, c.press, c.position_start, setup_s=c.setup_s,
                   forward=forward if c.press is None else None, compile=c.press is not None)
            for c in configs if not c.row_loop and not c.unfused]


def dense_from_keep(prefill, masks: list[torch.Tensor]):
    """A dense ``DynamicCache`` holding the kept tokens of uniform keep masks (same count in every row)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=prefill.model.config)
    for i, (c, keep) in enumerate(zip(prefill.layers, masks)):
        B, H, L, D = c.keys.shape
        counts = keep.sum(-1)
        if not bool((counts == counts.flatten()[0]).all()):
            raise ValueError("dense_from_keep needs the same kept count in every (batch, kv head) row")
        n = int(counts.flatten()[0])
        cache.update(c.keys[keep].view(B, H, n, D).clone(), c.values[keep].view(B, H, n, D).clone(), i)
    return cache


def repeated_prefill(prefill, batch: int):
    """``prefill`` (batch 1) as ``batch`` identical rows: views of its tensors, no copy (``--batch``)."""
    from dataclasses import replace

    from transformers import DynamicCache

    if batch == 1:
        return prefill
    if prefill.key_mask.shape[0] != 1:
        raise ValueError(f"--batch repeats a batch-1 prefill, got batch {prefill.key_mask.shape[0]}")

    def rows(t):
        return None if t is None else t.expand(batch, *t.shape[1:])

    layers = [replace(c, keys=rows(c.keys), values=rows(c.values), queries=rows(c.queries), hidden=rows(c.hidden))
              for c in prefill.layers]
    full = DynamicCache(config=prefill.model.config)
    for i, c in enumerate(layers):
        full.update(c.keys, c.values, i)
    return replace(prefill, layers=layers, key_mask=rows(prefill.key_mask), full_cache=full,
                   logits=rows(prefill.logits), input_ids=rows(prefill.input_ids), pass_cache={}, entry_cache={})


def build_configs(prefill, methods, ratios, dense: bool, row_loop_rows: bool = False,
                  files: dict | None = None, unfused_rows: bool = False,
                  unfused_records: bool = False) -> list[Config]:
    from kvpress_ada import preset

    configs = [Config("full", 0.0, lambda: prefill.compressed_cache(None))]
    for label, press in (files or {}).items():  # pipeline files, at their own ratio
        t0 = time.perf_counter()
        masks = prefill.keep_masks(press)
        configs.append(Config(label, float(press.compression_ratio or 0.0),
                              (lambda p=press, m=masks: prefill.compressed_cache(p, m)), press,
                              setup_s=time.perf_counter() - t0))
        if unfused_rows and press.reader is not None:
            configs.append(Config(f"{label}+unfused", float(press.compression_ratio or 0.0),
                                  (lambda p=press, m=masks: prefill.compressed_cache(p, m)), press,
                                  setup_s=configs[-1].setup_s, unfused="reads"))
        if unfused_records and press.reader is not None and press.storage.quantized:
            configs.append(Config(f"{label}+torch_records", float(press.compression_ratio or 0.0),
                                  (lambda p=press, m=masks: prefill.compressed_cache(p, m)), press,
                                  setup_s=configs[-1].setup_s, unfused="records"))
    for method in methods:
        name, _, storage = method.partition(":")  # "ada_snapkv:int4": the preset storing int4 records
        for r in ratios:
            press = preset(name, compression_ratio=r, **({"storage": storage} if storage else {}))
            t0 = time.perf_counter()
            masks = prefill.keep_masks(press)
            setup = time.perf_counter() - t0
            configs.append(Config(method, r, (lambda p=press, m=masks: prefill.compressed_cache(p, m)), press,
                                  setup_s=setup))
            if row_loop_rows and method.startswith("ada"):
                configs.append(Config(f"{method}+rowloop", r, (lambda p=press, m=masks: prefill.compressed_cache(p, m)),
                                      press, setup_s=setup, row_loop=True))
            if dense and method == "snapkv":
                configs.append(Config("dense_snapkv", r, (lambda m=masks: dense_from_keep(prefill, m)), None,
                                      position_start=prefill.seq_len, setup_s=setup))
    return configs


def time_config(model, cfg: Config, first_id, steps: int) -> tuple[float, float, list[int]]:
    cache = cfg.make_cache()
    cfg.kv_bytes = common.cache_nbytes(cache)
    times: list[float] = []
    with forward_of(model, cfg.forward), row_loop(cfg.row_loop), unfused_reads(cfg.unfused):
        tokens = common.decode(model, cache, first_id, steps, press_of(cfg), cfg.position_start, times)
    return first_id.shape[0] * steps / sum(times), 1000 * statistics.median(times), tokens


def profile_config(model, cfg: Config, first_id, steps: int, top: int) -> list[dict]:
    """Top ops by self CPU time over ``steps`` decode steps (after 2 warm-up steps)."""
    from torch.profiler import ProfilerActivity, profile

    cache = cfg.make_cache()
    common.decode(model, cache, first_id, 2, cfg.press, cfg.position_start)
    start = None if cfg.position_start is None else cfg.position_start + 2
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        common.decode(model, cache, first_id, steps, cfg.press, start)
        wall = time.perf_counter() - t0
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1.0
    out = [{"op": "<wall per step under profiler, ms>", "self_ms_per_step": 1000 * wall / steps}]
    for e in rows[:top]:
        out.append({"op": e.key, "calls_per_step": e.count / steps,
                    "self_ms_per_step": e.self_cpu_time_total / 1000 / steps,
                    "self_pct": 100 * e.self_cpu_time_total / total,
                    "total_ms_per_step": e.cpu_time_total / 1000 / steps})
    return out


def ratio_stats(num: list[float], den: list[float]) -> dict:
    per_rep = [a / b for a, b in zip(num, den)]
    return {"median_of_per_repeat": statistics.median(per_rep), "ratio_of_medians":
            statistics.median(num) / statistics.median(den), "per_repeat": per_rep}


def verdicts(ctx_results: dict, threads_list: list[int]) -> list[dict]:
    out = []
    L = max(ctx_results)
    by = {c["label"]: c for c in ctx_results[L]["configs"]}
    for mode in ("", "+compile"):
        ada, full = by.get(f"ada_snapkv{mode}@{TARGET_RATIO:g}"), by.get(f"full{mode}")
        snap = by.get(f"snapkv{mode}@{TARGET_RATIO:g}")
        for t in threads_list:
            key = str(t)
            if ada and full:
                s = ratio_stats(ada["tokens_per_s"][key], full["tokens_per_s"][key])
                out.append({"target": f"ada_snapkv{mode}@{TARGET_RATIO} >= {TARGET_VS_FULL}x full{mode}",
                            "context": L, "threads": t, "ratio": s["median_of_per_repeat"],
                            "threshold": TARGET_VS_FULL, "pass": s["median_of_per_repeat"] >= TARGET_VS_FULL, **s})
            if ada and snap:
                s = ratio_stats(ada["tokens_per_s"][key], snap["tokens_per_s"][key])
                out.append({"target": f"ada_snapkv{mode}@{TARGET_RATIO} >= {TARGET_VS_SNAPKV}x snapkv{mode}",
                            "context": L, "threads": t, "ratio": s["median_of_per_repeat"],
                            "threshold": TARGET_VS_SNAPKV, "pass": s["median_of_per_repeat"] >= TARGET_VS_SNAPKV,
                            **s})
    return out


def plot(ctx_results: dict, threads_list: list[int], path: Path, model_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted(ctx_results)
    fig, axes = plt.subplots(len(threads_list), len(contexts), figsize=(5.2 * len(contexts), 3.8 * len(threads_list)),
                             squeeze=False)
    styles = {"snapkv": ("tab:blue", "o"), "ada_snapkv": ("tab:red", "s"), "dense_snapkv": ("tab:green", "^"),
              "snapkv+compile": ("tab:cyan", "o"), "ada_snapkv+compile": ("tab:orange", "s"),
              "dense_snapkv+compile": ("tab:olive", "^")}
    for i, t in enumerate(threads_list):
        for j, L in enumerate(contexts):
            ax = axes[i][j]
            groups: dict[str, list] = {}
            for c in ctx_results[L]["configs"]:
                med = statistics.median(c["tokens_per_s"][str(t)])
                if c["name"].startswith("full"):
                    ax.axhline(med, color="black", ls=":" if c["compiled"] else "--", label=f"{c['name']} ({med:.1f})")
                else:
                    groups.setdefault(c["name"], []).append((c["ratio"], med))
            for name, pts in groups.items():
                pts.sort()
                color, marker = styles.get(name, (None, "x"))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=name)
            ax.set_title(f"context {L}, {t} thread{'s' if t > 1 else ''}")
            ax.set_xlabel("compression ratio r")
            ax.set_ylabel("decode tokens/s (median)")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"Greedy decode throughput, {model_name} model (CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    from kvpress_ada.harness.eval.report import save_figure

    save_figure(fig, path, dpi=110)
    plt.close(fig)


def _ratio(config: dict, full: dict, threads: int) -> float:
    """Median over repeats of the within-repeat tokens/s ratio of ``config`` to ``full``."""
    key = str(threads)
    return ratio_stats(config["tokens_per_s"][key], full["tokens_per_s"][key])["median_of_per_repeat"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__ + "\nSee benchmarks/README.md for the results "
                                     "and their analysis.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=common.MODEL_CHOICES, default=None,
                        help="'default' = embedded SmolLM2-135M-Instruct (fp32), 'tiny' = small random Llama "
                             "(default: 'default', or 'tiny' with --quick)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="context lengths in tokens (default: 2048 4096; 512 with --quick)")
    parser.add_argument("--methods", nargs="+", default=["snapkv", "ada_snapkv"],
                        help="presets to compare, each optionally with a storage: PRESET[:int8|:int4] "
                        "(default: snapkv ada_snapkv)")
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="a pipeline file (YAML or JSON, as `kvpress-ada eval --config`) timed at its own "
                             "compression_ratio, labelled by its file name; repeatable")
    parser.add_argument("--batch", type=int, default=1,
                        help="rows decoded at once: the one context's prefill repeated (default: 1)")
    parser.add_argument("--ratios", type=float, nargs="+", default=None,
                        help="compression ratios (default: 0.5 0.75 0.9; 0.75 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per timed run (default: 32; 4 with "
                        "--quick)")
    parser.add_argument("--reps", type=int, default=None, help="timed repeats per config (default: 3; 1 with --quick)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch intra-op thread counts to measure (default: 1 2; 1 with --quick)")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense_snapkv reference rows")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the torch.profiler breakdown (full, snapkv, ada_snapkv, dense_snapkv at r=0.75, "
                             "longest context, first thread setting)")
    parser.add_argument("--compile", action="store_true",
                        help="also time every config through torch.compile(model.forward, dynamic=True)")
    parser.add_argument("--row-loop", action="store_true",
                        help="also time eager ada_* with the per-row attention loop (the path before the loop-free "
                        "one)")
    parser.add_argument("--unfused-reads", action="store_true",
                        help="also time each --config with a reader with its page selection and summary appends by "
                             "the torch code (the path before their fused CPU kernels), in the same run")
    parser.add_argument("--unfused-records", action="store_true",
                        help="also time each --config with a reader over quantized records with its attention by the "
                             "torch reference (the selected pages gathered and dequantized: the path before the fused "
                             "CPU kernel), in the same run")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (< 1 min)")
    parser.add_argument("--out", default=None, help="JSON output path (default: benchmarks/results/decode.json, "
                        "PNG next to it; with --quick a temporary folder)")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    from kvpress_ada.harness.cli import UsageError, _config_label, _load_config

    try:  # pipeline files are checked before the model loads
        files = {_config_label(path, args.methods): _load_config(path) for path in args.config}
    except UsageError as err:
        parser.error(str(err))

    q = args.quick
    args.model = args.model or ("tiny" if q else "default")
    args.contexts = args.contexts or ([512] if q else [2048, 4096])
    args.ratios = args.ratios or ([0.75] if q else [0.5, 0.75, 0.9])
    args.steps = args.steps or (4 if q else 32)
    args.reps = args.reps or (1 if q else 3)
    args.threads = args.threads or ([1] if q else [1, 2])
    out = Path(args.out) if args.out else (common.QUICK_DIR if q else common.RESULTS) / "decode.json"

    from tqdm import tqdm

    from kvpress_ada import preset
    from kvpress_ada.hosts.transformers.fanout import capture_prefill

    info = common.machine_info()
    started = time.perf_counter()
    model, tok = common.load_model(args.model)
    ctx_results: dict[int, dict] = {}
    profiles: dict[str, list] = {}
    for L in args.contexts:
        ids = common.context_ids(tok, L, model.config.vocab_size)
        common.set_threads(max(args.threads))
        t0 = time.perf_counter()
        needs_hidden = any(p.scorer.reads_hidden_states for p in files.values()) or any(
            preset(m.partition(":")[0], compression_ratio=0.5).scorer.reads_hidden_states for m in args.methods)
        prefill = repeated_prefill(capture_prefill(model, ids, hidden_states=needs_hidden), args.batch)
        prefill_s = time.perf_counter() - t0
        first = prefill.logits.argmax(-1, keepdim=True)
        configs = build_configs(prefill, args.methods, args.ratios, not args.no_dense, args.row_loop, files,
                                args.unfused_reads, args.unfused_records)
        if args.compile:
            configs += compiled_variants(model, configs)
        for cfg in configs:  # warm-up: first-call costs (and compilation) do not land in a timed run
            t0 = time.perf_counter()
            with forward_of(model, cfg.forward), row_loop(cfg.row_loop), unfused_reads(cfg.unfused):
                common.decode(model, cfg.make_cache(), first, 3, press_of(cfg), cfg.position_start)
            cfg.warmup_s = time.perf_counter() - t0
        jobs = [(rep, t) for rep in range(args.reps) for t in args.threads]
        bar = tqdm(total=len(jobs) * len(configs), desc=f"decode ctx={L}", unit="run")
        for k, (rep, t) in enumerate(jobs):
            common.set_threads(t)
            shift = k % len(configs)
            for cfg in configs[shift:] + configs[:shift]:
                tps, step_ms, tokens = time_config(model, cfg, first, args.steps)
                cfg.tps.setdefault(str(t), []).append(tps)
                cfg.step_ms.setdefault(str(t), []).append(step_ms)
                if cfg.tokens is None:
                    cfg.tokens = tokens
                bar.update()
        bar.close()
        if not args.no_profile and L == max(args.contexts):
            common.set_threads(args.threads[0])
            for cfg in configs:
                if cfg.forward is None and not cfg.compile and (cfg.name == "full" or cfg.ratio == TARGET_RATIO):
                    profiles[cfg.label] = profile_config(model, cfg, first, min(PROFILE_STEPS, args.steps), 12)
        full_tokens = configs[0].tokens
        ctx_results[L] = {"prefill_s": prefill_s, "configs": [{
            "name": c.name, "label": c.label, "ratio": c.ratio, "kv_bytes": c.kv_bytes, "warmup_s": c.warmup_s,
            "compiled": c.forward is not None or c.compile, "row_loop": c.row_loop, "unfused": c.unfused,
            "kv_fraction": c.kv_bytes / configs[0].kv_bytes, "select_s": c.setup_s,
            "tokens_per_s": c.tps, "median_step_ms": c.step_ms,
            "tokens": c.tokens, "token_agreement_with_full": sum(a == b for a, b in zip(c.tokens, full_tokens)) / len(
                full_tokens),
        } for c in configs]}
        del prefill, configs

    elapsed = time.perf_counter() - started
    checks = verdicts(ctx_results, args.threads)
    # cross-check: the ragged snapkv path and the dense gather of the same tokens should decode the same tokens
    agreement = {}
    for L, res in ctx_results.items():
        by = {c["label"]: c for c in res["configs"]}
        for r in args.ratios:
            a, b = by.get(f"snapkv@{r:g}"), by.get(f"dense_snapkv@{r:g}")
            if a and b:
                agreement[f"{L}@{r:g}"] = sum(x == y for x, y in zip(a["tokens"], b["tokens"])) / len(a["tokens"])

    print(f"\nDecode tokens/s (all rows), median of {args.reps} ({args.model} model, batch {args.batch}, "
          f"{args.steps} steps, "
          f"{info['cpu_count']} CPUs, torch {info['torch']}, load avg at start {info['loadavg_at_start']})")
    headers = (["ctx", "config", "KV frac"] + [f"tok/s {t}T" for t in args.threads]
               + [f"x full (same mode) {t}T" for t in args.threads])
    rows = []
    for L, res in ctx_results.items():
        fulls = {c["compiled"]: c for c in res["configs"] if c["name"].startswith("full")}
        for c in res["configs"]:
            full = fulls[c["compiled"]]  # ratios within a mode: eager vs eager full, compiled vs compiled full
            rows.append([L, c["label"], f"{c['kv_fraction']:.3f}"]
                        + [f"{statistics.median(c['tokens_per_s'][str(t)]):.2f}" for t in args.threads]
                        + [f"{_ratio(c, full, t):.2f}" for t in args.threads])
    print(common.fmt_table(headers, rows))
    print("\nTargets (ratio = median over repeats of the within-repeat ratio):")
    for v in checks:
        print(f"  {'PASS' if v['pass'] else 'MISS'}  {v['target']}  ctx={v['context']} threads={v['threads']}: "
              f"{v['ratio']:.2f}x (per repeat {', '.join(f'{x:.2f}' for x in v['per_repeat'])})")
    if agreement:
        print(f"snapkv (ragged) vs dense_snapkv token agreement: {agreement}")
    for label, rows_ in profiles.items():
        print(f"\nprofile {label} (threads={args.threads[0]}, "
              f"{rows_[0]['self_ms_per_step']:.1f} ms/step under profiler)")
        print(common.fmt_table(["op", "calls/step", "self ms/step", "self %"],
                               [[r["op"][:50], f"{r['calls_per_step']:.0f}", f"{r['self_ms_per_step']:.2f}",
                                 f"{r['self_pct']:.1f}"] for r in rows_[1:]]))
    print(f"\ntotal {elapsed:.0f} s")

    payload = {
        "benchmark": "decode",
        "created": common.now_iso(),
        "machine": info,
        "settings": vars(args),
        "method": "one capture_prefill per context; per config a fresh cache per timed run; tokens/s = steps / "
                  "sum of step wall times; repeats interleaved, config order rotated",
        "elapsed_s": elapsed,
        "contexts": {str(L): v for L, v in ctx_results.items()},
        "targets": checks,
        "snapkv_vs_dense_token_agreement": agreement,
        "profiles": profiles,
    }
    common.write_json(out, payload)
    png = out.with_suffix(".png")
    plot(ctx_results, args.threads, png, args.model)
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
