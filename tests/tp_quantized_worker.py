"""Run by ``torchrun`` from tests/test_quantized_storage.py (not a test module itself): int4 storage on a
tensor-parallel tiny Llama against the single-process model. Per preset: the generated tokens and the kept
positions of this rank's kv heads equal the single-process run's, their dequantized keys agree within one
quantization step, and the ranks' bytes add up to the single-process cache's. Writes a JSON report to
``argv[2]`` (rank 0)."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    path, report = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from kvpress_ada import Int4, preset
    from kvpress_ada.hosts.transformers.hf import output_cache
    from kvpress_ada.hosts.transformers.tensor_parallel import head_shard

    tp = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    shard = head_shard(tp)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (2, 120), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    ids[1, :20] = 0
    results = {}
    for name in ("snapkv", "ada_snapkv"):
        press = preset(name, compression_ratio=0.5, storage=Int4(group_size=16))
        outs = []
        for model in (tp, ref):
            with torch.no_grad(), press(model):
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                     return_dict_in_generate=True, pad_token_id=0)
            outs.append((out.sequences, output_cache(out)))
        (tokens, cache), (ref_tokens, ref_cache) = outs
        problems = []
        worst = [0.0]
        if not torch.equal(tokens, ref_tokens):
            problems.append(f"tokens {tokens.tolist()} != {ref_tokens.tolist()}")
        for i in range(len(cache.layers)):
            mine, theirs = cache.layers[i].view(), ref_cache.layers[i].view()
            for b in range(2):
                for h in range(shard.n_local):
                    g = shard.offset + h
                    pos, ref_pos = mine.positions[b, h][mine.valid[b, h]], theirs.positions[b, g][theirs.valid[b, g]]
                    if not torch.equal(pos, ref_pos):
                        problems.append(f"layer {i} row {b} head {g}: kept positions differ")
                        continue
                    # from the second layer on the sharded model's keys differ by float rounding (o_proj summed
                    # across ranks in another order): a record may then round to the neighbouring integer
                    keys, ref_keys = mine.keys[b, h][mine.valid[b, h]], theirs.keys[b, g][theirs.valid[b, g]]
                    step = (ref_keys.amax(-1, keepdim=True) - ref_keys.amin(-1, keepdim=True)) / 15
                    if not ((keys - ref_keys).abs() <= step + 1e-5).all():
                        problems.append(f"layer {i} row {b} head {g}: kept keys differ by more than a step")
                    worst[0] = max(worst[0], float((keys - ref_keys).abs().max()))
        total = torch.tensor([cache.nbytes()])
        dist.all_reduce(total)
        if int(total) != ref_cache.nbytes():
            problems.append(f"ranks hold {int(total)} bytes together, one process {ref_cache.nbytes()}")
        results[name] = {"ok": not problems, "problems": problems[:5], "bytes": cache.nbytes(),
                         "ref_bytes": ref_cache.nbytes(), "max_key_difference": worst[0]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        with open(report, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "ranks": everyone}, f, indent=1)
    ok = all(r["ok"] for ranked in everyone for r in ranked.values())
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
