"""Does a custom KVCacheSpec + SingleTypeKVCacheManager registered through vLLM's registry get used?

The probe plugin registers ``HeadPagedSpec -> PagedManager`` (kvpress_vllm_probe/spec.py) in every process;
``worker_cls=SpecWorker`` reports that spec for every layer. Checks: the engine core's KV cache manager calls
``PagedManager`` (log lines with its pid), block accounting per request (blocks = cdiv(tokens, block_size)),
``free`` on finish, and greedy tokens equal transformers'.

Run (in the vLLM venv, after make_tiny_model.py and ``pip install --no-deps -e benchmarks/vllm_probe/probe_plugin``):
    python benchmarks/vllm_probe/spec_probe.py /tmp/tiny-llama /tmp/spec
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
    log = out / "manager.jsonl"
    log.unlink(missing_ok=True)
    os.environ["KVPRESS_PROBE_MANAGER_LOG"] = str(log)
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=512, seed=0, block_size=32,
              enable_prefix_caching=False, worker_cls="kvpress_vllm_probe.spec.SpecWorker")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    records = [json.loads(line) for line in log.read_text().splitlines()]
    print("RESULT manager calls:", Counter((r["manager"], r["call"], r["pid"]) for r in records))
    for r in records:
        if r["call"] != "get_num_blocks_to_allocate" or r["blocks"]:
            print("RESULT", json.dumps(r))
    sys.path.insert(0, str(Path(__file__).parent))
    import generate  # same directory

    generate.PROMPTS, generate.MAX_TOKENS = PROMPTS, MAX_TOKENS
    ref = generate.hf_tokens(model)
    print("RESULT tokens", tokens, "EQUAL" if tokens == ref else f"DIFFERENT from {ref}")


if __name__ == "__main__":
    args = sys.argv[1:] + ["/tmp/tiny-llama", "/tmp/spec"][len(sys.argv) - 1:]
    main(args[0], Path(args[1]))
