"""Serving inside vLLM with and without a press, under the same KV memory: concurrency, throughput, time to
first token, and accuracy through the engine against the transformers host on the same samples.

Every configuration gets a fresh in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the same number
of KV blocks (``--kv-blocks``, vLLM's ``num_gpu_blocks_override``); all requests (task samples: context, then
the question, in the model's chat template) are submitted at once and the engine is stepped to completion.
Reported per configuration: peak running requests (with vLLM's chunked prefill these include requests part
way through their prompt), peak decoding requests (prompt done: what the KV memory holds at once), preemptions,
output tokens/s over the whole run, median and p90 time to first token, the task's accuracy, and, with
``--reference`` (the transformers host, batch 1, same press, same prompt ids), its accuracy and the fraction of
requests whose tokens equal it. Run in the vLLM venv (the README's rows: pinned to one core,
``VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 python benchmarks/serving.py ...``):

    python benchmarks/serving.py --model default --presets ada_snapkv,snapkv --ratio 0.75 --requests 24 \\
        --context 1000 --new-tokens 32 --kv-blocks 140 --reference --out benchmarks/results/serving_default.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import config_pipelines, machine_info, write_json  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kvpress_ada.harness.eval.scoring import METRICS  # noqa: E402
from kvpress_ada.harness.eval.tasks import make_samples  # noqa: E402
from kvpress_ada.harness.models import SOURCES  # noqa: E402
from kvpress_ada.hosts.transformers.generation import split_prompt  # noqa: E402
from kvpress_ada.hosts.vllm import engine_kwargs, press_from  # noqa: E402


def prompts_for(tokenizer, task: str, n: int, context: int, seed: int):
    samples = make_samples(task, tokenizer, n, context, seed=seed)
    ids = []
    for s in samples:
        head, tail = split_prompt(tokenizer, s.context, s.question)
        ids.append(tokenizer(head + tail, add_special_tokens=False)["input_ids"])
    return samples, ids


def serve(model_dir: str, press, ids: list[list[int]], new_tokens: int, kv_blocks: int, dtype: str,
          chunk: int | None = None) -> dict:
    """One engine, every request at once: per-request tokens and first-token times, peak running, wall time."""
    import gc

    from vllm import LLM, SamplingParams

    engine_args = dict(enforce_eager=True, dtype=dtype, max_model_len=max(len(p) for p in ids) + new_tokens + 8,
                       seed=0, num_gpu_blocks_override=kv_blocks, max_num_seqs=len(ids))
    if chunk is not None:
        engine_args.update(enable_chunked_prefill=True, long_prefill_token_threshold=chunk)
    llm = LLM(**engine_kwargs(press, model_dir, **engine_args)) if press is not None else \
        LLM(model=model_dir, block_size=32, enable_prefix_caching=False, **engine_args)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(ids):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    first: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    peak, peak_decoding, steps = 0, 0, 0
    preempted: dict[str, int] = {}
    with tqdm(total=len(ids), desc="press" if press is not None else "vLLM", unit="req") as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = int(out.request_id)
                if i not in first and out.outputs[0].token_ids:
                    first[i] = time.perf_counter() - start
                if out.finished:
                    tokens[i] = list(out.outputs[0].token_ids)
                    bar.update(1)
            peak = max(peak, len(scheduler.running))
            decoding = [r for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens]
            peak_decoding = max(peak_decoding, len(decoding))
            for r in scheduler.running:
                preempted[r.request_id] = r.num_preemptions
            steps += 1
    wall = time.perf_counter() - start
    del llm, engine, scheduler
    gc.collect()
    ttft = sorted(first.values())
    return {"tokens": [tokens[i] for i in range(len(ids))], "peak_running": peak, "peak_decoding": peak_decoding,
            "preemptions": sum(preempted.values()), "steps": steps, "wall_s": wall,
            "output_tokens_per_s": len(ids) * new_tokens / wall, "ttft_median_s": statistics.median(ttft),
            "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))]}


def transformers_reference(model_dir: str, press, ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt alone through the transformers host with the same press (fp32)."""
    from transformers import AutoModelForCausalLM

    from kvpress_ada.hosts.transformers.caches import ragged_cache
    from kvpress_ada.hosts.transformers.hf import cache_kwarg

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as the engine's ignore_eos
    out = []
    for p in tqdm(ids, desc="transformers host", unit="req"):
        cache = ragged_cache(press.storage, model.config)  # the press's storage (full precision, int8, int4)
        with torch.no_grad(), press(model):
            ids = torch.tensor([p])  # all real: generate would read the chat template's pad-id tokens as padding
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                 **{cache_kwarg(model): cache})
        out.append(gen[0, len(p):].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a named model or a local directory")
    parser.add_argument("--presets", default="ada_snapkv",
                        help="comma-separated presets; PRESET:RATIO for another ratio than --ratio (snapkv:0: a press "
                             "that keeps everything, what the host costs by itself); PRESET@STORAGE (e.g. kvzap@int4, "
                             "kvzap:0.9@int4) stores the kept entries as a registered storage says")
    parser.add_argument("--config", action="append", default=[], metavar="FILE[@R]",
                        help="a pipeline file (YAML or JSON, as `kvpress-ada eval --config`; e.g. an eviction with a "
                             "reader) served after the presets, labelled by its file name; @R sets its ratio; "
                             "repeatable")
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--task", default="passkey")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, required=True, help="KV blocks of 32 tokens for every engine")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="chunked prefill: every engine steps at most this many tokens (max_num_batched_tokens) "
                             "and each press evicts after every chunk (prefill_chunk)")
    parser.add_argument("--decode-budget", type=int, default=None,
                        help="decode compression for every press: each kv head compacted back to this many entries "
                             "every --decode-interval generated tokens (the press's decode_budget)")
    parser.add_argument("--decode-interval", type=int, default=None, help="generated tokens between two compactions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action="store_true", help="also run the transformers host on each sample")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if (args.decode_budget is None) != (args.decode_interval is None):
        parser.error("--decode-budget and --decode-interval go together")
    try:  # pipeline files are checked before any model loads
        files = config_pipelines(args.config)
    except ValueError as err:
        parser.error(str(err))
    presets = [name for name in args.presets.split(",") if name]

    from transformers import AutoTokenizer

    from kvpress_ada.harness.default_model import ensure_model

    model_dir = str(ensure_model(args.model)) if args.model in SOURCES else args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples, ids = prompts_for(tokenizer, args.task, args.requests, args.context, args.seed)
    metric = METRICS[samples[0].metric]

    def accuracy(tokens: list[list[int]]) -> float:
        preds = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        return sum(metric(p, s.answers) for p, s in zip(preds, samples)) / len(samples)

    payload = {"command": " ".join(sys.argv), "machine": machine_info(), "args": vars(args),
               "cpus": sorted(os.sched_getaffinity(0)),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
               "prompt_tokens": [len(p) for p in ids], "runs": {}}
    def with_options(press, storage: str = ""):
        changes = {"storage": storage} if storage else {}
        if args.decode_budget is not None:
            changes.update(decode_budget=args.decode_budget, decode_interval=args.decode_interval)
        return press.replace(**changes) if changes else press

    def press_for(spec: str):
        spec, _, storage = spec.partition("@")
        name, _, ratio = spec.partition(":")
        return with_options(press_from(name, float(ratio) if ratio else args.ratio, args.prefill_chunk), storage)

    configs = [("vLLM (full cache)", None)] + [(name, press_for(name)) for name in presets] + \
        [(label, with_options(press_from(pipeline, None, args.prefill_chunk))) for label, pipeline in files.items()]
    for label, press in configs:
        run = serve(model_dir, press, ids, args.new_tokens, args.kv_blocks, args.dtype, args.prefill_chunk)
        run["accuracy"] = accuracy(run["tokens"])
        if press is not None and args.reference:
            reference = transformers_reference(model_dir, press, ids, args.new_tokens)
            run["transformers_accuracy"] = accuracy(reference)
            run["equal_to_transformers"] = sum(a == b for a, b in zip(run["tokens"], reference)) / len(ids)
        run.pop("tokens")
        payload["runs"][label] = run
        print(label, {k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()}, flush=True)
        write_json(args.out, payload)  # after every configuration: a cut run keeps what it measured


if __name__ == "__main__":
    main()
