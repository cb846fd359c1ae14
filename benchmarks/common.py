"""Shared helpers for the CPU benchmarks: machine info, models, prompts, caches, timing, JSON.

Run the benchmarks from the repository root (``python benchmarks/memory.py``); they import
this module by path, so ``benchmarks/`` needs no ``__init__.py``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from kvpress_ada.harness.model_sources import source_names

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
QUICK_DIR = Path(tempfile.gettempdir()) / "kvpress_ada_bench_quick"

MODEL_CHOICES = (*source_names(), "tiny")  # the named models of kvpress_ada.models, and a tiny random one


# ----------------------------------------------------------------------------- machine


def git_state() -> dict:
    """Commit of the library under test and whether the working tree had local changes."""
    def run(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = run("status", "--porcelain", "--untracked-files=no", "--", "kvpress_ada")
    return {"commit": run("rev-parse", "HEAD"), "library_dirty": bool(dirty)}


def machine_info() -> dict:
    """Everything needed to tell which machine and software produced a result."""
    import transformers

    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads_default": torch.get_num_threads(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "mem_total_gib": _mem_total_gib(),
    }
    info.update(git_state())
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------- models and prompts


def load_model(name: str):
    """``(model, tokenizer)``: a named model of ``kvpress_ada.models`` (``"default"`` is the embedded
    SmolLM2-135M, ``"qwen2.5-coder-0.5b"`` a 32k-position Qwen2.5; fp32); ``"tiny"`` a small random Llama
    with the default model's GQA shape (3 kv heads, 3 query heads per kv head) and no tokenizer."""
    if name in source_names():
        from kvpress_ada.models import load

        return load(name)
    if name == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=144, intermediate_size=288, num_hidden_layers=4,
                             num_attention_heads=9, num_key_value_heads=3, head_dim=16,
                             max_position_embeddings=8192, tie_word_embeddings=True)
        model = LlamaForCausalLM(config).eval()
        model.generation_config.pad_token_id = 0
        return model, None
    raise ValueError(f"unknown model {name!r}; expected one of {MODEL_CHOICES}")


def context_ids(tokenizer, n_tokens: int, vocab_size: int | None = None, seed: int = 0) -> torch.Tensor:
    """``[1, n_tokens]`` ids of real English text (the Python reference manual shipped with every Python,
    ``pydoc_data.topics``), or seeded random ids when there is no tokenizer (tiny random model)."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(4, vocab_size, (1, n_tokens), generator=gen)
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    chars = n_tokens * 8  # ~4 chars per token here: tokenize only what is needed
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False, return_tensors="pt")["input_ids"]
        if ids.shape[1] >= n_tokens or chars >= len(text):
            break
        chars *= 2
    if ids.shape[1] < n_tokens:
        raise ValueError(f"the haystack text has only {ids.shape[1]} tokens, fewer than {n_tokens}")
    return ids[:, :n_tokens]


def kv_geometry(model) -> dict:
    """Layers, kv heads, head dim and bytes per element of the model's KV cache."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return {"n_layers": cfg.num_hidden_layers, "n_kv_heads": cfg.num_key_value_heads, "n_q_heads":
            cfg.num_attention_heads, "head_dim": head_dim, "itemsize": itemsize}


def full_kv_bytes(geom: dict, batch: int, length: int) -> int:
    """Bytes of a dense K/V cache of ``length`` tokens."""
    return geom["n_layers"] * batch * geom["n_kv_heads"] * length * geom["head_dim"] * 2 * geom["itemsize"]


def cache_nbytes(cache) -> int:
    """Bytes held for keys and values: ``RaggedCache.nbytes()``, or the dense layers' tensors."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def kept_tokens(cache) -> int:
    """Tokens held over all layers and (batch, kv head) rows."""
    if hasattr(cache, "head_lengths"):
        return int(sum(int(cache.head_lengths(i).sum()) for i in range(len(cache.layers))))
    total = 0
    for layer in cache.layers:
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            B, H, L, _ = layer.keys.shape
            total += B * H * L
    return total


def cache_kwarg(model) -> str:
    """The name under which this transformers version takes the cache (``cache`` or ``past_key_values``)."""
    from kvpress_ada.hosts.transformers.hf import cache_kwarg

    return cache_kwarg(model)


def output_cache(out):
    """The cache a forward returned (``cache`` or ``past_key_values``)."""
    from kvpress_ada.hosts.transformers.hf import output_cache

    return output_cache(out)


def press_context(press, model):
    """``with press(model)`` for a press, a no-op context for the full cache (``press=None``)."""
    return nullcontext() if press is None else press(model)


def prefill(model, ids: torch.Tensor, press=None):
    """Prefill (and compress, under a press) keeping logits for the last position only.
    Returns ``(cache, next token ids [B, 1])``."""
    key = cache_kwarg(model)
    with torch.inference_mode(), press_context(press, model):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: None})
    return output_cache(out), out.logits[:, -1].argmax(-1, keepdim=True)


@torch.inference_mode()
def decode(model, cache, first_id: torch.Tensor, steps: int, press=None, position_start: int | None = None,
           step_times: list | None = None) -> list[int]:
    """Greedy decode ``steps`` forward passes from ``cache`` starting with token ``first_id [B, 1]``.

    Each step appends one token to the cache. ``position_start``: explicit RoPE position of the first
    step (for a dense cache that holds fewer tokens than the context it came from). Returns the tokens
    produced (batch row 0) and, if ``step_times`` is given, appends each step's wall time to it."""
    key = cache_kwarg(model)
    nxt = first_id
    tokens = []
    with press_context(press, model):
        for step in range(steps):
            kwargs = {key: cache}
            if position_start is not None:
                kwargs["position_ids"] = torch.full((first_id.shape[0], 1), position_start + step, dtype=torch.long,
                                                    device=first_id.device)
            t0 = time.perf_counter()
            out = model(input_ids=nxt, use_cache=True, **kwargs)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            if step_times is not None:
                step_times.append(time.perf_counter() - t0)
            cache = output_cache(out)
            tokens.append(int(nxt[0, 0]))
    return tokens


# ----------------------------------------------------------------------------- stats and output


def config_pipelines(specs: list[str]) -> dict:
    """``{label: Pipeline}`` of ``--config FILE[@R]`` (label: the file name, with ``@R`` when a ratio is given);
    ValueError naming the bad spec otherwise."""
    from kvpress_ada.harness.cli import UsageError, _config_spec, _load_config

    out: dict = {}
    for spec in specs:
        try:
            path, ratio = _config_spec(spec)
            pipeline = _load_config(path)
        except UsageError as err:
            raise ValueError(str(err)) from None
        label = Path(path).stem
        if ratio is not None:
            pipeline = pipeline.model_copy(update={"compression_ratio": ratio})
            label = f"{label}@{spec.rpartition('@')[2]}"
        if label in out or label == "full":
            raise ValueError(f"--config {spec}: its label {label!r} is taken; every config needs its own label")
        out[label] = pipeline
    return out


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "best": max(values), "worst": min(values), "n": len(values),
            "all": values}


def dumps_json(payload: object, indent: int = 1, _level: int = 0) -> str:
    """JSON text with one item per line, except that a list of scalars stays on one line (results in git stay
    readable in diffs at about 70% of ``indent=2``'s bytes). ``json.loads`` of it equals ``payload``."""
    pad, end = " " * (indent * (_level + 1)), " " * (indent * _level)
    if isinstance(payload, dict) and payload:
        items = [f"{pad}{json.dumps(str(k))}: {dumps_json(v, indent, _level + 1)}" for k, v in payload.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(payload, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) and v for v in payload):
        return "[\n" + ",\n".join(pad + dumps_json(v, indent, _level + 1) for v in payload) + "\n" + end + "]"
    return json.dumps(payload)


def rounded(payload: object, digits: int = 5) -> object:
    """``payload`` with every float rounded to ``digits`` significant digits (summaries in git: per-layer and
    per-task means need no more)."""
    if isinstance(payload, float):
        return float(f"{payload:.{digits}g}")
    if isinstance(payload, dict):
        return {k: rounded(v, digits) for k, v in payload.items()}
    if isinstance(payload, (list, tuple)):
        return [rounded(v, digits) for v in payload]
    return payload


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_json(payload) + "\n")
    return path


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def fmt_table(headers: list[str], rows: list[list]) -> str:
    """A plain-text (and Markdown-compatible) table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def set_threads(n: int | None) -> int:
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def python() -> str:
    return sys.executable
