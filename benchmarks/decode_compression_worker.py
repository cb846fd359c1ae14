"""The NVIDIA-kvpress half of ``benchmarks/decode_compression.py``; runs inside the kvpress virtualenv.

Never import ``kvpress_ada`` here (kvpress 0.5.5 pins transformers < 5.3). One shot: read the
prompt ids, the full-cache continuation and its log-probs (``torch.save`` file written by the
driver), teacher-force the continuation under ``DecodingPress(base)`` one token per forward with
true RoPE positions (as kvpress's pipeline does), and write per-step KV bytes, KL(full || press),
top-1 agreement and forward times as JSON.

    <kvpress-venv>/bin/python benchmarks/decode_compression_worker.py --model DIR --inputs FILE --out FILE
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
import warnings

import torch
import transformers
from kvpress import DecodingPress, KnormPress, SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM, DynamicCache

warnings.filterwarnings("ignore")
transformers.utils.logging.set_verbosity_error()


def base_press(method: str, window: int):
    if method == "snapkv":
        return SnapKVPress(window_size=window, kernel_size=5)
    if method == "streamingllm":
        return StreamingLLMPress(n_sink=4)
    if method == "knorm":
        return KnormPress()
    raise ValueError(method)


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


@torch.inference_mode()
def run(model, method: str, inputs: dict, budget: int, interval: int, window: int) -> dict:
    prompt, tokens, full_logp = inputs["prompt"], inputs["tokens"], inputs["logp"]
    press = DecodingPress(base_press=base_press(method, window), compression_interval=interval, target_size=budget,
                          hidden_states_buffer_size=max(2 * window, interval))
    n_prompt = prompt.shape[1]
    kl, top1, kv, step_s = [], [], [], []
    with press(model):
        cache = DynamicCache()
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for i in range(tokens.numel() - 1):
            t0 = time.perf_counter()
            out = model(input_ids=tokens[i].view(1, 1), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[n_prompt + i]]))
            step_s.append(time.perf_counter() - t0)
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            ref = full_logp[i + 1].float()
            p = ref.exp()  # tokens the full cache gives probability 0 add nothing (not 0 * (-inf - -inf) = NaN)
            kl.append(float(torch.where(p > 0, p * (ref - logp), torch.zeros_like(p)).sum()))
            top1.append(int(logp.argmax()) == int(tokens[i + 1]))
            kv.append(cache_bytes(cache))
    return {"kl": kl, "top1": top1, "kv_bytes": kv, "step_s": step_s}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--methods", default="snapkv,streamingllm,knorm")
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--interval", type=int, required=True)
    p.add_argument("--window", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    inputs = torch.load(args.inputs)
    results = {"versions": {"kvpress": importlib.metadata.version("kvpress"), "transformers": transformers.__version__,
                            "torch": torch.__version__}, "runs": {}}
    for method in args.methods.split(","):
        results["runs"][method] = run(model, method, inputs, args.budget, args.interval, args.window)
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
