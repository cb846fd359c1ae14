"""Start ``vllm.LLM`` (CPU, eager) on a model directory, generate greedily, compare with transformers.

Checks: the engine starts on CPU, the start time, the RSS of this process and its children (the V1 engine core
runs in a child process), and that fp32 greedy tokens equal transformers' ``generate`` on the same prompts.

Run (in the vLLM venv):
    python benchmarks/vllm_probe/make_tiny_model.py /tmp/tiny-llama
    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/vllm_probe/generate.py /tmp/tiny-llama
"""

import sys
import time

PROMPTS = ["Hello world, this is a test of the tiny model.", "abc " * 30, "The quick brown fox jumps"]
MAX_TOKENS = 16


def rss_gib() -> float:
    import psutil

    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / 2**30


def vllm_tokens(path: str, **engine_kwargs) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, enforce_eager=True, dtype="float32", max_model_len=512, seed=0, **engine_kwargs)
    print(f"engine start: {time.perf_counter() - t0:.1f} s, rss (self + children): {rss_gib():.2f} GiB")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, params)
    print(f"generate: {time.perf_counter() - t0:.2f} s, rss: {rss_gib():.2f} GiB")
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_tokens(path: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    result = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
        result.append(out[0, ids.shape[1]:].tolist())
    return result


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"
    got = vllm_tokens(path)
    ref = hf_tokens(path)
    for g, r in zip(got, ref):
        print("vllm", g, "\nhf  ", r)
    print("EQUAL" if got == ref else "DIFFERENT")
