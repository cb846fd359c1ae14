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
