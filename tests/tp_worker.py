"""Run by ``torchrun`` from tests/test_tensor_parallel.py (not a test module itself): every preset on a tiny Llama
loaded with ``tp_plan="auto"`` against the same model in one process (the reference, computed on every rank).

For each preset, batch 2 with left padding: the keep mask of every layer on this rank must equal the reference's
rows of this rank's kv heads, the generated tokens must be equal, and the bytes this rank's cache holds must be
exactly its own rows (kept entries + the decode reserve, in whole 32-slot chunks). Rank 0 writes a JSON
report to ``argv[2]``.

"Equal" for kept sets allows one thing: two entries of a head whose scores tie within float rounding (relative
1e-5) may swap. The tensor-parallel model sums ``o_proj``/``down_proj`` partial products across ranks (an
all-reduce) in another order than one matmul does, so from the second layer on its hidden states, and thus scores,
differ from the single-process run in the last bits; the allocation itself is exact (same counts per head, from
the same global decision). Swaps are counted in the report.
"""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def near_tie_swaps(keep, ref_keep, ref_scores, rtol=1e-5):
    """Entries swapped between ``keep`` and ``ref_keep`` ([B, H, L]) whose reference scores tie within ``rtol``;
    (n, "") when every difference is such a swap, (0, reason) otherwise."""
    if not torch.equal(keep.sum(-1), ref_keep.sum(-1)):
        return 0, f"counts differ: {keep.sum(-1).tolist()} vs {ref_keep.sum(-1).tolist()}"
    n = 0
    for b, h in (keep != ref_keep).any(-1).nonzero().tolist():
        mine, theirs = keep[b, h] & ~ref_keep[b, h], ref_keep[b, h] & ~keep[b, h]
        s_mine, s_theirs = ref_scores[b, h][mine], ref_scores[b, h][theirs]
        gap = float(s_theirs.max() - s_mine.min())
        scale = float(torch.cat([s_mine, s_theirs]).abs().max())
        if not gap <= rtol * max(scale, 1e-30):
            return 0, f"kept sets differ in row ({b}, {h}) by more than a near tie (score gap {gap:.3g})"
        n += int(mine.sum())
    return n, ""


def _served(press) -> bool:
    """Whether a tensor-parallel model runs ``press`` (no reader, no chunked prefill, no backward pass: KVgrad)."""
    return (press.reader is None and press.prefill_chunk is None
            and not getattr(press.scorer, "pass_needs_gradients", False))


def main() -> int:
    path, report = sys.argv[1], sys.argv[2]
    presets = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else None
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpress_ada import preset, use_tokenizer
    from kvpress_ada.hosts.transformers.hf import output_cache
    from kvpress_ada.hosts.transformers.press_cache import PressCache
    from kvpress_ada.hosts.transformers.tensor_parallel import head_shard
    from kvpress_ada.presets import portable_preset_names

    tp = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    for m in (tp, ref):
        use_tokenizer(m, tok)
    shard = head_shard(tp)
    # a plan that leaves attention whole (GPT-OSS's): every rank holds every kv head, as one process does
    whole = shard is None
    assert whole or shard.size == dist.get_world_size(), shard
    n_local = tp.config.num_key_value_heads if whole else shard.n_local

    def local(t):
        return t if whole else shard.local(t)
    rank = dist.get_rank()

    gen = torch.Generator().manual_seed(0)
    L = 160
    ids = torch.randint(4, 100, (2, L), generator=gen)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, :24] = 0  # left padding: row 1 has 136 real tokens
    ids[1, :24] = 0

    captured: list = []
    original = PressCache.retain

    def recording(self, layer_idx, keep, held=None, spare=None):
        captured.append((layer_idx, keep.clone()))
        return original(self, layer_idx, keep, held, spare)

    PressCache.retain = recording  # type: ignore[method-assign]
    from kvpress_ada.pipeline import Pipeline

    scored: dict = {}
    original_scores = Pipeline._scores

    def recording_scores(self, view):
        out = original_scores(self, view)
        scored[view.layer_idx] = out
        return out

    Pipeline._scores = recording_scores  # type: ignore[method-assign]

    def run(model, press):
        captured.clear()
        scored.clear()
        with torch.no_grad(), press(model):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                 return_dict_in_generate=True, pad_token_id=0)
        keeps = dict(captured)
        return (out.sequences[:, L:], [keeps[i] for i in sorted(keeps)], output_cache(out),
                [scored[i] for i in sorted(scored)])

    results = {}
    failures = []
    surrogate = sys.argv[4] if len(sys.argv) > 4 else None  # a surrogate file for this model: KVzap runs too
    # refused under tensor parallelism: a reader (its read split compares every kv head of a layer), a chunked
    # prefill (block_keydiff) and a backward pass through the model (kvgrad)
    names = (presets or [n for n in portable_preset_names() if _served(preset(n, compression_ratio=0.5))]) + (
        ["kvzap"] if surrogate else [])
    for name in names:
        if name == "kvzap":
            from kvpress_ada.scorers.kvzap import KVzap

            press = preset(name, compression_ratio=0.5, scorer=KVzap(path=surrogate))
        else:
            press = preset(name, compression_ratio=0.5)
        tokens, keeps, cache, _ = run(tp, press)
        ref_tokens, ref_keeps, ref_cache, ref_scores = run(ref, press)
        problems = []
        swaps = 0
        if not torch.equal(tokens, ref_tokens):
            problems.append(f"tokens {tokens.tolist()} != {ref_tokens.tolist()}")
        for layer, (keep, ref_keep) in enumerate(zip(keeps, ref_keeps)):
            if keep.shape[1] != n_local:
                problems.append(f"layer {layer}: {keep.shape[1]} heads on this rank, expected {n_local}")
            elif not torch.equal(keep, local(ref_keep)):
                near, why = near_tie_swaps(keep, local(ref_keep), local(ref_scores[layer]))
                swaps += near
                if why:
                    problems.append(f"layer {layer}: {why}")
        D = getattr(tp.config, "head_dim", None) or tp.config.hidden_size // tp.config.num_attention_heads
        # a hybrid model's sliding-window layers hold their window (the rank's kv heads of it); the others are
        # press layers: each row kept entries + the decode reserve, rounded up to whole chunks (compile-first)
        windows = [layer for layer in cache.layers if not hasattr(layer, "decode_reserve")]
        reserve = next(layer for layer in cache.layers if hasattr(layer, "decode_reserve")).decode_reserve
        from kvpress_ada.kernels.ragged.reference import CHUNK

        own = sum(int((-(-(k.sum(-1) + reserve) // CHUNK) * CHUNK).sum()) for k in keeps) * D * 2 * 4 + sum(
            layer.nbytes() for layer in windows)
        if cache.nbytes() != own:
            problems.append(f"this rank holds {cache.nbytes()} bytes, its rows are {own}")
        total = torch.tensor([cache.nbytes()])
        dist.all_reduce(total)
        if int(total) != ref_cache.nbytes() * (dist.get_world_size() if whole else 1):
            problems.append(f"ranks hold {int(total)} bytes together, one process {ref_cache.nbytes()}")
        results[name] = {"ok": not problems, "problems": problems, "near_tie_swaps": swaps, "tokens": tokens.tolist(),
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
