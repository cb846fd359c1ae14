"""Run by ``torchrun`` from tests/test_tensor_parallel.py (not a test module itself): every preset on a tiny Llama
loaded with ``tp_plan="auto"`` against the same model in one process (the reference, computed on every rank).

For each preset, batch 2 with left padding: the keep mask of every layer on this rank must equal the reference's
rows of this rank's kv heads, the generated tokens must be equal, and the bytes this rank's cache holds must be
exactly its own rows (kept entries + the decode reserve). Rank 0 writes a JSON report to ``argv[2]``.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main() -> int:
    path, report = sys.argv[1], sys.argv[2]
    presets = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else None
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpress_ada import preset, use_tokenizer
    from kvpress_ada.integration.hf import output_cache
    from kvpress_ada.integration.press_cache import PressCache
    from kvpress_ada.integration.tensor_parallel import head_shard
    from kvpress_ada.presets import preset_names

    tp = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    for m in (tp, ref):
        use_tokenizer(m, tok)
    shard = head_shard(tp)
    assert shard is not None and shard.size == dist.get_world_size(), shard
    rank = dist.get_rank()

    gen = torch.Generator().manual_seed(0)
    L = 160
    ids = torch.randint(4, 100, (2, L), generator=gen)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, :24] = 0  # left padding: row 1 has 136 real tokens
    ids[1, :24] = 0

    captured: list = []
    original = PressCache.compress_layer

    def recording(self, layer_idx, keep):
        captured.append((layer_idx, keep.clone()))
        return original(self, layer_idx, keep)

    PressCache.compress_layer = recording  # type: ignore[method-assign]

    def run(model, press):
        captured.clear()
        with torch.no_grad(), press(model):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                 return_dict_in_generate=True, pad_token_id=0)
        keeps = dict(captured)
        return out.sequences[:, L:], [keeps[i] for i in sorted(keeps)], output_cache(out)

    results = {}
    failures = []
    for name in presets or preset_names():
        press = preset(name, compression_ratio=0.5)
        tokens, keeps, cache = run(tp, press)
        ref_tokens, ref_keeps, ref_cache = run(ref, press)
        problems = []
        if not torch.equal(tokens, ref_tokens):
            problems.append(f"tokens {tokens.tolist()} != {ref_tokens.tolist()}")
        for layer, (keep, ref_keep) in enumerate(zip(keeps, ref_keeps)):
            if keep.shape[1] != shard.n_local:
                problems.append(f"layer {layer}: {keep.shape[1]} heads on this rank, expected {shard.n_local}")
            elif not torch.equal(keep, shard.local(ref_keep)):
                problems.append(f"layer {layer}: kept sets differ (lengths {keep.sum(-1).tolist()} vs "
                                f"{shard.local(ref_keep).sum(-1).tolist()})")
        D = tp.config.hidden_size // tp.config.num_attention_heads
        reserve = cache.layers[0].decode_reserve
        own = sum(int(k.sum()) + k.shape[0] * k.shape[1] * reserve for k in keeps) * D * 2 * 4
        if cache.nbytes() != own:
            problems.append(f"this rank holds {cache.nbytes()} bytes, its rows are {own}")
        total = torch.tensor([cache.nbytes()])
        dist.all_reduce(total)
        if int(total) != ref_cache.nbytes():
            problems.append(f"ranks hold {int(total)} bytes together, one process {ref_cache.nbytes()}")
        results[name] = {"ok": not problems, "problems": problems, "tokens": tokens.tolist(),
                         "layer0_lengths": keeps[0].sum(-1).tolist(), "bytes": cache.nbytes()}
        if problems:
            failures.append(name)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(report, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "ranks": everyone}, f, indent=1)
    ok = all(r["ok"] for ranked in everyone for r in ranked.values())
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
