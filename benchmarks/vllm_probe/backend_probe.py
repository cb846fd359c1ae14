"""Run vLLM (CPU, eager) with the probe plugin: a logging subclass of CPU_ATTN and a logging worker.

Checks (results are printed and summarised in docs/vllm_host.md):
- the ``vllm.general_plugins`` entry point of an editable install runs in the main, engine-core and worker
  processes (one ``register pid=...`` line per process in $KVPRESS_PROBE_PLUGIN_LOG);
- ``register_backend(AttentionBackendEnum.CPU_ATTN, ...)`` replaces the CPU backend; the override stays inert
  unless ``additional_config={"kvpress_probe": {"log": PATH}}`` is given (switched on by configuration);
- what ``forward`` receives per layer and step (q/k/v/kv_cache shapes, seq_lens, query_start_loc, block_table,
  slot_mapping), chunked prefill (``max_num_batched_tokens`` below the prompt length), what the worker learns
  from ``SchedulerOutput`` (new/cached requests, num_computed_tokens, block ids, finished_req_ids);
- greedy tokens equal transformers' (the override only delegates).

Run (in the vLLM venv, after make_tiny_model.py):
    pip install --no-deps -e benchmarks/vllm_probe/probe_plugin
    python benchmarks/vllm_probe/backend_probe.py /tmp/tiny-llama /tmp/probe
"""

import json
import os
import sys
from collections import Counter
from pathlib import Path

PROMPTS = ["Hello world, this is a test of the tiny model.", "abc " * 30]
MAX_TOKENS = 6


def main(model: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "probe.jsonl"
    plugin_log = out / "plugin.log"
    for p in (log, plugin_log):
        p.unlink(missing_ok=True)
    os.environ["KVPRESS_PROBE_PLUGIN_LOG"] = str(plugin_log)  # inherited by the engine-core and worker processes
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=512, seed=0, block_size=32,
              max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=False,
              worker_cls="kvpress_vllm_probe.worker.LoggingCPUWorker",
              additional_config={"kvpress_probe": {"log": str(log)}})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm

    import generate  # same directory

    generate.PROMPTS, generate.MAX_TOKENS = PROMPTS, MAX_TOKENS
    ref = generate.hf_tokens(model)
    print("plugin registered in:", plugin_log.read_text().split())
    records = [json.loads(line) for line in log.read_text().splitlines()]
    print("events:", Counter(r["event"] for r in records))
    for r in records:
        if r["event"] == "step":
            print("STEP", json.dumps({k: v for k, v in r.items() if k != "event"}))
        elif r["event"] == "forward" and r["layer"].endswith("layers.0.self_attn.attn"):
            keep = ("pid", "call", "query", "key", "kv_cache", "kv_stride", "num_actual_tokens", "query_start_loc",
                    "seq_lens", "block_table", "slot_mapping")
            print("FWD L0", json.dumps({k: r[k] for k in keep}))
    fwd = [r for r in records if r["event"] == "forward" and r["call"] == 0]
    print("layer kv tensors (call 0):", [(r["layer"], r["kv_data_ptr"] - fwd[0]["kv_data_ptr"], r["kv_storage_ptr"],
                                           r["kv_storage_bytes"]) for r in fwd])
    print("fp32 page layout (K transposed [D, bs], then V [bs, D]) holds for every written token:",
          all(r["layout_ok"] for r in records if r["event"] == "forward"))
    print("vllm", tokens, "\nhf  ", ref, "\n", "EQUAL" if tokens == ref else "DIFFERENT")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    args = sys.argv[1:] + ["/tmp/tiny-llama", "/tmp/probe"][len(sys.argv) - 1:]
    main(args[0], Path(args[1]))
