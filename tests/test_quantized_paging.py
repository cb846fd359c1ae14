"""QuantizedPagePool (kvpress_ada.serving.record_pages) against the transformers host's quantized ragged layer fed
the same entries and keep masks: the same read-back (view), attention equal to ``quantized_attention_ref`` over the
layer's records, kept records moved byte for byte, and pages held (side tensors included) as the bytes counted;
under a reader, the layer's page summaries bit for bit, Quest's bound over every read-back key, and a decode step
over selected pages equal to the layer's sparse attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpress_ada.hosts.transformers.quantized_cache import QuantizedRaggedLayer
from kvpress_ada.kernels.quantized.scheme import RecordLayout, quantized_attention_ref
from kvpress_ada.kernels.ragged.sparse import page_bounds, sparse_quantized_attention_ref
from kvpress_ada.readers import TopPages
from kvpress_ada.serving.pages import PagedSequence, PoolExhausted
from kvpress_ada.serving.pools import page_pool, pool_reserve
from kvpress_ada.serving.record_pages import QuantizedPagePool
from kvpress_ada.storage import Fp8, Int4

B, H, G, L, D, S = 2, 2, 2, 40, 32, 8
CASES = [(RecordLayout("int", 4, 32, 4), torch.float32), (RecordLayout("int", 8, 32, 0), torch.float32),
         (RecordLayout("int", 4, 16, 4), torch.bfloat16), (RecordLayout("int", 4, 32, 32), torch.float32),
         (Fp8().layout, torch.float32), (Fp8(group_size=16, residual=4).layout, torch.bfloat16)]
# int4-r32: each row's side tensors span five pages (179 record slots of 42 a page)
IDS = pytest.mark.parametrize("layout,dtype", CASES,
                              ids=["int4-r4", "int8-r0", "int4-bf16", "int4-r32", "fp8", "fp8-g16-r4-bf16"])


def _pool(layout, dtype, pages=64):
    return QuantizedPagePool(torch.zeros(pages, 2 * S * D * dtype.itemsize, dtype=torch.uint8), S, D, dtype, layout)


def _packed(x):
    """``[B, H, Q, D]`` -> packed ``[B * Q, H, D]`` (sequence after sequence)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1])


def _both(layout, dtype, seed=0):
    """A pool and a ragged layer holding the same dense prefill, evicted with the same mask."""
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(B, H, L, D, generator=gen) + 2 * torch.randn(D, generator=gen)).to(dtype)
    values = torch.randn(B, H, L, D, generator=gen).to(dtype)
    keep = torch.rand(B, H, L, generator=gen) < torch.tensor([0.3, 0.8]).view(1, H, 1)
    keep[1, 0] = False  # a row keeping nothing
    layer = QuantizedRaggedLayer(layout)
    layer.update(keys, values)
    layer.retain(keep, layer.view())
    pool = _pool(layout, dtype)
    seqs = [PagedSequence(H) for _ in range(B)]
    pool.append(seqs, _packed(keys), _packed(values), torch.arange(L).repeat(B), [L] * B)
    assert torch.equal(pool.view(seqs)[0], keys)  # full precision until the first eviction
    pool.retain(seqs, keep)
    return pool, seqs, layer, gen


def _assert_same_view(pool, seqs, layer):
    keys, values, present, positions = pool.view(seqs)
    held = layer.view()
    W = min(keys.shape[2], held.keys.shape[2])
    assert torch.equal(present.sum(-1), held.valid.sum(-1))
    for mine, theirs in ((keys, held.keys), (values, held.values), (positions, held.positions)):
        assert torch.equal(mine[:, :, -W:][present[:, :, -W:]], theirs[:, :, -W:][held.valid[:, :, -W:]])


@IDS
def test_view_and_attention_equal_the_ragged_layer(layout, dtype):
    pool, seqs, layer, gen = _both(layout, dtype)
    _assert_same_view(pool, seqs, layer)
    for Q in (3, 1, 1, 6):  # appends (a row empty so far takes its first as anchor), the ring turning over
        k_new = torch.randn(B, H, Q, D, generator=gen).to(dtype)
        v_new = torch.randn(B, H, Q, D, generator=gen).to(dtype)
        start = layer.seen if hasattr(layer, "seen") else 0
        layer.update(k_new, v_new)
        table, lengths = pool.append(seqs, _packed(k_new), _packed(v_new), torch.arange(start, start + Q).repeat(B),
                                     [Q] * B)
        q = torch.randn(B, H * G, Q, D, generator=gen).to(dtype)
        expected = quantized_attention_ref(q, layer.k_flat, layer.v_flat, layer.row_offsets, layer.row_lengths,
                                           layer.side, D ** -0.5, layout)
        out = pool.attend(_packed(q), table, lengths, torch.arange(B + 1, dtype=torch.int32) * Q, D ** -0.5)
        # the same records and side tensors; the layer's rows lie apart (decode reserve), so float32 sums may run
        # in another order; a bf16 output is then at most one unit in its last place away
        torch.testing.assert_close(out, _packed(expected), rtol=1e-5 if dtype == torch.float32 else 2 ** -7, atol=1e-6)
        _assert_same_view(pool, seqs, layer)


@IDS
def test_retain_moves_records_unchanged_and_fixes_anchors_like_the_ragged_layer(layout, dtype):
    pool, seqs, layer, gen = _both(layout, dtype, seed=1)
    k_new, v_new = torch.randn(2, B, H, 5, D, generator=gen).to(dtype)
    layer.update(k_new, v_new)
    pool.append(seqs, _packed(k_new), _packed(v_new), torch.arange(L, L + 5).repeat(B), [5] * B)
    _, _, present, _ = pool.view(seqs)
    keep = present & (torch.rand(present.shape, generator=gen) < 0.6)
    keep[0] &= ~(present[0] & (torch.cumsum(present[0], -1) == 1))  # sequence 0 drops its anchors
    k_rec, v_rec, *_ = pool._ragged(seqs)
    kept = keep[present]  # ragged order
    held = layer.view()
    layer.retain(_align(keep, present, held.valid), held)
    pool.retain(seqs, keep)
    after_k, after_v, *_ = pool._ragged(seqs)
    assert torch.equal(after_k, k_rec[kept]) and torch.equal(after_v, v_rec[kept])  # byte for byte
    _assert_same_view(pool, seqs, layer)


def _align(keep, present, valid):
    """``keep`` over the pool's view, laid over the layer's view (both left-padded, possibly of other widths)."""
    out = torch.zeros_like(valid)
    out[valid] = keep[present]
    return out


@IDS
def test_pages_hold_records_and_side_tensors_and_return_on_release(layout, dtype):
    pool, seqs, _, _ = _both(layout, dtype, seed=2)
    per, side = pool.records_per_page, pool.side_slots
    assert per > S  # a page of records holds more entries than a full-precision page
    for seq in seqs:
        assert [len(p) for p in seq.pages] == [-(-(side + n) // per) for n in seq.lengths]
    held = sum(seq.pages_held for seq in seqs)
    assert pool.nbytes(seqs) == held * pool.pages.shape[1] and pool.free_pages == pool.capacity - held
    for seq in seqs:
        pool.release(seq)
    assert pool.free_pages == pool.capacity and not any(pool.compressed(seq) for seq in seqs)
    with pytest.raises(PoolExhausted):
        pool.append([PagedSequence(H)], torch.zeros(S * 65, H, D, dtype=dtype), torch.zeros(S * 65, H, D, dtype=dtype),
                     torch.arange(S * 65), [S * 65])
    assert pool.free_pages == pool.capacity


@IDS
def test_a_step_of_mixed_token_counts_equals_each_sequence_alone(layout, dtype):
    """Sequences with different token counts in one step (grouped by count, each group its own quantized op and
    its share of the step's side tensors) read back and attend as each appended alone."""
    together, seqs, _, gen = _both(layout, dtype, seed=3)
    alone, rows, _, _ = _both(layout, dtype, seed=3)
    seen = [L] * B
    for counts in ([1, 3], [0, 2], [5, 1], [1, 1]):
        T = sum(counts)
        k_new, v_new = torch.randn(2, T, H, D, generator=gen).to(dtype)
        q = torch.randn(T, H * G, D, generator=gen).to(dtype)
        positions = torch.cat([torch.arange(seen[n], seen[n] + c) for n, c in enumerate(counts)])
        starts = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
        table, lengths = together.append(seqs, k_new, v_new, positions, counts)
        out = together.attend(q, table, lengths, starts, D ** -0.5)
        for n, c in enumerate(counts):
            if c:
                part = slice(int(starts[n]), int(starts[n + 1]))
                table_n, lengths_n = alone.append([rows[n]], k_new[part], v_new[part], positions[part], [c])
                expected = alone.attend(q[part], table_n, lengths_n, torch.tensor([0, c], dtype=torch.int32),
                                        D ** -0.5)
                torch.testing.assert_close(out[part], expected, rtol=1e-5 if dtype == torch.float32 else 2 ** -7,
                                           atol=1e-6)
            seen[n] += c
        mine, theirs = together.view(seqs), alone.view(rows)
        for a, b in zip(mine[2:], theirs[2:]):  # present, positions
            assert torch.equal(a, b)
        for a, b in zip(mine[:2], theirs[:2]):  # keys are rotated back by a float32 matmul over all the rows read
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("storage", [Int4(group_size=16, residual=4), Fp8(), Fp8(group_size=16, residual=2)],
                         ids=["int4", "fp8", "fp8-g16"])
def test_the_storage_kind_builds_its_pool(storage):
    """``storage.page_pool`` over an engine's pages ``[P, 2, S, D]`` is a pool of the kind's records over the same
    bytes (what the vLLM host builds), which stores that kind and no other; a full-precision kind's is a plain
    pool, or the host's native one; ``pool_reserve`` is what the pool's geometry says."""
    from kvpress_ada.serving.pages import PagePool
    from kvpress_ada.storage import FullPrecision

    pages = torch.zeros(16, 2, S, D)
    pool = page_pool(storage, pages)
    assert isinstance(pool, QuantizedPagePool) and pool.layout == storage.layout
    assert pool.pages.data_ptr() == pages.data_ptr() and pool.stores(storage) and not pool.stores(FullPrecision())
    assert not pool.stores(Int4(group_size=16, residual=storage.layout.residual + 1))
    assert pool_reserve(storage, S, D, torch.float32) == QuantizedPagePool.reserve_pages(S, D, torch.float32,
                                                                                         storage.layout) >= 1
    full = page_pool(FullPrecision(), pages)
    assert type(full) is PagePool and full.stores(FullPrecision()) and not full.stores(storage)
    assert page_pool(FullPrecision(), pages, native=lambda p: ("native", p))[0] == "native"
    assert pool_reserve(FullPrecision(), S, D, torch.float32) == 0


# ----------------------------------------------------------------------------- a reader's pages (Quest summaries)
def _reading(layout, dtype, seed=0):
    """:func:`_both` under a reader of pages of ``S`` entries: the pool keeps its rows' summaries, the ragged layer
    its pages'."""
    pool, seqs, layer, gen = _both(layout, dtype, seed)
    layer.read_with(TopPages(budget=2 * S, page_size=S))
    pool.summarise()
    return pool, seqs, layer, gen


def _assert_same_summaries(pool, seqs, layer):
    """Page ``j`` of every row has the ragged layer's page ``j`` summaries, bit for bit; no page past its entries."""
    kmin, kmax = pool.summaries()
    table = pool.summary_pages(seqs, pool.table(seqs)[0])
    for r, n in enumerate(layer.row_lengths.tolist()):
        pages = -(-n // S)
        mine, theirs = table[r, :pages], layer.pages.table[r, :pages]
        assert bool((mine >= 0).all()) and bool((table[r, pages:] < 0).all())
        assert torch.equal(kmin[mine], layer.pages.kmin[theirs]) and torch.equal(kmax[mine], layer.pages.kmax[theirs])


@IDS
def test_row_summaries_are_the_ragged_layers_through_appends_and_compactions(layout, dtype):
    """Over the same entries, each compressed row's reader pages have the transformers host's quantized layer's
    summaries bit for bit: after the first eviction, after every append (single tokens the ring holds until their
    records are written in a batch, longer appends quantized at once, the layer's buffers growing), after a
    compaction; a released sequence's pages return to the identities."""
    pool, seqs, layer, gen = _reading(layout, dtype, seed=4)
    _assert_same_summaries(pool, seqs, layer)
    slots = layer.k_flat.shape[0]
    start = L
    for Q in (1, 1, 1, 1, 1, 3, 1, 1, 6, 1, 1, 1, 1, 1, 1, 1, 1):
        k_new, v_new = torch.randn(2, B, H, Q, D, generator=gen).to(dtype)
        layer.update(k_new, v_new)
        pool.append(seqs, _packed(k_new), _packed(v_new), torch.arange(start, start + Q).repeat(B), [Q] * B)
        start += Q
        _assert_same_summaries(pool, seqs, layer)
    assert layer.k_flat.shape[0] > slots  # the layer was laid out again as it grew
    _, _, present, _ = pool.view(seqs)
    keep = present & (torch.rand(present.shape, generator=gen) < 0.6)
    held = layer.view()
    layer.retain(_align(keep, present, held.valid), held)
    pool.retain(seqs, keep)
    _assert_same_summaries(pool, seqs, layer)
    summaries = pool.row_summaries
    ids = pool.summary_pages(seqs, pool.table(seqs)[0])
    ids = ids[ids >= 0]
    D_bytes = 2 * D * 2  # kmin and kmax in float16
    assert pool.nbytes(seqs) == sum(s.pages_held for s in seqs) * pool.pages.shape[1] + ids.numel() * D_bytes
    for seq in seqs:
        pool.release(seq)
    assert bool(torch.isposinf(summaries.kmin[ids].float()).all()) and bool(torch.isneginf(summaries.kmax[ids]).all())
    assert summaries.rows == {} and summaries.unrecorded == {}


def _assert_bounds_cover(pool, seqs, gen, scale=D ** -0.5):
    """Every query head's logit over every entry as it reads back now is at most its reader page's bound."""
    kmin, kmax = pool.summaries()
    table = pool.summary_pages(seqs, pool.table(seqs)[0])
    q = torch.randn(len(seqs), H * G, 1, D, generator=gen) * 3
    bounds = page_bounds(q, kmin, kmax, table, scale)  # [N, H, G, W]
    keys, _, present, _ = pool.view(seqs)
    for n in range(len(seqs)):
        for h in range(H):
            k = keys[n, h][present[n, h]].float()
            qg = q[n, h * G:(h + 1) * G, 0].float()
            logits = scale * qg @ k.T  # [G, entries]
            top = bounds[n, h][:, torch.arange(k.shape[0]) // S]
            assert bool((logits <= top + 1e-5 * (scale * qg.abs() @ k.abs().T) + 1e-6).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["int4", "int8", "fp8"]), residual=st.sampled_from([0, 2, 5]),
       appends=st.lists(st.integers(1, 7), max_size=6), scale=st.sampled_from([1e-2, 1.0, 30.0]))
def test_row_summaries_bound_every_read_back_key_through_appends_and_compactions(seed, kind, residual, appends,
                                                                                 scale):
    """Quest's bound over a row's reader page (from the pool's summaries) is at least every query's logit over every
    entry of the page as it reads back (record, anchor, residual ring), after the first eviction, after every
    append (entries leaving the ring then read from their records) and after a compaction."""
    layout = {"int4": RecordLayout("int", 4, 16, residual), "int8": RecordLayout("int", 8, 16, residual),
              "fp8": RecordLayout("e4m3", 8, 0, residual)}[kind]
    gen = torch.Generator().manual_seed(seed)
    pool = _pool(layout, torch.float32)
    pool.summarise()
    seqs = [PagedSequence(H) for _ in range(B)]
    keys = (torch.randn(B, H, L, D, generator=gen) + 2 * torch.randn(D, generator=gen)) * scale
    pool.append(seqs, _packed(keys), _packed(torch.randn(B, H, L, D, generator=gen)), torch.arange(L).repeat(B),
                [L] * B)
    pool.retain(seqs, torch.rand(B, H, L, generator=gen) < 0.5)
    _assert_bounds_cover(pool, seqs, gen)
    start = L
    for Q in appends:
        k_new = torch.randn(B * Q, H, D, generator=gen) * scale
        pool.append(seqs, k_new, torch.randn(B * Q, H, D, generator=gen), torch.arange(start, start + Q).repeat(B),
                    [Q] * B)
        start += Q
        _assert_bounds_cover(pool, seqs, gen)
    _, _, present, _ = pool.view(seqs)
    pool.retain(seqs, present & (torch.rand(present.shape, generator=gen) < 0.7))
    _assert_bounds_cover(pool, seqs, gen)


@IDS
def test_a_single_query_step_over_selected_pages_is_the_ragged_layers_sparse_attention(layout, dtype):
    """A decode step reading selected reader pages of one sequence (beside one read whole) attends as the ragged
    layer's ``sparse_quantized_attention`` over the same pages of the same records; every page selected, as dense
    quantized attention."""
    pool, seqs, layer, gen = _reading(layout, dtype, seed=5)
    scale = D ** -0.5
    start = L
    for step in range(6):
        k_new, v_new = torch.randn(2, B, H, 1, D, generator=gen).to(dtype)
        layer.update(k_new, v_new)
        table, lengths = pool.append(seqs, _packed(k_new), _packed(v_new), torch.tensor([start] * B), [1] * B)
        start += 1
        q = torch.randn(B, H * G, 1, D, generator=gen).to(dtype)
        pages = -(-lengths.long() // S)  # [B * H]
        W = layer.pages.table.shape[1]
        j = torch.arange(W)
        chosen = (torch.rand(B * H, W, generator=gen) < 0.4) | (j == 0) | (j == pages[:, None] - 1)
        if step == 5:
            chosen[:] = True  # every page: dense attention
        chosen &= j < pages[:, None]
        members = torch.tensor([0])
        width = pool.summary_pages([seqs[0]], table[:H]).shape[1]
        pool.read_selected(table, lengths, members, chosen[:H, :width].view(1, H, width))
        out = pool.attend(_packed(q), table, lengths, torch.arange(B + 1, dtype=torch.int32), scale)
        whole = torch.arange(B * H)[:, None] >= H  # sequence 1 reads every page
        expected = sparse_quantized_attention_ref(q, layer.k_flat, layer.v_flat, layer.row_offsets, layer.row_lengths,
                                                  layer.side, layer.pages.table, chosen | whole, S, scale, layout)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(out, _packed(expected), **tol)
        if step == 5:
            dense = quantized_attention_ref(q, layer.k_flat, layer.v_flat, layer.row_offsets, layer.row_lengths,
                                            layer.side, scale, layout)
            torch.testing.assert_close(out, _packed(dense), **tol)
