"""Sparse reads of the kept cache (``Pipeline.reader``, :mod:`kvpress_ada.readers`): page summaries, Quest's page
bound, the read allocation across kv heads, attention over the selected pages, and every mode a decode step
reads through (prefill compression, no eviction, decode compression, fan-out, batches, compiled steps)."""

from dataclasses import replace

import pytest
import torch
from conftest import build_model, left_padded_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from torch._dynamo.utils import counters

from kvpress_ada import AdaHead, Mask, Pipeline, SnapKV, preset
from kvpress_ada.allocators import Threshold
from kvpress_ada.hosts.transformers import RaggedCache, RaggedLayer, compiled
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.generation import decode_rows
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.hosts.transformers.paged_cache import PagedCache
from kvpress_ada.hosts.transformers.quantized_cache import QuantizedRaggedLayer
from kvpress_ada.kernels.quantized.ops import quantized_attention
from kvpress_ada.kernels.quantized.scheme import RecordLayout
from kvpress_ada.kernels.ragged.ops import ragged_attention
from kvpress_ada.kernels.ragged.sparse import (
    page_bounds,
    page_summaries,
    round_outward,
    sparse_quantized_attention,
    sparse_ragged_attention,
)
from kvpress_ada.readers import READERS, TopPages, row_pages
from kvpress_ada.serving.requests import check_servable

torch.set_num_threads(1)
ALLOCATORS = [("uniform", {}), ("ada", {"alpha": 0.0}), ("ada", {"alpha": 0.2}), ("ada", {"alpha": 0.7})]


def _layer(B, H, D, keep, page_size, seed=0, appends=(), scale=1.0, dtype=torch.float32):
    """A compressed ragged layer of ``dtype`` under a reader of ``page_size`` pages: random keys (``scale``) kept
    where ``keep``, then ``appends`` tokens appended (each an eager append of that many tokens per row)."""
    g = torch.Generator().manual_seed(seed)
    L = keep.shape[-1]
    layer = RaggedLayer(decode_reserve=3)
    k = torch.randn(B, H, L, D, generator=g) * scale
    layer.update(k.to(dtype), torch.randn(B, H, L, D, generator=g).to(dtype))
    layer.read_with(TopPages(budget=2 * page_size, page_size=page_size))
    layer.compress(keep)
    for q in appends:
        layer.update((torch.randn(B, H, q, D, generator=g) * scale).to(dtype),
                     torch.randn(B, H, q, D, generator=g).to(dtype))
    return layer


def _assert_outward(lo, hi, true_lo, true_hi):
    """``lo, hi`` (16-bit) are ``true_lo`` rounded down and ``true_hi`` rounded up to their dtype: on the outer side,
    and the nearest such values (one step inward crosses the true value)."""
    assert lo.dtype == hi.dtype and lo.dtype.itemsize == 2
    lo32, hi32, true_lo, true_hi = lo.float(), hi.float(), true_lo.float(), true_hi.float()
    assert bool((lo32 <= true_lo).all()) and bool((hi32 >= true_hi).all())
    finite_lo, finite_hi = true_lo.isfinite(), true_hi.isfinite()  # an empty page: +inf / -inf, exactly
    inward_lo = torch.nextafter(lo, torch.full_like(lo, float("inf"))).float()
    inward_hi = torch.nextafter(hi, torch.full_like(hi, float("-inf"))).float()
    assert bool((inward_lo > true_lo)[finite_lo].all()) and bool((inward_hi < true_hi)[finite_hi].all())
    assert torch.equal(lo32[~finite_lo], true_lo[~finite_lo]) and torch.equal(hi32[~finite_hi], true_hi[~finite_hi])


def _entries(layer):
    """Per row ``r``: its keys ``[n, D]`` and values, read from the flat buffers."""
    out = []
    for o, n in zip(layer.row_offsets.tolist(), layer.row_lengths.tolist()):
        out.append((layer.k_flat[o:o + n], layer.v_flat[o:o + n]))
    return out


def _assert_summaries_current(layer):
    """The summaries kept current by appends equal those rebuilt from the layout now."""
    kmin, kmax = page_summaries(layer.k_flat, layer.row_offsets, layer.row_lengths, layer.pages.size)
    assert torch.equal(layer.pages.kmin, kmin) and torch.equal(layer.pages.kmax, kmax)


# ----------------------------------------------------------------------------- the page bound


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 2, 4, 8, 16, 32]),
       appends=st.lists(st.integers(1, 5), max_size=6), scale=st.sampled_from([1e-6, 1e-3, 1.0, 30.0, 3e4, 1e5]),
       softcap=st.sampled_from([None, 5.0]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_page_bound_is_an_upper_bound_of_every_logit(seed, page_size, appends, scale, softcap, dtype):
    """Every query head's logit (scaled, soft-capped) over every entry of a page is at most the page's bound, after
    compression and appends (some of which re-lay the layer out), with 16-bit summaries: float32 keys rounded
    outward to float16 (keys of 1e5 past its range, keys of 1e-6 in its subnormals), bfloat16 keys exactly; empty
    pages bound nothing (-inf)."""
    g = torch.Generator().manual_seed(seed)
    B, H, G, L, D = 2, 3, 2, 70, 8
    keep = torch.rand(B, H, L, generator=g) < torch.rand(B, H, 1, generator=g)
    layer = _layer(B, H, D, keep, page_size, seed, appends, scale, dtype)
    _assert_summaries_current(layer)
    assert layer.pages.kmin.dtype == (torch.float16 if dtype == torch.float32 else dtype)
    q = torch.randn(B, H * G, 1, D, generator=g) * scale
    bounds = page_bounds(q, layer.pages.kmin, layer.pages.kmax, layer.pages.table, 0.3, softcap)
    for r, (keys, _) in enumerate(_entries(layer)):
        b, h = divmod(r, H)
        keys = keys.float()
        logits = 0.3 * q[b, h * G:(h + 1) * G, 0] @ keys.T  # [G, n]
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        page = torch.arange(keys.shape[0]) // page_size
        top = bounds[b, h][:, page]  # [G, n]: each entry's page bound
        tol = 1e-5 * (0.3 * q[b, h * G:(h + 1) * G, 0].abs() @ keys.abs().T) + 1e-6
        assert bool((logits <= top + tol).all())
        n_pages = -(-keys.shape[0] // page_size)
        assert bool(torch.isneginf(bounds[b, h][:, n_pages:]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bound_is_tight_on_one_entry_pages(dtype):
    """With pages of one entry the bound is the logit itself (Quest's bound is exact on a single key): to float32
    rounding over 16-bit keys (their summaries are exact), and above it by at most the outward rounding of each
    channel to float16 (one float16 step, ``2^-10`` relative for normal numbers) over float32 keys."""
    B, H, L, D = 1, 2, 40, 16
    layer = _layer(B, H, D, torch.ones(B, H, L, dtype=torch.bool), page_size=1, appends=(1,), dtype=dtype)
    q = torch.randn(B, 2 * H, 1, D)
    bounds = page_bounds(q, layer.pages.kmin, layer.pages.kmax, layer.pages.table, 0.25)
    for r, (keys, _) in enumerate(_entries(layer)):
        qr, keys = 0.25 * q[0, 2 * r:2 * r + 2, 0], keys.float()
        logits = qr @ keys.T
        top = bounds[0, r][:, :keys.shape[0]]
        if dtype != torch.float32:
            torch.testing.assert_close(top, logits, atol=1e-5, rtol=1e-5)
            continue
        slack = 2.0 ** -10 * (qr.abs() @ keys.abs().T) + 2.0 ** -24 * qr.abs().sum(-1, keepdim=True)
        fp32 = 1e-5 * (qr.abs() @ keys.abs().T) + 1e-6
        assert bool((top >= logits - fp32).all()) and bool((top <= logits + slack + fp32).all())
        assert bool((top > logits).float().mean() > 0.5)  # rounded outward: mostly strictly above


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_round_outward_to_float16(source):
    """Rounding to float16 outward: each value rounded down is at or below it and one float16 step up is above it
    (the greatest such value), rounded up likewise; representable values are unchanged, values past float16's range
    go to -inf (down) / +inf (up) on their side and to +-65504 on the other, NaN stays NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2000, generator=g) * s for s in (1e-7, 1e-5, 1e-2, 1.0, 3e3, 6e4, 1e5, 1e30)])
    special = [0.0, -0.0, 1 + 2 ** -13, -(1 + 2 ** -13), 65504.0, 65519.0, 65520.0, 1e5, -1e5, 3e38, 1e-30, -1e-30,
               2 ** -24, 2 ** -25, float("inf"), float("-inf")]
    x = torch.cat([x, torch.tensor(special)]).to(source)
    down, up = round_outward(x, torch.float16, up=False), round_outward(x, torch.float16, up=True)
    _assert_outward(down, up, x, x)
    exact = x.half().float() == x.float()
    assert torch.equal(down[exact], x[exact].half()) and torch.equal(up[exact], x[exact].half())
    big, finite = x.float().abs() > 65504, x.float().isfinite()
    high, low = big & finite & (x.float() > 0), big & finite & (x.float() < 0)
    assert bool((down[high] == 65504).all()) and bool(torch.isposinf(up[high]).all()) and bool(high.any())
    assert bool(torch.isneginf(down[low]).all()) and bool((up[low] == -65504).all()) and bool(low.any())
    nan = round_outward(torch.tensor([float("nan")], dtype=source), torch.float16, up=True)
    assert bool(torch.isnan(nan).all())


def test_summaries_round_outward_and_bound_keys_past_float16():
    """float32 keys far past float16's range (1e5, -1e5) and between its values: each page's float16 summaries are
    its keys' min rounded down and max rounded up (infinite where the keys leave float16's range), appends fold in
    alike, and the bound still covers every logit (at least the query channel times float32's largest value where
    an infinite summary meets a query channel of its sign; ``-inf`` only for empty pages)."""
    g = torch.Generator().manual_seed(5)
    B, H, G, L, D, P = 1, 2, 2, 48, 8, 4
    keep = torch.rand(B, H, L, generator=g) < 0.8
    layer = _layer(B, H, D, keep, P, seed=5, appends=(1, 3), scale=1.0)
    k = torch.randn(B, H, 2, D, generator=g) * (1 + 2 ** -13)
    k[..., 0, 0], k[..., 1, 1] = 1e5, -1e5  # past float16's range, each in its own channel
    layer.update(k, torch.randn(B, H, 2, D, generator=g))
    for r, (keys, _) in enumerate(_entries(layer)):
        pages = layer.pages.table[r][:-(-keys.shape[0] // P)]
        lo = torch.stack([keys[j * P:(j + 1) * P].amin(0) for j in range(len(pages))])
        hi = torch.stack([keys[j * P:(j + 1) * P].amax(0) for j in range(len(pages))])
        _assert_outward(layer.pages.kmin[pages], layer.pages.kmax[pages], lo, hi)
        assert bool(torch.isposinf(layer.pages.kmax[pages, 0]).any())
        assert bool(torch.isneginf(layer.pages.kmin[pages, 1]).any())
    _assert_summaries_current(layer)
    q = torch.randn(B, H * G, 1, D, generator=g)
    q[..., 0], q[..., 1] = q[..., 0].abs(), -q[..., 1].abs()  # every query meets both infinite summaries
    bounds = page_bounds(q, layer.pages.kmin, layer.pages.kmax, layer.pages.table, 0.3)
    for r, (keys, _) in enumerate(_entries(layer)):
        logits = 0.3 * q[0, r * G:(r + 1) * G, 0] @ keys.T
        top = bounds[0, r][:, torch.arange(keys.shape[0]) // P]
        assert bool((logits <= top + 1e-5 * (0.3 * q[0, r * G:(r + 1) * G, 0].abs() @ keys.abs().T) + 1e-6).all())
        assert not bool(torch.isnan(bounds[0, r]).any())
        n = keys.shape[0]  # entry n - 2 holds 1e5 in channel 0, entry n - 1 holds -1e5 in channel 1
        qg = q[0, r * G:(r + 1) * G, 0]
        huge = 0.3 * qg.abs() * torch.finfo(torch.float32).max * 0.99  # [G, D]: a channel's term at +-inf
        assert bool((bounds[0, r][:, (n - 2) // P] >= huge[:, 0]).all())
        assert bool((bounds[0, r][:, (n - 1) // P] >= huge[:, 1]).all())
        assert bool(torch.isfinite(bounds[0, r][:, :(n - 2) // P]).all())
        assert bool(torch.isneginf(bounds[0, r][:, (n - 1) // P + 1:]).all())


def test_summaries_follow_crop_retain_and_relayout():
    B, H, L, D = 2, 2, 60, 8
    keep = torch.rand(B, H, L, generator=torch.Generator().manual_seed(3)) < 0.5
    layer = _layer(B, H, D, keep, 8, appends=(1,) * 40)  # 40 appends: re-laid out more than once
    _assert_summaries_current(layer)
    layer.crop(-7)
    _assert_summaries_current(layer)
    held = layer.view()
    layer.retain(held.valid & (torch.rand(held.valid.shape) < 0.6), held)
    _assert_summaries_current(layer)
    summary_bytes = torch.finfo(torch.float16).bits // 8  # float32 keys: float16 summaries, rounded outward
    assert layer.nbytes() - layer.k_flat.nbytes - layer.v_flat.nbytes == (
        2 * layer.k_flat.shape[0] // 8 * D * summary_bytes + layer.pages.table.nbytes)


# ----------------------------------------------------------------------------- the read allocation


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), allocator=st.sampled_from(ALLOCATORS), budget=st.integers(8, 80),
       width=st.integers(1, 12))
def test_read_allocation_totals_and_floors(seed, allocator, budget, width):
    """Each batch row of a layer reads exactly ``min(H * ceil(budget / P), pages held)`` pages; every head reads its
    first and newest pages (its floor: both, or what it holds), at least ``alpha * its share`` when it holds that
    many (Ada's safeguard), never a page it does not hold."""
    name, fields = allocator
    P = 4
    reader = TopPages(budget=max(budget, 2 * P), page_size=P, allocator={"name": name, **fields})
    g = torch.Generator().manual_seed(seed)
    B, H, G = 3, 4, 2
    lengths = torch.randint(0, width * P + 1, (B, H), generator=g)
    bounds = torch.randn(B, H, G, width, generator=g) * torch.rand(B, H, 1, 1, generator=g) * 10
    exists, always = row_pages(lengths, P, width)
    bounds = bounds.masked_fill(~exists[:, :, None], float("-inf"))
    _, counts = reader.page_counts(bounds, lengths, layer_idx=0)
    selected = reader.select(bounds, lengths, layer_idx=0)
    held = exists.sum(-1)
    k = reader.pages_per_head
    assert torch.equal(counts.sum(-1), torch.minimum(torch.full((B,), H * k), held.sum(-1)))
    assert torch.equal(selected.sum(-1), counts)
    assert bool((selected <= exists).all()) and bool((always <= selected).all())
    assert bool((counts >= torch.minimum(held, torch.full_like(held, 2))).all())
    floor = int(fields.get("alpha", 1.0) * k)
    assert bool((counts >= torch.minimum(held, torch.full_like(held, floor))).all())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), allocator=st.sampled_from(ALLOCATORS), fraction=st.floats(0.05, 1.0),
       width=st.integers(1, 16))
def test_a_read_fraction_grows_the_budget_with_what_the_heads_hold(seed, allocator, fraction, width):
    """With ``fraction``, each batch row of a layer reads exactly ``min(H * max(ceil(budget / P), ceil(fraction *
    its heads' mean pages held)), pages held)`` pages, with the same floors; ``fraction=1`` reads every page held
    (the fused CPU kernel's selection with a fraction: tests/test_sparse_cpu.py)."""
    name, fields = allocator
    P = 4
    reader = TopPages(budget=2 * P, page_size=P, fraction=fraction, allocator={"name": name, **fields})
    g = torch.Generator().manual_seed(seed)
    B, H, G = 3, 4, 2
    lengths = torch.randint(0, width * P + 1, (B, H), generator=g)
    exists, always = row_pages(lengths, P, width)
    bounds = (torch.randn(B, H, G, width, generator=g) * 5).masked_fill(~exists[:, :, None], float("-inf"))
    _, counts = reader.page_counts(bounds, lengths, layer_idx=0)
    selected = reader.select(bounds, lengths, layer_idx=0)
    held = exists.sum(-1)
    per_head = torch.clamp(torch.ceil(held.double().mean(-1) * fraction).long(), min=reader.pages_per_head)
    assert torch.equal(counts.sum(-1), torch.minimum(H * per_head, held.sum(-1)))
    assert torch.equal(selected.sum(-1), counts) and bool((selected <= exists).all())
    assert bool((always <= selected).all())
    everything = reader.model_copy(update={"fraction": 1.0}).select(bounds, lengths, layer_idx=0)
    assert torch.equal(everything, exists)


def test_read_fraction_is_checked_and_round_trips():
    reader = TopPages(budget=32, page_size=16, fraction=0.25, allocator="ada")
    assert READERS.build(reader.model_dump()) == reader
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValidationError, match="fraction"):
            TopPages(fraction=bad)


def test_ada_reads_more_pages_of_the_peaked_heads():
    """Ada gives the read budget to the heads whose bounds are far apart (a few pages hold the attention); the
    uniform allocator reads the same number of pages in every head."""
    B, H, G, W, P = 1, 2, 1, 10, 4
    lengths = torch.full((B, H), W * P)
    bounds = torch.zeros(B, H, G, W)
    bounds[0, 0, 0, 2:8] = 20.0  # head 0: six pages far above the rest
    uniform = TopPages(budget=4 * P, page_size=P).page_counts(bounds, lengths, 0)[1]
    ada = TopPages(budget=4 * P, page_size=P, allocator=AdaHead(alpha=0.0)).page_counts(bounds, lengths, 0)[1]
    assert uniform.tolist() == [[4, 4]] and ada.sum() == 8 and ada[0, 0] > ada[0, 1] >= 2


# ----------------------------------------------------------------------------- attention over selected pages


def _masked_reference(q, layer, selected, scale, page_size, softcap=None, sinks=None):
    """Attention of each row's query group over its entries in the selected pages, one row at a time."""
    B, Hq, Q, D = q.shape
    R = layer.row_offsets.shape[0]
    G = Hq // (R // B)
    out = torch.zeros_like(q)
    for r, (keys, values) in enumerate(_entries(layer)):
        b, h = divmod(r, R // B)
        n = keys.shape[0]
        chosen = selected[r][torch.arange(n) // page_size]
        for i in range(Q):
            seen = chosen & (torch.arange(n) < n - (Q - 1 - i))
            logits = scale * q[b, h * G:(h + 1) * G, i] @ keys.T
            if softcap:
                logits = softcap * torch.tanh(logits / softcap)
            logits = logits.masked_fill(~seen, float("-inf"))
            if sinks is not None:
                logits = torch.cat([logits, sinks[h * G:(h + 1) * G, None]], -1)
            weights = torch.softmax(logits, -1).nan_to_num(0.0)[:, :n]
            out[b, h * G:(h + 1) * G, i] = weights @ values
    return out


@pytest.mark.parametrize("Q", [1, 3])
@pytest.mark.parametrize("extras", ["plain", "softcap", "sinks"])
def test_sparse_attention_is_attention_over_the_selected_entries(Q, extras):
    g = torch.Generator().manual_seed(5)
    B, H, G, L, D, P = 2, 3, 2, 90, 8, 8
    keep = torch.rand(B, H, L, generator=g) < 0.6
    layer = _layer(B, H, D, keep, P, appends=(2, 1))
    q = torch.randn(B, H * G, Q, D, generator=g)
    softcap = 4.0 if extras == "softcap" else None
    sinks = torch.randn(H * G, generator=g) if extras == "sinks" else None
    table = layer.pages.table
    selected = torch.rand(table.shape, generator=g) < 0.4
    got = sparse_ragged_attention(q, layer.k_flat, layer.v_flat, layer.row_offsets, layer.row_lengths, table,
                                  selected, P, 0.4, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(got, _masked_reference(q, layer, selected, 0.4, P, softcap, sinks), atol=1e-5,
                               rtol=1e-5)
    every = torch.ones_like(selected)
    dense = ragged_attention(q, layer.k_flat, layer.v_flat, layer.row_offsets, layer.row_lengths, 0.4,
                             softcap=softcap, sinks=sinks)
    torch.testing.assert_close(sparse_ragged_attention(q, layer.k_flat, layer.v_flat, layer.row_offsets,
                                                       layer.row_lengths, table, every, P, 0.4, softcap=softcap,
                                                       sinks=sinks), dense, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- through the model


def _generate(model, press, ids, mask=None, steps=16):
    with torch.inference_mode(), press(model):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1), output_cache(out)


def _ids(L=120, B=1, seed=0):
    return torch.randint(5, 100, (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("allocator", ["uniform", "ada"])
def test_read_budget_covering_the_kept_cache_is_dense_attention(llama, allocator, monkeypatch):
    """A read budget at or above what each row keeps reads every entry: the same logits and tokens as dense reads
    (exactly: the layer reads densely); with the selection forced (every page selected, read by pages) the same
    tokens and logits within float rounding."""
    ids, mask = left_padded_batch(lengths=(120, 95))
    base = Pipeline(scorer=SnapKV(window=8), allocator="ada", compression_ratio=0.5)
    press = base.replace(reader=TopPages(budget=512, allocator=allocator))
    tokens, logits, cache = _generate(llama, base, ids, mask)
    got_tokens, got_logits, got_cache = _generate(llama, press, ids, mask)
    assert torch.equal(got_tokens, tokens) and torch.equal(got_logits, logits)
    assert got_cache.layers[0].pages is not None and got_cache.nbytes() > cache.nbytes()
    monkeypatch.setattr(TopPages, "reads_every_page", lambda self, longest: False)
    paged_tokens, paged_logits, _ = _generate(llama, press, ids, mask)
    assert torch.equal(paged_tokens, tokens)
    torch.testing.assert_close(paged_logits, logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("evict", [{}, {"compression_ratio": 0.4}])
def test_sparse_reads_change_the_output_and_batch_rows_read_alone(llama, evict):
    """Under a read budget below what is kept the logits move (pages are skipped), and each row of a left-padded
    batch reads what it reads alone (Ada's read split is per batch row): the same tokens, logits within float
    rounding. (Uniform eviction here: Ada's memory split on this tiny model has near-ties that a batch of other
    lengths breaks otherwise, with or without a reader.)"""
    ids, mask = left_padded_batch(lengths=(150, 110))
    press = Pipeline(scorer=SnapKV(window=8), reader=TopPages(budget=32, page_size=8, allocator=AdaHead(alpha=0.2)),
                     **evict)
    tokens, logits, _ = _generate(llama, press, ids, mask)
    dense_logits = _generate(llama, press.replace(reader=TopPages(budget=4096)), ids, mask)[1]
    assert float((logits - dense_logits).abs().max()) > 1e-3
    for b in range(2):
        real = mask[b].bool()
        alone_tokens, alone_logits, _ = _generate(llama, press, ids[b:b + 1, real])
        assert torch.equal(alone_tokens[0], tokens[b])
        torch.testing.assert_close(alone_logits[0], logits[b], atol=1e-5, rtol=0)


def test_quest_preset_evicts_nothing_and_reads_pages(llama):
    press = preset("quest", reader=TopPages(budget=32))
    assert press.budget is None and press.compression_ratio is None and not press.is_noop
    ids = _ids(L=100)
    _, logits, cache = _generate(llama, press, ids, steps=6)
    assert all(cache.head_lengths(i).eq(100 + 5).all() for i in range(len(cache.layers)))
    dense = _generate(llama, press.replace(reader=TopPages(budget=4096)), ids, steps=6)[1]
    assert float((logits - dense).abs().max()) > 1e-4  # 32 of 105 entries read per head
    read = preset("ada_snapkv_read", compression_ratio=0.5)
    assert read.reader == TopPages(allocator=AdaHead(alpha=0.2)) and read.allocator == AdaHead(alpha=0.2)


def test_decode_compression_keeps_summaries_current(llama):
    """Decode compactions re-lay the layer out: the summaries are rebuilt there and kept by appends between; with a
    budget covering the cache, the tokens of dense reads."""
    press = Pipeline(scorer=SnapKV(window=4, kernel=3), allocator="ada", budget=40, decode_budget=36,
                     decode_interval=6, reader=TopPages(budget=16, page_size=8, allocator="ada"))
    ids = _ids(L=90, seed=2)
    _, _, cache = _generate(llama, press, ids, steps=20)
    assert min(cache.state.compactions) >= 2
    for layer in cache.layers:
        _assert_summaries_current(layer)
    wide = press.replace(reader=TopPages(budget=256, page_size=8))
    assert torch.equal(_generate(llama, wide, ids, steps=20)[0], _generate(llama, press.replace(reader=None), ids,
                                                                           steps=20)[0])


@pytest.mark.parametrize("mode", [dict(prefill_chunk=32, compression_ratio=0.5),
                                  dict(decode_budget=30, decode_interval=5),
                                  dict(compression_ratio=0.5, layers="pyramid")])
def test_every_mode_reads_pages(llama, mode):
    """Chunked prefill (chunks attend densely; each chunk's compaction rebuilds the summaries), decode-only
    compression, a layer schedule: a covering read budget gives the tokens of dense reads, and every layer's
    summaries are current after a small one."""
    ids = _ids(L=100, seed=7)
    base = Pipeline(scorer=SnapKV(window=4, kernel=3), **mode)
    dense = _generate(llama, base, ids, steps=12)[0]
    assert torch.equal(_generate(llama, base.replace(reader=TopPages(budget=512)), ids, steps=12)[0], dense)
    _, _, cache = _generate(llama, base.replace(reader=TopPages(budget=16, page_size=4, allocator="ada")), ids,
                            steps=12)
    for layer in cache.layers:
        _assert_summaries_current(layer)


def test_fanout_cache_reads_as_the_press(llama):
    """A fan-out cache (one dense prefill) reads as the press's own cache: the same greedy tokens; a batch of presses
    reading alike is the batch of their caches."""
    ids = _ids(L=110, seed=4)
    press = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.5, reader=TopPages(budget=32, page_size=8))
    own = _generate(llama, press, ids, steps=8)[0][0].tolist()
    prefill = capture_prefill(llama, ids)
    cache = prefill.compressed_cache(press)
    assert all(layer.pages is not None for layer in cache.layers)
    with press(llama):
        fanned, _ = decode_rows(llama, prefill.logits, cache, 8, set())
    assert fanned[0] == own
    other = press.replace(allocator="ada")
    batch = prefill.compressed_batch([press, other], [prefill.keep_masks(p) for p in (press, other)])
    with press(llama):
        rows, _ = decode_rows(llama, prefill.logits.expand(2, -1), batch, 8, set())
    assert rows[0] == own
    with pytest.raises(ValueError, match="one reader"):
        prefill.compressed_batch([press, press.replace(reader=None)], [prefill.keep_masks(press)] * 2)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "qwen3"])
def test_every_family_reads_pages(arch):
    """Soft-capped logits (Gemma-2), sinks (GPT-OSS) and hybrid sliding-window layers (their window read densely):
    a covering budget gives the tokens of dense reads, a small one runs."""
    model = build_model(arch)
    ids = _ids(L=80, seed=6)
    base = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.5)
    dense = _generate(model, base, ids, steps=8)[0]
    assert torch.equal(_generate(model, base.replace(reader=TopPages(budget=64)), ids, steps=8)[0], dense)
    _, _, cache = _generate(model, base.replace(reader=TopPages(budget=16, page_size=8)), ids, steps=8)
    assert any(getattr(layer, "pages", None) is not None for layer in cache.layers)


@pytest.mark.parametrize("storage", ["full", {"name": "int4", "group_size": 16, "residual": 4},
                                     {"name": "fp8", "residual": 0}])
def test_compiled_decode_reads_pages_without_graph_breaks(monkeypatch, storage):
    """The compiled decode step selects pages and attends over them in one graph: no graph break, the tokens of
    the eager steps; over records too (int4: appends deferred into the ring, their records and summaries written
    eagerly between steps; fp8 without a ring: quantized and folded into the summaries inside the step)."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.delenv(compiled.ENV_VAR, raising=False)
    model = build_model("llama", num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    press = Pipeline(scorer="snapkv", allocator="ada", compression_ratio=0.5, storage=storage,
                     reader=TopPages(budget=48, allocator="ada"))
    counters.clear()
    for seed, L in enumerate((90, 200)):
        ids = _ids(L=L, seed=seed)
        outs = []
        for compile in (False, True):
            with press(model, compile=compile):
                step = model.__dict__.get("forward")
                outs.append(model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False))
        assert isinstance(step, compiled.DecodeForward) and step.calls == 23
        assert torch.equal(outs[0], outs[1])
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


# ----------------------------------------------------------------------------- config and refusals


def test_reader_config_round_trips_and_registers():
    press = preset("ada_snapkv_read", compression_ratio=0.5)
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    assert "top_pages" in READERS.names()
    built = Pipeline(scorer="snapkv", reader={"name": "top_pages", "budget": 64, "allocator": "ada"})
    assert built.reader == TopPages(budget=64, allocator=AdaHead())
    assert TopPages(budget=40, page_size=16).pages_per_head == 3


@pytest.mark.parametrize("fields, match", [
    (dict(budget=20, page_size=16), "budget >= 32"),
    (dict(page_size=12), "power of two"),
    (dict(allocator=Threshold(tau=0.0)), "sets its own budget"),
])
def test_reader_refusals(fields, match):
    with pytest.raises(ValidationError, match=match):
        TopPages(**fields)


def test_pipeline_and_host_refusals(llama):
    reader = TopPages(budget=64)
    with pytest.raises(ValidationError, match="keeps the dense cache"):
        Pipeline(scorer="snapkv", compression_ratio=0.5, evictor=Mask(), reader=reader)
    assert Pipeline(scorer="snapkv", compression_ratio=0.5, storage="int4", reader=reader).reader == reader
    check_servable(Pipeline(scorer="snapkv", compression_ratio=0.5, reader=reader))
    check_servable(Pipeline(scorer="snapkv", compression_ratio=0.5, storage="int4", reader=reader))  # records too
    wide = Pipeline(scorer="snapkv", compression_ratio=0.5, reader=TopPages(budget=128, page_size=64))
    with pytest.raises(ValueError, match="row alignment"), wide(llama):
        llama(_ids(L=70), use_cache=True)
    press = Pipeline(scorer="snapkv", compression_ratio=0.5, reader=reader)
    with pytest.raises(ValueError, match="not of a PagedCache"), press(llama):
        llama(_ids(L=70), use_cache=True, past_key_values=PagedCache(llama.config))
    cache = RaggedCache(llama.config)
    cache.read_with(reader)
    assert all(layer.reader == reader for layer in cache.layers)



def test_tensor_parallel_refuses_a_reader(llama, monkeypatch):
    from kvpress_ada.hosts.transformers import checks

    monkeypatch.setattr(checks, "head_shard", lambda model: object())
    with pytest.raises(ValueError, match="tensor-parallel rank"):
        checks.check_press(Pipeline(scorer="snapkv", compression_ratio=0.5, reader=TopPages()), llama)


# ----------------------------------------------------------------------------- quantized storage (records)
RECORDS = {"int4": RecordLayout("int", 4, 16), "int8": RecordLayout("int", 8, 16), "fp8": RecordLayout("e4m3", 8, 0)}


def _records_layer(kind, residual, B, H, D, keep, page_size, seed=0, scale=1.0):
    """A compressed layer of ``kind`` records (``residual`` newest entries per row in full precision) under a
    reader of ``page_size`` pages."""
    g = torch.Generator().manual_seed(seed)
    layer = QuantizedRaggedLayer(replace(RECORDS[kind], residual=residual), decode_reserve=3)
    L = keep.shape[-1]
    layer.update(torch.randn(B, H, L, D, generator=g) * scale, torch.randn(B, H, L, D, generator=g))
    layer.read_with(TopPages(budget=2 * page_size, page_size=page_size))
    layer.compress(keep)
    return layer


def _read_back(layer):
    """Per row: the keys and values attention reads (anchor, records, residual ring), in row order."""
    held = layer.view()
    B, H = held.valid.shape[:2]
    return [(held.keys[b, h][held.valid[b, h]], held.values[b, h][held.valid[b, h]]) for b in range(B)
            for h in range(H)]


def _assert_bounds_cover(layer, q, scale, softcap=None):
    """Every query head's logit over every entry as it reads back now is at most its page's bound."""
    bounds = page_bounds(q, layer.pages.kmin, layer.pages.kmax, layer.pages.table, scale, softcap)
    B, H = bounds.shape[:2]
    G = q.shape[1] // H
    for r, (keys, _) in enumerate(_read_back(layer)):
        b, h = divmod(r, H)
        qg = q[b, h * G:(h + 1) * G, 0].float()
        logits = scale * qg @ keys.float().T
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        top = bounds[b, h][:, torch.arange(keys.shape[0]) // layer.pages.size]
        assert bool((logits <= top + 1e-5 * (scale * qg.abs() @ keys.float().abs().T) + 1e-6).all())


def _assert_summaries_cover(layer):
    """The summaries kept current by appends contain those rebuilt from what every slot may read back as (records
    pending in the ring written first: the rebuilt ones would read their slots' stale bytes)."""
    layer._record_pending()
    keys = layer._page_keys()
    kmin, kmax = page_summaries(keys[0], layer.row_offsets, layer.row_lengths, layer.pages.size)
    for more in keys[1:]:
        lo, hi = page_summaries(more, layer.row_offsets, layer.row_lengths, layer.pages.size)
        kmin, kmax = torch.minimum(kmin, lo), torch.maximum(kmax, hi)
    assert bool((layer.pages.kmin <= kmin).all()) and bool((layer.pages.kmax >= kmax).all())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(sorted(RECORDS)), residual=st.sampled_from([0, 2, 5]),
       page_size=st.sampled_from([1, 4, 8, 16]), appends=st.lists(st.integers(1, 7), max_size=6),
       scale=st.sampled_from([1e-2, 1.0, 20.0, 1e4]), softcap=st.sampled_from([None, 5.0]))
def test_page_bound_covers_every_logit_over_records(seed, kind, residual, page_size, appends, scale, softcap):
    """Over int4 / int8 / fp8 records the bound (float16 summaries, rounded outward; keys of scale 1e4 reach near
    float16's limit, where its steps are 32 wide) covers every logit over the keys as attention reads them (the
    anchor, the records, the residual ring), after compression, after every append (deferred into the ring or
    quantized at once, some re-laying the layer out), after the ring's records are written, a crop and a retain."""
    g = torch.Generator().manual_seed(seed)
    B, H, G, L, D = 2, 2, 2, 50, 16
    keep = torch.rand(B, H, L, generator=g) < torch.rand(B, H, 1, generator=g)
    layer = _records_layer(kind, residual, B, H, D, keep, page_size, seed, scale)
    q = torch.randn(B, H * G, 1, D, generator=g) * scale
    _assert_bounds_cover(layer, q, 0.3, softcap)
    for n in appends:
        layer.update(torch.randn(B, H, n, D, generator=g) * scale, torch.randn(B, H, n, D, generator=g))
        _assert_bounds_cover(layer, q, 0.3, softcap)
        _assert_summaries_cover(layer)
    _assert_bounds_cover(layer, q, 0.3, softcap)
    if appends:
        layer.crop(-1)
        _assert_bounds_cover(layer, q, 0.3, softcap)
    held = layer.view()
    layer.retain(held.valid & (torch.rand(held.valid.shape, generator=g) < 0.7), held)
    _assert_bounds_cover(layer, q, 0.3, softcap)
    _assert_summaries_cover(layer)


@pytest.mark.parametrize("kind", sorted(RECORDS))
@pytest.mark.parametrize("extras", ["plain", "softcap", "sinks"])
def test_sparse_attention_over_records_is_attention_over_the_selected_entries(kind, extras):
    """Over records, attention over the selected pages is the softmax over the selected entries as they read back
    (anchor, records, ring); with every page selected it is quantized attention."""
    g = torch.Generator().manual_seed(11)
    B, H, G, L, D, P = 2, 2, 2, 70, 16, 8
    layer = _records_layer(kind, 3, B, H, D, torch.rand(B, H, L, generator=g) < 0.6, P, seed=11)
    for n in (2, 1, 4):  # deferred appends, then one quantized at once
        layer.update(torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g))
    q = torch.randn(B, H * G, 1, D, generator=g)
    softcap = 4.0 if extras == "softcap" else None
    sinks = torch.randn(H * G, generator=g) if extras == "sinks" else None
    table = layer.pages.table
    selected = torch.rand(table.shape, generator=g) < 0.4
    args = (q, layer.k_flat, layer.v_flat, layer.row_offsets, layer.row_lengths, layer.side, table)
    got = sparse_quantized_attention(*args, selected, P, 0.4, layer.layout, softcap=softcap, sinks=sinks)
    want = torch.zeros_like(q)
    for r, (keys, values) in enumerate(_read_back(layer)):
        b, h = divmod(r, H)
        chosen = selected[r][torch.arange(keys.shape[0]) // P]
        logits = 0.4 * q[b, h * G:(h + 1) * G, 0] @ keys.T
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~chosen, float("-inf"))
        if sinks is not None:
            logits = torch.cat([logits, sinks[h * G:(h + 1) * G, None]], -1)
        want[b, h * G:(h + 1) * G, 0] = torch.softmax(logits, -1).nan_to_num(0.0)[:, :keys.shape[0]] @ values
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    dense = quantized_attention(q, layer.k_flat, layer.v_flat, layer.row_offsets, layer.row_lengths, layer.side, 0.4,
                                layer.layout, softcap=softcap, sinks=sinks)
    every = sparse_quantized_attention(*args, torch.ones_like(selected), P, 0.4, layer.layout, softcap=softcap,
                                       sinks=sinks)
    torch.testing.assert_close(every, dense, atol=2e-5, rtol=2e-5)
    raw = torch.ops.kvpress_ada.sparse_quantized_attention(*args, selected, P, 0.4, *_op_layout(layer.layout),
                                                           softcap or 0.0, sinks)
    torch.testing.assert_close(raw, got)


def _op_layout(layout):
    from kvpress_ada.kernels.quantized.ops import op_fields

    encoding, *fields = op_fields(layout)
    return encoding, [int(f) for f in fields]


@pytest.mark.parametrize("storage", ["int4", "int8"])
def test_records_read_budget_covering_the_kept_cache_is_dense_attention(llama, storage, monkeypatch):
    """With int4 / int8 storage a covering read budget gives exactly the tokens and logits of dense reads over the
    records; the selection forced (every page, read by pages) the same tokens; a small budget moves the logits and
    keeps the summaries covering every key as it reads back, through decode compression."""
    ids = _ids(L=110, seed=4)
    base = Pipeline(scorer=SnapKV(window=8), allocator="ada", compression_ratio=0.5,
                    storage={"name": storage, "group_size": 16, "residual": 4},
                    decode_budget=48, decode_interval=6)
    tokens, logits, _ = _generate(llama, base, ids, steps=14)
    press = base.replace(reader=TopPages(budget=512, allocator="ada"))
    got_tokens, got_logits, cache = _generate(llama, press, ids, steps=14)
    assert torch.equal(got_tokens, tokens) and torch.equal(got_logits, logits)
    assert isinstance(cache.layers[0], QuantizedRaggedLayer) and cache.layers[0].pages is not None
    small = base.replace(reader=TopPages(budget=8, page_size=4, allocator=AdaHead(alpha=0.2)))
    small_logits, cache = _generate(llama, small, ids, steps=14)[1:]
    assert float((small_logits - logits).abs().max()) > 1e-4
    for layer in cache.layers:
        _assert_summaries_cover(layer)
    monkeypatch.setattr(TopPages, "reads_every_page", lambda self, longest: False)
    paged_tokens, paged_logits, _ = _generate(llama, press, ids, steps=14)
    assert torch.equal(paged_tokens, tokens)
    torch.testing.assert_close(paged_logits, logits, atol=1e-4, rtol=0)
