"""Presses that change the structure of what is kept (chunks, blocks, lazy layers, streaming heads, re-rotated
keys, presses in sequence): each against its paper's rule recomputed with explicit loops on tiny tensors, and
the invariants the pipeline relies on (left padding changes nothing, capabilities carried honestly)."""

from __future__ import annotations

import pytest
import torch

from kvpress_ada import Observation, Pipeline
from kvpress_ada.scorers import ChunkKV, CriticalKV, KNorm, SnapKV

INF = float("inf")


def _obs(seed=0, B=2, Hkv=2, G=2, L=23, D=4, pads=(0, 5)):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, Hkv, L, D, generator=g)
    key_mask = torch.ones(B, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        key_mask[b, :p] = False
    return Observation(keys=keys, values=torch.randn(B, Hkv, L, D, generator=g),
                       queries=torch.randn(B, Hkv * G, L, D, generator=g), key_mask=key_mask, layer_idx=0,
                       n_layers=2, scaling=D**-0.5)


def _row(obs, b, p):
    """Row ``b`` of ``obs`` alone, its ``p`` padding slots dropped."""
    return Observation(keys=obs.keys[b:b + 1, :, p:], values=obs.values[b:b + 1, :, p:],
                       queries=obs.queries[b:b + 1, :, p:], key_mask=obs.key_mask[b:b + 1, p:], layer_idx=0,
                       n_layers=2, scaling=obs.scaling)


# ----------------------------------------------------------------------------------------------------- ChunkKV


def _chunk_reference(inner, key_mask, length, shared):
    """ChunkKV's rule with loops: chunks of ``length`` valid entries counted from the last, each unprotected
    entry scored by the mean of its chunk's unprotected entries (over every head's with ``shared``)."""
    B, H, L = inner.shape
    out = inner.clone()
    for b in range(B):
        valid = [j for j in range(L) if key_mask[b, j]]
        chunks = [valid[max(0, end - length):end] for end in range(len(valid), 0, -length)]
        for chunk in chunks:
            heads = [list(range(H))] if shared else [[h] for h in range(H)]
            for group in heads:
                vals = [float(inner[b, h, j]) for h in group for j in chunk if inner[b, h, j] != INF]
                mean = sum(vals) / max(len(vals), 1)
                for h in group:
                    for j in chunk:
                        if inner[b, h, j] != INF:
                            out[b, h, j] = mean
    return out


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("length", [1, 4, 7, 40])
@pytest.mark.parametrize("inner", [SnapKV(window=3, kernel=3), KNorm()], ids=["snapkv", "knorm"])
def test_chunkkv_matches_the_chunk_mean_rule(inner, length, shared):
    obs = _obs()
    got = ChunkKV(scorer=inner, length=length, shared=shared).score(obs)
    want = _chunk_reference(inner.score(obs).float(), obs.key_mask, length, shared)
    valid = obs.key_mask[:, None, :].expand_as(got)
    assert torch.equal(torch.isinf(got[valid]), torch.isinf(want[valid]))
    assert torch.allclose(got[valid & torch.isfinite(want)], want[valid & torch.isfinite(want)], rtol=1e-5)
    if shared:  # one ranking for every head of a row
        assert torch.equal(got[:, :1].expand_as(got)[valid], got[valid])


def test_chunkkv_keeps_whole_chunks_and_the_window():
    obs = _obs(pads=(0, 0), L=40)
    press = Pipeline(scorer=ChunkKV(scorer=SnapKV(window=4, kernel=1), length=6), budget=16)
    keep = press.select(obs)
    assert keep.eq(keep[:, :1]).all()  # shared ranking: every head of a row keeps the same entries
    for b in range(2):
        assert keep[b, 0, 36:].all()  # the protected window
        chunks = {}
        for j in range(36):  # chunks counted from the last entry: (39 - j) // 6
            chunks.setdefault((39 - j) // 6, []).append(bool(keep[b, 0, j]))
        partial = [c for c, kept in chunks.items() if 0 < sum(kept) < len(kept)]
        assert len(partial) <= 1  # whole chunks, but for the one at the budget's boundary
        if partial:  # which keeps its most recent entries (ties go to the recent)
            kept = chunks[partial[0]][::-1]
            assert kept == sorted(kept, reverse=True)


def test_chunkkv_padding_changes_nothing():
    obs = _obs()
    scorer = ChunkKV(scorer=SnapKV(window=3), length=5)
    batch = scorer.score(obs)
    for b, p in enumerate((0, 5)):
        alone = scorer.score(_row(obs, b, p))
        assert torch.allclose(batch[b:b + 1, :, p:], alone, rtol=1e-5, atol=1e-7)


def test_chunkkv_carries_its_scorers_capabilities():
    assert ChunkKV(scorer=KNorm()).comparable_across_heads is False
    assert ChunkKV().comparable_across_heads is True
    critical = ChunkKV(scorer=CriticalKV())
    assert critical.needs_output_weight and critical.query_window() == CriticalKV().query_window()
    assert critical.protected(torch.tensor([100])).item() == CriticalKV().protected(torch.tensor([100])).item()
    press = Pipeline(scorer=ChunkKV(scorer="knorm", length=3), compression_ratio=0.5)
    again = Pipeline.model_validate_json(press.model_dump_json())
    assert again == press and again.scorer.comparable_across_heads is False


def test_chunkkv_refuses_a_model_pass_scorer():
    with pytest.raises(ValueError, match="model pass"):
        ChunkKV(scorer="kvzip")
    with pytest.raises(ValueError, match="length"):
        ChunkKV(length=0)


# ------------------------------------------------------------------------------------------------ BlockPress


def test_block_keydiff_is_blockpress_on_the_first_layer():
    """kvpress's BlockPress loop, with blocks aligned on the end: after each block the held entries (kept + block)
    are scored together and the best ``min(budget, seen)`` per head kept. Layer 0's keys do not depend on what
    earlier layers kept, so the dense prefill's keys give the reference."""
    from conftest import build_model

    from kvpress_ada import preset
    from kvpress_ada.evictors import topk_mask
    from kvpress_ada.hosts.transformers.hf import output_cache
    from kvpress_ada.scorers import KeyDiff

    model = build_model("llama")
    ids = torch.randint(4, 128, (1, 70), generator=torch.Generator().manual_seed(0))
    press = preset("block_keydiff", compression_ratio=0.5, prefill_chunk=16)
    assert press.prefill_chunk == 16 and isinstance(press.scorer, KeyDiff)
    with torch.no_grad():
        dense = output_cache(model(ids, use_cache=True)).layers[0].keys  # [1, H, 70, D]
        with press(model):
            cache = output_cache(model(ids, use_cache=True))
    H, budget = dense.shape[1], 35
    for h in range(H):
        held: list[int] = []
        for stop in range(6, 71, 16):  # blocks (0, 6), (6, 22), ..., (54, 70)
            held += list(range(stop - (6 if stop == 6 else 16), stop))
            if len(held) > budget:
                keys = dense[:, h:h + 1, held]
                obs = Observation(keys=keys, values=keys, queries=keys[:, :, :0], layer_idx=0, n_layers=2,
                                  key_mask=torch.ones(1, len(held), dtype=torch.bool), scaling=1.0)
                keep = topk_mask(KeyDiff().score(obs), torch.tensor([[budget]]))[0, 0]
                held = [p for p, k in zip(held, keep.tolist()) if k]
        view = cache.layers[0].view()
        got = view.positions[0, h][view.valid[0, h]].tolist()
        assert got == held
        assert len(got) == budget


# ----------------------------------------------------------------------------------------------------- FINCH


def test_finch_matches_its_formula():
    """Each window query's softmax over the valid keys it sees, times how many it sees, averaged over the
    window's valid queries and the query group; the window kept (loops, ``math.exp``)."""
    import math

    from kvpress_ada.scorers import Finch

    obs = _obs(L=12, pads=(0, 3))
    w, G, D = 4, 2, obs.keys.shape[-1]
    got = Finch(window=w).score(obs)
    B, H, L = got.shape
    for b in range(B):
        valid = [j for j in range(L) if obs.key_mask[b, j]]
        for h in range(H):
            total = [0.0] * L
            queries = [i for i in range(L - w, L) if obs.key_mask[b, i]]
            for g in range(G):
                for i in queries:
                    seen = [j for j in valid if j <= i]
                    q = obs.queries[b, h * G + g, i]
                    logits = {j: float(q @ obs.keys[b, h, j]) * D**-0.5 for j in seen}
                    top = max(logits.values())
                    norm = sum(math.exp(v - top) for v in logits.values())
                    for j in seen:
                        total[j] += math.exp(logits[j] - top) / norm * len(seen) / len(queries) / G
            for j in valid:
                if j >= L - w:
                    assert got[b, h, j] == INF
                else:
                    assert math.isclose(float(got[b, h, j]), total[j], rel_tol=1e-4, abs_tol=1e-6)


def test_finch_padding_changes_nothing():
    from kvpress_ada.scorers import Finch

    obs = _obs()
    batch = Finch(window=3).score(obs)
    for b, p in enumerate((0, 5)):
        assert torch.allclose(batch[b:b + 1, :, p:], Finch(window=3).score(_row(obs, b, p)), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------- re-rotation


def _rope(x, positions, inv_freq):
    """transformers' RoPE (``rotate_half`` layout) of ``x [..., L, D]`` at ``positions [..., L]``, written out."""
    angle = positions.double()[..., None] * inv_freq.double()
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    half = x.shape[-1] // 2
    return (x.double() * cos + torch.cat([-x[..., half:], x[..., :half]], -1).double() * sin).float()


def test_evicted_after_counts_the_valid_entries_dropped_later():
    from kvpress_ada.evictors.rerotation import evicted_after

    g = torch.Generator().manual_seed(1)
    keep, valid = torch.rand(3, 2, 17, generator=g) > 0.5, torch.rand(3, 2, 17, generator=g) > 0.2
    got = evicted_after(keep & valid, valid)
    for b, h, j in torch.cartesian_prod(torch.arange(3), torch.arange(2), torch.arange(17)).tolist():
        want = sum(1 for t in range(j + 1, 17) if valid[b, h, t] and not (keep[b, h, t] and valid[b, h, t]))
        assert got[b, h, j] == want


def test_rotate_moves_a_key_to_a_later_position():
    from kvpress_ada.evictors.rerotation import rotate

    g = torch.Generator().manual_seed(2)
    raw = torch.randn(2, 3, 9, 8, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    pos = torch.randint(0, 50, (2, 3, 9), generator=g)
    shift = torch.randint(0, 20, (2, 3, 9), generator=g)
    assert torch.allclose(rotate(_rope(raw, pos, inv_freq), shift, inv_freq), _rope(raw, pos + shift, inv_freq),
                          atol=1e-5)
    half = inv_freq[:2]  # partial rotary: the first 4 channels rotate, the rest stay
    partial = torch.cat([_rope(raw[..., :4], pos, half), raw[..., 4:]], -1)
    moved = torch.cat([_rope(raw[..., :4], pos + shift, half), raw[..., 4:]], -1)
    assert torch.allclose(rotate(partial, shift, half), moved, atol=1e-5)


def test_rerotation_gives_kvpress_attention_logits():
    """kvpress re-rotates a head's ``n`` kept keys to positions ``0..n-1`` and feeds the next token at ``n``; here
    they move forward by the entries evicted after them and the next token keeps its true position. The logits of
    a new query agree, for heads and rows that keep different numbers of entries, with left padding."""
    from kvpress_ada.evictors.rerotation import KeyRotation
    from kvpress_ada.runtime.views import HeldEntries

    g = torch.Generator().manual_seed(3)
    B, H, L, D, pads = 2, 3, 20, 8, (0, 6)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    raw_k, raw_q = torch.randn(B, H, L, D, generator=g), torch.randn(B, H, D, generator=g)
    valid = torch.ones(B, H, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        valid[b, :, :p] = False
    true_pos = (valid.long().cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens from position 0
    keys = _rope(raw_k, true_pos, inv_freq)
    keep = (torch.rand(B, H, L, generator=g) > 0.4) & valid
    held = HeldEntries(keys, keys, valid, torch.arange(L).expand(B, H, L))
    rotated = KeyRotation(inv_freqs=(inv_freq,)).apply(0, held, keep).keys
    for b in range(B):
        nxt = int(valid[b, 0].sum())  # the next token's true position
        for h in range(H):
            idx = keep[b, h].nonzero().flatten()
            n = len(idx)
            ours = _rope(raw_q[b, h][None], torch.tensor([nxt]), inv_freq) @ rotated[b, h, idx].T
            theirs_k = _rope(raw_k[b, h, idx], torch.arange(n), inv_freq)
            theirs = _rope(raw_q[b, h][None], torch.tensor([n]), inv_freq) @ theirs_k.T
            assert torch.allclose(ours, theirs, atol=1e-4)
            assert torch.equal(rotated[b, h][~keep[b, h]], keys[b, h][~keep[b, h]])  # the others untouched


@pytest.mark.parametrize("evictor", ["topk", "mask"])
def test_rerotated_streamingllm_decodes_like_kvpress(evictor):
    """The model under ``rerotated_streamingllm`` predicts what a dense cache does when it holds the kept entries
    with their keys re-rotated to positions ``0..n-1`` and the next token sits at ``n`` (kvpress's
    KeyRerotationPress); without re-rotation the prediction differs."""
    from conftest import build_model
    from transformers import DynamicCache

    from kvpress_ada import Mask, preset
    from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache

    model = build_model("llama")
    L, n, sinks = 40, 16, 4
    ids = torch.randint(4, 128, (1, L), generator=torch.Generator().manual_seed(5))
    nxt = torch.tensor([[7]])
    press = preset("rerotated_streamingllm", budget=n)
    if evictor == "mask":
        press = press.replace(evictor=Mask(rerotate=True))
    kept = torch.cat([torch.arange(sinks), torch.arange(L - n + sinks, L)])
    inv_freq = model.model.rotary_emb.inv_freq
    with torch.no_grad():
        dense = output_cache(model(ids, use_cache=True))
        ref = DynamicCache(config=model.config)
        for i, layer in enumerate(dense.layers):
            angle = (torch.arange(n) - kept).double()[:, None] * inv_freq.double()  # kvpress: to 0..n-1
            cos, sin = torch.cat([angle, angle], -1).cos().float(), torch.cat([angle, angle], -1).sin().float()
            k = layer.keys[:, :, kept]
            half = k.shape[-1] // 2
            ref.update(k * cos + torch.cat([-k[..., half:], k[..., :half]], -1) * sin, layer.values[:, :, kept], i)
        want = model(nxt, **{cache_kwarg(model): ref}, position_ids=torch.tensor([[n]])).logits
        with press(model):
            cache = output_cache(model(ids, use_cache=True))
            got = model(nxt, **{cache_kwarg(model): cache}, position_ids=torch.tensor([[L]])).logits
        plain = preset("streamingllm", budget=n, **({"evictor": Mask()} if evictor == "mask" else {}))
        with plain(model):
            cache = output_cache(model(ids, use_cache=True))
            unrotated = model(nxt, **{cache_kwarg(model): cache}, position_ids=torch.tensor([[L]])).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(unrotated, want, atol=1e-3)


@pytest.mark.parametrize("name", ["rerotated_streamingllm", "ada_finch"])
def test_rerotation_across_chunks_and_decode_compactions_matches_the_mask_reference(name):
    """Re-rotation again at every compression (chunked prefill, decode compaction): the ragged cache and the
    dense Mask reference give the same logits, batch 2 with left padding, and differ from not re-rotating."""
    from conftest import build_model, left_padded_batch

    from kvpress_ada import Mask, preset
    from kvpress_ada.scorers import Finch

    model = build_model("llama")
    ids, mask = left_padded_batch(seed=4)
    press = preset(name, compression_ratio=0.5, prefill_chunk=32).replace(decode_budget=24, decode_interval=3)
    if name == "ada_finch":
        press = press.replace(scorer=Finch(window=8))
    outs = []
    for p in (press, press.replace(evictor=Mask(rerotate=True)), press.replace(evictor=Mask())):
        with torch.no_grad(), p(model):
            outs.append(model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                                       output_scores=True, return_dict_in_generate=True))
    ragged, dense, unrotated = outs
    assert torch.equal(ragged.sequences, dense.sequences)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(ragged.scores, dense.scores))
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(ragged.scores, unrotated.scores))


def test_rerotation_refusals():
    from kvpress_ada import TopK, preset

    with pytest.raises(ValueError, match="re-rotate"):
        preset("finch", compression_ratio=0.5, storage="int8", prefill_chunk=64)
    preset("finch", compression_ratio=0.5, storage="int8")  # one compression: the records are written re-rotated
    from kvpress_ada.serving.requests import check_servable

    with pytest.raises(ValueError, match="rerotate"):
        check_servable(preset("snapkv", compression_ratio=0.5, evictor=TopK(rerotate=True)))


def test_fan_out_rerotates_the_rows_of_the_presses_that_ask():
    """A fan-out cache holds what the press's own prefill holds, re-rotated keys included; in a batch of presses
    only the rows of re-rotating presses are re-rotated."""
    from conftest import build_model

    from kvpress_ada import preset
    from kvpress_ada.hosts.transformers.fanout import capture_prefill
    from kvpress_ada.hosts.transformers.hf import output_cache

    model = build_model("llama")
    ids = torch.randint(4, 128, (1, 50), generator=torch.Generator().manual_seed(6))
    rotating, plain = preset("rerotated_streamingllm", budget=20), preset("streamingllm", budget=20)
    with torch.no_grad():
        prefill = capture_prefill(model, ids)
        alone = {}
        for name, press in (("rotating", rotating), ("plain", plain)):
            with press(model):
                alone[name] = output_cache(model(ids, use_cache=True))
        fanned = prefill.compressed_cache(rotating)
        batch = prefill.compressed_batch([rotating, plain], [prefill.keep_masks(rotating), prefill.keep_masks(plain)])
    for i in range(len(fanned.layers)):
        want = alone["rotating"].layers[i].view().keys
        assert torch.allclose(fanned.layers[i].view().keys, want, atol=1e-5)
        both = batch.layers[i].view().keys
        assert torch.allclose(both[:1], want, atol=1e-5)
        assert torch.allclose(both[1:], alone["plain"].layers[i].view().keys, atol=1e-5)
        assert not torch.allclose(want, alone["plain"].layers[i].view().keys, atol=1e-3)


# ------------------------------------------------------------------------------------------------ SimLayerKV


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.6, 1.0])
def test_simlayerkv_matches_its_rule(threshold):
    """A row's layer is lazy when the mean attention (over the last ``n_last`` valid queries and every query
    head) on its first ``n_initial`` and last ``n_recent`` valid entries exceeds the threshold (loops)."""
    import math

    from kvpress_ada.scorers import SimLayerKV

    obs = _obs(L=14, pads=(0, 4))
    scorer = SimLayerKV(lazy_threshold=threshold, n_last=2, n_recent=3, n_initial=2)
    got = scorer.score(obs)
    B, H, L = got.shape
    Hq, D = obs.queries.shape[1], obs.keys.shape[-1]
    for b in range(B):
        valid = [j for j in range(L) if obs.key_mask[b, j]]
        kept = set(valid[:2] + valid[-3:])
        mass, n = 0.0, 0
        for hq in range(Hq):
            for i in range(L - 2, L):
                logits = {j: float(obs.queries[b, hq, i] @ obs.keys[b, hq // (Hq // H), j]) * D**-0.5
                          for j in valid if j <= i}
                top = max(logits.values())
                norm = sum(math.exp(v - top) for v in logits.values())
                mass += sum(math.exp(logits[j] - top) / norm for j in kept if j in logits)
                n += 1
        lazy = mass / n > threshold
        for h in range(H):
            for j in valid:
                if j in kept or not lazy:
                    assert got[b, h, j] == INF
                else:  # droppable: below 0, the more recent the higher
                    assert got[b, h, j] == -1.0 - sum(1 for t in valid if t > j)


def test_simlayerkv_preset_keeps_sinks_and_recent_in_lazy_layers_only():
    from conftest import build_model

    from kvpress_ada import preset
    from kvpress_ada.hosts.transformers.hf import output_cache
    from kvpress_ada.scorers import SimLayerKV

    model = build_model("llama")
    ids = torch.randint(4, 128, (1, 60), generator=torch.Generator().manual_seed(8))
    lazy = preset("simlayerkv", scorer=SimLayerKV(lazy_threshold=0.0, n_recent=10, n_initial=3))
    never = preset("simlayerkv", scorer=SimLayerKV(lazy_threshold=1.0, n_recent=10, n_initial=3))
    assert lazy.compression_ratio is None and lazy.budget is None  # the input decides how much is kept
    with torch.no_grad():
        for press, want in ((lazy, list(range(3)) + list(range(50, 60))), (never, list(range(60)))):
            with press(model):
                cache = output_cache(model(ids, use_cache=True))
            for layer in cache.layers:
                view = layer.view()
                for h in range(view.keys.shape[1]):
                    assert view.positions[0, h][view.valid[0, h]].tolist() == want


# ----------------------------------------------------------------------------------------------- DuoAttention


def test_streaming_deviation_matches_its_formula():
    """Per query head and query: softmax attention output over every earlier entry against over the first
    ``sinks`` and the ``recent`` latest (itself included); relative L2 distance, mean over queries and group."""
    import math

    from kvpress_ada.harness.duo import streaming_deviation

    g = torch.Generator().manual_seed(9)
    H, G, L, D, Q, sinks, recent = 2, 2, 12, 4, 3, 2, 4
    q = torch.randn(H * G, Q, D, generator=g)
    k, v = torch.randn(H, L, D, generator=g), torch.randn(H, L, D, generator=g)
    got = streaming_deviation(q, k, v, 0.5, sinks, recent)

    def attend(hq, i, keys):
        logits = [float(q[hq, i - (L - Q)] @ k[hq // G, j]) * 0.5 for j in keys]
        top = max(logits)
        w = [math.exp(x - top) for x in logits]
        return sum(wi / sum(w) * v[hq // G, j] for wi, j in zip(w, keys))

    for h in range(H):
        devs = []
        for hq in range(h * G, (h + 1) * G):
            for i in range(L - Q, L):
                full = attend(hq, i, list(range(i + 1)))
                stream = attend(hq, i, [j for j in range(i + 1) if j < sinks or j > i - recent])
                devs.append(float((full - stream).norm() / full.norm()))
        assert math.isclose(float(got[h]), sum(devs) / len(devs), rel_tol=1e-4)


@pytest.fixture(scope="module")
def duo_tiny(tmp_path_factory):
    """A tiny llama and DuoAttention patterns measured on it by the real ``measure_duo``, saved to a file."""
    from conftest import build_model, build_tokenizer

    from kvpress_ada.harness.duo import measure_duo

    model = build_model("llama", max_position_embeddings=4096)
    result = measure_duo(model, build_tokenizer(), n=2, tasks=["passkey"], context=300, sinks=3, recent=10,
                         queries=8, progress=False)
    path = tmp_path_factory.mktemp("duo") / "duo.json"
    result.save(path)
    return model, str(path), result


def test_duo_attention_streams_the_heads_that_move_least(duo_tiny):
    from kvpress_ada import preset
    from kvpress_ada.hosts.transformers.hf import output_cache
    from kvpress_ada.scorers import DuoAttention

    model, path, result = duo_tiny
    shares = torch.tensor(result.shares)
    assert result.scorer["sinks"] == 3 and result.question_aware and torch.isclose(shares.sum(), torch.tensor(1.0))
    scorer = DuoAttention(path=path, head_ratio=0.5)
    streaming = scorer.streaming()
    assert int(streaming.sum()) == round(shares.numel() * 0.5)
    assert shares[streaming].max() <= shares[~streaming].min()  # the least moved heads stream
    ids = torch.randint(4, 60, (1, 40), generator=torch.Generator().manual_seed(10))
    with torch.no_grad(), preset("duo_attention", scorer=scorer)(model):
        cache = output_cache(model(ids, use_cache=True))
    for layer, held in enumerate(cache.layers):
        view = held.view()
        for h in range(view.keys.shape[1]):
            kept = view.positions[0, h][view.valid[0, h]].tolist()
            assert kept == (list(range(3)) + list(range(30, 40)) if streaming[layer, h] else list(range(40)))


def test_duo_attention_ragged_matches_mask_and_padding_changes_nothing(duo_tiny):
    from conftest import generate_ragged_and_mask, left_padded_batch

    from kvpress_ada import preset
    from kvpress_ada.scorers import DuoAttention

    model, path, _ = duo_tiny
    press = preset("duo_attention", scorer=DuoAttention(path=path, head_ratio=0.7))
    ids, mask = left_padded_batch(seed=11, lengths=(60, 44))
    ragged, dense = generate_ragged_and_mask(model, press, ids, attention_mask=mask)
    assert torch.equal(ragged, dense)
    with torch.no_grad(), press(model):
        alone = model.generate(ids[1:, 16:], do_sample=False, max_new_tokens=4)
    assert torch.equal(ragged[1, 16:], alone[0])


def test_duo_attention_refuses_other_models_and_other_files(duo_tiny, tmp_path):
    from conftest import default_model_config

    from kvpress_ada import calibration, preset
    from kvpress_ada.scorers import DuoAttention

    model, path, result = duo_tiny
    with pytest.raises(calibration.CalibrationError, match="kvpress-ada calibrate --method duo") as err:
        DuoAttention(path=path).check_model(default_model_config())
    assert "\n" not in str(err.value)
    with pytest.raises(calibration.CalibrationError, match="--method duo"):
        DuoAttention().check_model(model.config)  # the shipped patterns are the default model's
    DuoAttention().check_model(default_model_config())
    other = result.model_copy(update={"scorer": {"name": "kvzip"}})
    other.save(tmp_path / "kvzip.json")
    with pytest.raises(calibration.CalibrationError, match="not DuoAttention's head patterns"):
        DuoAttention(path=str(tmp_path / "kvzip.json")).streaming()
    with pytest.raises(ValueError, match="head_ratio"):
        DuoAttention(head_ratio=1.5)
    assert "duo_attention" not in __import__("kvpress_ada.presets").presets.portable_preset_names()
    assert preset("duo_attention").allocator.sets_budget


def test_rerotation_refuses_pruned_key_channels():
    from kvpress_ada import TopK, preset
    from kvpress_ada.channels import ThinK

    with pytest.raises(ValueError, match="re-rotation"):
        preset("snapkv", compression_ratio=0.5, evictor=TopK(rerotate=True), key_channels=ThinK())


# ------------------------------------------------------------------------------------------------ composed


def test_composed_scores_the_survivors_of_each_stage():
    """Stage 1 (KNorm) keeps round(0.6 n) of each head's valid entries; KeyDiff then scores only those, its anchor
    the mean over the survivors (loops); the others score -inf."""
    import torch.nn.functional as F

    from kvpress_ada.scorers import Composed, KeyDiff

    obs = _obs(L=15, pads=(0, 4))
    got = Composed(stages=[KNorm(), KeyDiff()], keep=[0.6]).score(obs)
    B, H, L = got.shape
    for b in range(B):
        valid = [j for j in range(L) if obs.key_mask[b, j]]
        for h in range(H):
            norms = {j: -float(obs.keys[b, h, j].norm()) for j in valid}  # KNorm: lower norm = keep
            n = round(0.6 * len(valid))
            ranked = sorted(valid, key=lambda j: (norms[j], j), reverse=True)
            survivors = sorted(ranked[:n])
            unit = [F.normalize(obs.keys[b, h, j], dim=0) for j in survivors]
            anchor = sum(unit) / len(unit)
            for j in range(L):
                if j in survivors:
                    want = -float(F.cosine_similarity(obs.keys[b, h, j], anchor, dim=0))
                    assert abs(float(got[b, h, j]) - want) < 1e-5
                else:
                    assert got[b, h, j] == -INF


def test_composed_threshold_stage_and_capabilities():
    from kvpress_ada.scorers import Composed, SimLayerKV

    obs = _obs(L=16, pads=(0, 3))
    lazy = SimLayerKV(lazy_threshold=0.0, n_last=1, n_recent=5, n_initial=2)
    got = Composed(stages=[lazy, KNorm()], keep=[None]).score(obs)
    first = lazy.score(obs)
    assert torch.equal(torch.isneginf(got) & obs.key_mask[:, None, :], ~torch.isposinf(first) & obs.key_mask[:, None])
    both = Composed(stages=[KNorm(), CriticalKV()], keep=[0.5])
    assert both.needs_output_weight and both.query_window() == CriticalKV().query_window()
    assert both.comparable_across_heads == CriticalKV.comparable_across_heads
    assert Composed(stages=[SnapKV(), KNorm()], keep=[0.5]).comparable_across_heads is False
    press = Pipeline(scorer=Composed(stages=["knorm", {"name": "snapkv", "window": 8}], keep=[0.5]), budget=4)
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    with pytest.raises(ValueError, match="model pass"):
        Composed(stages=["knorm", "kvzip"], keep=[0.5])
    with pytest.raises(ValueError, match="one fraction per stage"):
        Composed(stages=["knorm", "snapkv"], keep=[0.5, 0.5])
    with pytest.raises(ValueError):
        Composed(stages=["knorm", "snapkv"], keep=[0.0])


def test_composed_with_ada_heads_scores_each_head_apart():
    """Ada heads keep different survivors: the second stage then scores each kv head on its own, as a pipeline
    scores a layer whose heads hold different entries."""
    from kvpress_ada.scorers import Composed

    obs = _obs(L=18, pads=(0, 2))
    scorer = Composed(stages=[KNorm(), SnapKV(window=3, kernel=1)], keep=[0.5])
    got = scorer.score(obs)
    for h in range(obs.keys.shape[1]):
        alone = replace_obs(obs, h)
        assert torch.allclose(got[:, h:h + 1], scorer.score(alone), atol=1e-6)


def replace_obs(obs, h):
    from dataclasses import replace

    G = obs.queries.shape[1] // obs.keys.shape[1]
    return replace(obs, keys=obs.keys[:, h:h + 1], values=obs.values[:, h:h + 1],
                   queries=obs.queries[:, h * G:(h + 1) * G], head_offset=h)


def test_a_paged_cache_refuses_to_rerotate_a_compressed_layer_in_one_line():
    from conftest import build_model, left_padded_batch

    from kvpress_ada import preset
    from kvpress_ada.hosts.transformers.hf import cache_kwarg
    from kvpress_ada.hosts.transformers.paged_cache import PagedCache

    model = build_model("llama")
    ids, mask = left_padded_batch()
    press = preset("rerotated_streamingllm", compression_ratio=0.5).replace(decode_budget=40, decode_interval=2)
    with pytest.raises(ValueError, match="cannot re-rotate") as err, torch.no_grad(), press(model):
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                       **{cache_kwarg(model): PagedCache(config=model.config, page_size=8)})
    assert "\n" not in str(err.value)
