"""Selection invariants: protected tokens kept, kept indices unique and sorted, padding excluded."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import AdaHead, Observation, Pipeline, SnapKV, StreamingLLM, UniformHead
from kvpress_ada.evictors import topk_mask
from kvpress_ada.hosts.transformers import RaggedLayer

SETTINGS = settings(max_examples=40, deadline=None)


def _obs(B, Hkv, G, L, D, pads, seed, w):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, Hkv, L, D, generator=g)
    values = torch.randn(B, Hkv, L, D, generator=g)
    queries = torch.randn(B, Hkv * G, w, D, generator=g)
    key_mask = torch.ones(B, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        key_mask[b, :p] = False
    return Observation(keys=keys, values=values, queries=queries, key_mask=key_mask, layer_idx=0, n_layers=1,
                       scaling=D**-0.5)


@st.composite
def setups(draw):
    B = draw(st.integers(1, 3))
    L = draw(st.integers(8, 48))
    pads = [draw(st.integers(0, L // 3)) for _ in range(B)]
    return dict(B=B, Hkv=draw(st.integers(1, 3)), G=draw(st.sampled_from([1, 2])), L=L, D=8, pads=pads,
                seed=draw(st.integers(0, 10_000)))


@SETTINGS
@given(setups(), st.integers(1, 6), st.floats(0.0, 0.9), st.sampled_from([UniformHead(), AdaHead(alpha=0.2),
                                                                          AdaHead(alpha=0.0)]))
def test_snapkv_window_always_kept_and_padding_never(setup, window, ratio, allocator):
    obs = _obs(**setup, w=window)
    press = Pipeline(scorer=SnapKV(window=window, kernel=3), allocator=allocator, compression_ratio=ratio)
    keep = press.select(obs)
    counts = keep.sum(-1)
    assert not bool((keep & ~obs.key_mask[:, None, :]).any())  # padding never kept
    lengths = obs.valid_lengths()
    H = setup["Hkv"]
    expected = torch.round((1 - ratio) * lengths.double()).long().clamp(min=1)
    assert torch.equal(counts.sum(-1), H * expected)  # budgets count valid tokens only
    protected_fits = counts.min(-1).values >= window
    for b in range(setup["B"]):
        if protected_fits[b]:
            assert bool(keep[b, :, -window:].all())


@SETTINGS
@given(setups(), st.integers(0, 4), st.integers(1, 48))
def test_streaming_sinks_and_recent(setup, sinks, budget):
    obs = _obs(**setup, w=1)
    press = Pipeline(scorer=StreamingLLM(sinks=sinks), budget=budget)
    keep = press.select(obs)
    for b, p in enumerate(setup["pads"]):
        n = setup["L"] - p
        kept = min(budget, n)
        if kept < sinks:  # budget smaller than the protected set: only sinks survive
            assert bool(keep[b, :, p:p + sinks].sum(-1).eq(kept).all())
            continue
        expected = torch.zeros(setup["L"], dtype=torch.bool)
        s = min(sinks, kept)
        expected[p:p + s] = True
        if kept - s > 0:
            expected[setup["L"] - (kept - s):] = True
        assert torch.equal(keep[b], expected.expand_as(keep[b]))


@SETTINGS
@given(setups(), st.floats(0.0, 0.95))
def test_ragged_rows_hold_kept_tokens_in_position_order(setup, ratio):
    """Compaction keeps exactly the selected tokens, unique and in ascending position order."""
    obs = _obs(**setup, w=4)
    keep = Pipeline(scorer=SnapKV(window=4), allocator=AdaHead(), compression_ratio=ratio).select(obs)
    # tag each key with its position so the ragged rows reveal which tokens they hold
    B, H, L, D = obs.keys.shape
    keys = torch.arange(L, dtype=torch.float32)[None, None, :, None].expand(B, H, L, D).contiguous()
    layer = RaggedLayer(decode_reserve=2)
    layer.update(keys, keys.clone())
    layer.compress(keep)
    for b in range(B):
        for h in range(H):
            r = b * H + h
            start, n = int(layer.row_offsets[r]), int(layer.row_lengths[r])
            positions = layer.k_flat[start:start + n, 0].long()
            assert torch.equal(positions, keep[b, h].nonzero().flatten())
            assert bool((positions[1:] > positions[:-1]).all())


def test_topk_prefers_recent_on_ties():
    scores = torch.zeros(1, 1, 6)
    assert topk_mask(scores, torch.tensor([[2]])).tolist() == [[[False, False, False, False, True, True]]]
