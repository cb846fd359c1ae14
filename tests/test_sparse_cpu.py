"""The fused CPU kernels of sparse reads (kvpress_ada/kernels/ragged/sparse_cpu_kernel.c) against the torch code:
attention over the selected pages (and an fp64 oracle), the Quest page bounds, the top-k with position ties, the pages
TopPages selects (uniform and Ada read budgets) and the appends of page summaries; the ops dispatch to them on CPU and
turning them off gives the torch code exactly; no compiler is one warning."""

import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sparse_kernels import oracle, ragged_pages

from kvpress_ada import AdaHead, kernels, ranking
from kvpress_ada.kernels.quantized.cpu_kernel import MAX_QUERIES, use_cpu_kernel
from kvpress_ada.kernels.ragged import sparse
from kvpress_ada.kernels.ragged import sparse_cpu_kernel as fused
from kvpress_ada.readers import TopPages, select_pages

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernels cannot be built")

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def test_kernels_build_where_a_compiler_is():
    assert fused.sparse_cpu_kernel()


def _case(dtype, D, page, B, H_kv, G, Q, lengths, seed, density, gap=float("nan")):
    g = torch.Generator().manual_seed(seed)
    k, v, offs, lens, table = ragged_pages(lengths, page, D, dtype, seed=seed, spare=1 + seed % 2, gap_value=gap)
    q = torch.randn(B, H_kv * G, Q, D, generator=g).to(dtype)
    selected = torch.rand(table.shape, generator=g) < density
    return q, k, v, offs, lens, table, selected, g


@settings(max_examples=120, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from([16, 24, 64, 128]),
       st.sampled_from([1, 4, 16]), st.integers(1, 2), st.sampled_from([1, 3]), st.integers(1, MAX_QUERIES),
       st.lists(st.integers(0, 70), min_size=4, max_size=4), st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       st.sampled_from(["plain", "softcap", "sinks", "both"]), st.integers(0, 999))
def test_attention_kernel_equals_the_reference_and_the_oracle(dtype, D, page, B, G, Q, lengths, density, extras,
                                                              seed):
    """Rows empty, ending mid-page, shorter than the queries; pages past a row's capacity, none or every page
    selected; GQA groups, 1-4 queries, head dims specialised (64, 128) and not; soft-cap and sinks; the unheld
    slots hold NaN (never read by the kernel)."""
    H_kv = 2
    q, k, v, offs, lens, table, selected, g = _case(dtype, D, page, B, H_kv, G, Q, lengths[:B * H_kv], seed,
                                                    density)
    softcap = 2.5 if extras in ("softcap", "both") else 0.0
    sinks = torch.randn(H_kv * G, generator=g) if extras in ("sinks", "both") else None
    got = fused.sparse_attention_cpu(q, k, v, lens, table, selected, page, 0.3, softcap, sinks)
    # the reference reads the padding of rows that read fewer pages than the longest list (zeros in the cache)
    ref = sparse.sparse_attention_ref(q, k.nan_to_num(0.0), v.nan_to_num(0.0), offs, lens, table, selected, page,
                                      0.3, softcap, sinks)
    want = oracle(q, k, v, offs, lens, table, selected, page, 0.3, softcap or None, sinks)
    assert got is not None and got.dtype == dtype and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    for r in range(B * H_kv):  # a row that reads nothing: exact zeros, sinks or not
        if not bool((selected[r] & (table[r] >= 0)).any()) or int(lens[r]) == 0:
            b, h = divmod(r, H_kv)
            assert bool((got[b, h * G:(h + 1) * G] == 0).all())


def _summaries(dtype, seed, huge):
    """Page summaries of a ragged layout with empty rows and spare pages (+inf / -inf), and with ``huge`` some keys
    past float16's range (summaries rounded out to +-inf: bounds of float32's extreme, +inf where terms of both
    signs overflow)."""
    g = torch.Generator().manual_seed(seed)
    k, _, offs, lens, table = ragged_pages([23, 0, 64, 5, 40, 17], 8, 32, torch.float32, seed=seed, spare=2)
    if huge:
        k[torch.rand(k.shape, generator=g) < 0.05] *= 1e5
    kmin, kmax = sparse.page_summaries(k.to(dtype), offs, lens, 8)
    q = torch.randn(2, 6, 1, 32, generator=g)
    q[0, 0, 0, :4] = 0.0  # channels of zero against infinite summaries: no 0 * inf
    return q, kmin, kmax, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bounds_kernel_equals_the_torch_bounds(dtype, huge, softcap, seed):
    q, kmin, kmax, table = _summaries(dtype, seed, huge)
    got = fused.page_bounds_cpu(q, kmin, kmax, table, 0.3, softcap)
    with use_cpu_kernel(False):
        want = sparse.page_bounds(q, kmin, kmax, table, 0.3, softcap)
    assert got is not None and got.shape == want.shape and got.dtype == torch.float32
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite], want[~finite])  # same +-inf
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-5)
    float32_summaries = kmin.float(), kmax.float()  # the kernel reads float32 summaries too
    torch.testing.assert_close(fused.page_bounds_cpu(q, *float32_summaries, table, 0.3, softcap), got, atol=1e-5,
                               rtol=1e-5, equal_nan=True)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([torch.float32, torch.float64]), st.integers(1, 3), st.integers(1, 40),
       st.sampled_from(["integers", "near_ties", "normal", "infinite"]), st.booleans(), st.integers(0, 10_000))
def test_top_k_kernel_selects_what_the_torch_top_k_selects(dtype, rows, n, kind, recent_first, seed):
    """Exact ties, ties within the relative tolerance and just outside it (``|kth| * TIE_RTOL`` and ``kth + tol``
    in the scores' dtype), infinities, k from below 0 to above n: the same entries, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, n), generator=g).to(dtype)
    if kind == "near_ties":
        x = 1.0 + x * ranking.TIE_RTOL * torch.tensor(0.5).to(dtype)  # steps of half the tolerance
    elif kind == "normal":
        x = torch.randn(rows, n, generator=g, dtype=dtype)
    elif kind == "infinite":
        x[torch.rand(rows, n, generator=g) < 0.3] = float("inf")
        x[torch.rand(rows, n, generator=g) < 0.3] = float("-inf")
    k = torch.randint(-1, n + 2, (rows,), generator=g)
    got = fused.top_k_cpu(x, k, recent_first, ranking.TIE_RTOL)
    with use_cpu_kernel(False):
        want = ranking.top_k(x, k, recent_first)
    assert got is not None and torch.equal(got, want)
    assert torch.equal(got.sum(-1), k.clamp(0, n))  # exactly k entries


@pytest.mark.parametrize("kernel", [True, False])
def test_top_k_keeps_a_score_just_beyond_the_tie_tolerance(kernel):
    """kth + tol may round past a score more than tol above kth (float32: 4.003499 + 4.0e-5 rounds up to
    4.003539): that score is above the k-th best, not tied with it, and is kept (both paths keep exactly k)."""
    s = torch.tensor([[4.003539085388184, 4.0034990310668945, 0.0]], dtype=torch.float32)
    kth, tol = s[0, 1], s[0, 1].abs() * ranking.TIE_RTOL
    assert (s[0, 0] - kth) > tol and not (s[0, 0] > kth + tol)  # the rounding this case is made of
    with use_cpu_kernel(kernel):
        got = ranking.top_k(s, torch.tensor([2]), recent_first=True)
    assert got.tolist() == [[True, True, False]]


def test_top_k_leaves_nan_and_other_dtypes_to_torch():
    x = torch.tensor([[1.0, float("nan"), 2.0]])
    assert fused.top_k_cpu(x, torch.tensor([1]), True, ranking.TIE_RTOL) is None
    assert fused.top_k_cpu(x.half(), torch.tensor([1]), True, ranking.TIE_RTOL) is None
    with use_cpu_kernel(False):
        want = ranking.top_k(x, torch.tensor([1]), True)
    assert torch.equal(ranking.top_k(x, torch.tensor([1]), True), want)


def _op_case(Q=1):
    q, k, v, offs, lens, table, selected, _ = _case(torch.float32, 64, 16, 2, 3, 3, Q, [50, 0, 200, 17, 96, 33], 5,
                                                    0.4, gap=0.0)  # free slots hold zeros, as in the cache
    return q, k, v, offs, lens, table, selected


def test_the_ops_run_the_kernels_on_cpu(monkeypatch):
    """The custom op (eager and raw) and page_bounds run the kernels; turned off, they give the torch code bit for
    bit; more queries than the kernel takes go to the reference."""
    q, k, v, offs, lens, table, selected = _op_case()
    ref = sparse.sparse_attention_ref(q, k, v, offs, lens, table, selected, 16, 0.2)

    def refused(*args, **kwargs):
        raise AssertionError("the torch reference ran")

    monkeypatch.setattr(sparse, "sparse_attention_ref", refused)
    got = sparse.sparse_ragged_attention(q, k, v, offs, lens, table, selected, 16, 0.2)
    raw = torch.ops.kvpress_ada.sparse_ragged_attention(q, k, v, offs, lens, table, selected, 16, 0.2)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(raw, got)
    monkeypatch.undo()
    with use_cpu_kernel(False):
        assert fused.sparse_attention_cpu(q, k, v, lens, table, selected, 16, 0.2) is None
        assert fused.page_bounds_cpu(q, k[:8], k[:8], table, 0.2) is None
        assert torch.equal(sparse.sparse_ragged_attention(q, k, v, offs, lens, table, selected, 16, 0.2), ref)
    long = _op_case(MAX_QUERIES + 1)
    assert fused.sparse_attention_cpu(*long[:3], *long[4:], 16, 0.2) is None
    torch.testing.assert_close(sparse.sparse_ragged_attention(*long, 16, 0.2),
                               sparse.sparse_attention_ref(*long, 16, 0.2))


@pytest.mark.parametrize("value", ["0", "off"])
def test_variable_turns_the_kernels_off(monkeypatch, value):
    monkeypatch.setenv("KVPRESS_ADA_CPU_KERNEL", value)
    q, k, v, offs, lens, table, selected = _op_case()
    assert not fused.sparse_cpu_kernel()
    assert fused.sparse_attention_cpu(q, k, v, lens, table, selected, 16, 0.2) is None
    assert torch.equal(sparse.sparse_ragged_attention(q, k, v, offs, lens, table, selected, 16, 0.2),
                       sparse.sparse_attention_ref(q, k, v, offs, lens, table, selected, 16, 0.2))


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """A build into an empty cache directory; the process's kernels are looked up again afterwards."""
    monkeypatch.setenv("KVPRESS_ADA_CACHE", str(tmp_path))
    fused._library.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    fused._library.cache_clear()


def test_no_compiler_is_one_warning_and_the_torch_code(fresh_library, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-kvpress")
    with pytest.warns(RuntimeWarning, match="sparse reads is unavailable .no C compiler.*torch reference runs"):
        assert not fused.sparse_cpu_kernel()
    q, k, v, offs, lens, table, selected = _op_case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert fused.sparse_attention_cpu(q, k, v, lens, table, selected, 16, 0.2) is None
        got = sparse.sparse_ragged_attention(q, k, v, offs, lens, table, selected, 16, 0.2)
        picked = ranking.top_k(torch.tensor([[3.0, 1.0, 2.0]]), torch.tensor([2]), True)
    assert torch.equal(got, sparse.sparse_attention_ref(q, k, v, offs, lens, table, selected, 16, 0.2))
    assert picked.tolist() == [[True, False, True]]
    assert not any(fresh_library.iterdir())  # nothing built


# ----------------------------------------------------------------------------------------------- page selection
def _selection_case(dtype, P, B, H, G, lengths, seed):
    """A ragged layout of ``B * H`` rows of ``lengths`` (empty, within one page, ending mid-page), its summaries in
    the cache's dtype (float16 rounded outward over float32 keys) and decode queries ``[B, H * G, 1, 32]``; keys and
    queries drawn with a per-row, per-channel shift so that pages and heads differ."""
    g = torch.Generator().manual_seed(seed)
    k, v, offs, lens, table = ragged_pages(lengths, P, 32, torch.float32, seed=seed, spare=1 + seed % 2)
    k = (k * torch.rand(k.shape[0], 1, generator=g) * 3).to(dtype)
    kmin, kmax = sparse.page_summaries(k, offs, lens, P)
    q = (torch.randn(B, H * G, 1, 32, generator=g) * 2).to(dtype)
    return q, k, v.to(dtype), offs, lens, table, kmin, kmax


def _torch_selection(reader, q, kmin, kmax, table, lens, scale, softcap):
    """TopPages' torch code (shares, allocation, fit, top-k) over the kernel's bounds (equal to the torch bounds to
    float rounding: test_bounds_kernel_equals_the_torch_bounds; near-tied pages are common, soft-capped bounds
    saturate, so the oracle takes the same bounds)."""
    bounds = fused.page_bounds_cpu(q, kmin, kmax, table, scale, softcap)
    with use_cpu_kernel(False):
        return reader.select(bounds, lens.view(q.shape[0], -1), 0)


READ_ALLOCATORS = ["uniform", AdaHead(alpha=0.2), AdaHead(alpha=0.0), AdaHead(alpha=0.5), AdaHead(alpha=1.0)]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from([1, 4, 16]),
       st.integers(1, 2), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 3]), st.integers(2, 6),
       st.lists(st.integers(0, 90), min_size=16, max_size=16), st.sampled_from(READ_ALLOCATORS),
       st.sampled_from([None, 3.0]), st.sampled_from([None, 0.3, 0.5, 1.0]), st.integers(0, 9_999))
def test_select_kernel_selects_what_the_torch_reader_selects(dtype, P, B, H, G, pages, lengths, allocator, softcap,
                                                             fraction, seed):
    """Every allocation path: uniform and Ada budgets (alpha 0, 0.2, 0.5: remainders tied, 1), a budget growing with
    the pages held (``fraction``), heads holding fewer pages than their count (their excess to the other heads' best
    pages), empty rows, first and newest pages forced, GQA groups, soft-cap (bounds saturate: near ties); the C
    kernel's selection is the torch code's, page for page, and each batch row reads its budget of held pages."""
    q, _, _, offs, lens, table, kmin, kmax = _selection_case(dtype, P, B, H, G, lengths[:B * H], seed)
    reader = TopPages(budget=pages * P, page_size=P, fraction=fraction, allocator=allocator)
    got = reader.select_fused(q, kmin, kmax, table, lens, 0.3, 0, softcap)
    want = _torch_selection(reader, q, kmin, kmax, table, lens, 0.3, softcap)
    assert got is not None and got.dtype == torch.bool and got.shape == (B, H, table.shape[1])
    assert torch.equal(got, want)
    held = (lens.long() + P - 1) // P
    read = got.view(B * H, -1)
    assert bool((read.sum(-1) <= held).all())  # held pages only
    first, newest = read[held > 0, 0], read[held > 0].gather(1, (held[held > 0] - 1)[:, None])
    assert bool(first.all()) and bool(newest.all())  # the sinks' page and the newest, always
    per_head = torch.full((B,), reader.pages_per_head)
    if fraction is not None:
        per_head = torch.maximum(per_head, torch.ceil(held.view(B, H).double().mean(-1) * fraction).long())
    per_batch = torch.minimum(held.view(B, H).sum(-1), H * per_head)
    assert torch.equal(got.sum((-1, -2)), per_batch)  # each batch row reads its budget, or all it holds


@pytest.mark.parametrize("allocator", READ_ALLOCATORS[:2])
def test_select_kernel_batch_row_is_the_row_alone(allocator):
    B, H, P = 3, 2, 4
    q, _, _, offs, lens, table, kmin, kmax = _selection_case(torch.float32, P, B, H, 3, [70, 9, 0, 50, 33, 33], 7)
    reader = TopPages(budget=3 * P, page_size=P, allocator=allocator)
    batch = reader.select_fused(q, kmin, kmax, table, lens, 0.3, 0)
    assert batch is not None
    for b in range(B):
        rows = slice(b * H, (b + 1) * H)
        alone = reader.select_fused(q[b:b + 1], kmin, kmax, table[rows], lens[rows], 0.3, 0)
        assert alone is not None and torch.equal(alone[0], batch[b])


@pytest.mark.parametrize("allocator", READ_ALLOCATORS[:2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_kernel_with_a_covering_budget_reads_every_held_page_as_dense_attention(allocator, dtype):
    """A budget at or above every row's pages selects exactly the pages holding entries; attention over them is
    ragged attention over every kept entry (to float rounding: the same sums in another order)."""
    B, H, G, P = 2, 2, 3, 4
    q, k, v, offs, lens, table, kmin, kmax = _selection_case(dtype, P, B, H, G, [37, 0, 64, 5], 3)
    reader = TopPages(budget=16 * P, page_size=P, allocator=allocator)
    got = reader.select_fused(q, kmin, kmax, table, lens, 0.25, 0)
    held = torch.arange(table.shape[1]) < ((lens.long() + P - 1) // P)[:, None]
    assert got is not None and torch.equal(got.view(B * H, -1), held)
    sparse_out = sparse.sparse_ragged_attention(q, k, v, offs, lens, table, got.view(B * H, -1), P, 0.25)
    dense_out = kernels.ragged_attention(q, k, v, offs, lens, 0.25)
    torch.testing.assert_close(sparse_out.float(), dense_out.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_select_kernel_leaves_nan_scores_and_other_allocators_to_torch(monkeypatch):
    """Bounds of +inf (summaries past float16's range in channels of both signs) make torch's softmax shares NaN: the
    kernel decides nothing and select_pages gives the torch selection; an allocator other than uniform / Ada (here a
    subclass) is not served; the dispatch runs the kernel otherwise (the torch select is never called)."""
    q, _, _, offs, lens, table, kmin, kmax = _selection_case(torch.float32, 4, 1, 2, 1, [40, 30], 2)
    kmax[1, :] = float("inf")
    kmin[1, :] = float("-inf")  # page 1 of row 0: +inf bounds for every query
    reader = TopPages(budget=8, page_size=4, allocator="ada")
    bounds = sparse.page_bounds(q, kmin, kmax, table, 0.3)
    scores, _ = reader.page_counts(bounds, lens.view(1, -1), 0)
    assert bool(scores.isnan().any())
    assert reader.select_fused(q, kmin, kmax, table, lens, 0.3, 0) is None
    assert torch.equal(select_pages(reader, q, kmin, kmax, table, lens, 0.3, 0),
                       _torch_selection(reader, q, kmin, kmax, table, lens, 0.3, None))

    class Halved(AdaHead):
        pass

    assert TopPages(budget=8, page_size=4, allocator=Halved()).select_fused(q, kmin, kmax, table, lens, 0.3, 0) is None
    q, _, _, offs, lens, table, kmin, kmax = _selection_case(torch.float32, 4, 1, 2, 1, [40, 30], 3)

    def refused(*args, **kwargs):
        raise AssertionError("the torch selection ran")

    monkeypatch.setattr(TopPages, "select", refused)
    got = select_pages(reader, q, kmin, kmax, table, lens, 0.3, 0)
    monkeypatch.undo()
    assert torch.equal(got, _torch_selection(reader, q, kmin, kmax, table, lens, 0.3, None))


# ---------------------------------------------------------------------------------------------- summary appends
def _edge_floats():
    """float32 values at float16's edges: zeros, subnormals of both, halfway points (ties to even), the largest
    finite and the overflow threshold, infinities, NaN, and random bit patterns over the whole range."""
    h = torch.arange(0, 0x7C01, 37, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    mids = (h[:-1].double() + h[1:].double()) / 2  # halfway between neighbours (ties), and just beside them
    near = torch.cat([mids.float(), torch.nextafter(mids.float(), torch.tensor(0.0)),
                      torch.nextafter(mids.float(), torch.tensor(float("inf")))])
    special = torch.tensor([0.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 65504.0, 65519.99, 65520.0, 1e-40,
                            float("inf"), float("nan"), 1e30, 2.0**-150 * 3, 6.0e-8, 5.96e-8])
    bits = torch.randint(-2**31, 2**31 - 1, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    randoms = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([h, near, special, randoms])
    return torch.cat([x, -x])


def _same_halves(got, want):
    """Equal 16-bit summaries: the same NaN places, the same bits elsewhere."""
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16))


def test_append_kernel_rounds_float32_outward_as_torch_does():
    """Each float32 key alone on its page: the page's kmin, kmax are the key rounded down and up to float16, bit for
    bit as ``round_outward`` (ties to even, subnormals, overflow to inf, NaN kept)."""
    x = _edge_floats()
    D = 64
    x = torch.cat([x, x.new_zeros(-x.numel() % D)]).view(-1, 1, 1, D)  # one key per row, one row per page
    R = x.shape[0]
    offs = torch.arange(R, dtype=torch.int32)
    lens = torch.ones(R, dtype=torch.int32)
    kmin = torch.full((R, D), float("inf"), dtype=torch.float16)
    kmax = -kmin
    assert fused.append_summaries_cpu(x.view(R, 1, 1, D), kmin, kmax, offs, lens, 1)
    flat = x.view(R, D)
    _same_halves(kmin, sparse.round_outward(flat, torch.float16, up=False))
    _same_halves(kmax, sparse.round_outward(flat, torch.float16, up=True))


@settings(max_examples=120, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from([1, 4, 16]),
       st.integers(1, 4), st.lists(st.integers(0, 60), min_size=6, max_size=6), st.booleans(), st.integers(0, 9_999))
def test_append_kernel_equals_the_torch_append(dtype, P, Q, lengths, huge, seed):
    """Q keys appended to every row (pages part-filled, new pages, rows that were empty) folded into summaries
    holding earlier keys: the same bits as the two scatter_reduce of the torch code, keys past float16's range too."""
    g = torch.Generator().manual_seed(seed)
    total = [n + Q for n in lengths]
    k, _, offs, lens, _ = ragged_pages(total, P, 24, torch.float32, seed=seed, spare=1)
    if huge:
        k[torch.rand(k.shape, generator=g) < 0.1] *= 1e5
    k = k.to(dtype)
    before = torch.tensor(lengths, dtype=torch.int32)
    kmin, kmax = sparse.page_summaries(k, offs, before, P)  # the summaries before the append
    slots = offs.long()[:, None] + before.long()[:, None] + torch.arange(Q)
    new = k[slots].view(2, 3, Q, 24)
    got_min, got_max, want_min, want_max = kmin.clone(), kmax.clone(), kmin.clone(), kmax.clone()
    assert fused.append_summaries_cpu(new, got_min, got_max, offs, lens, P)
    sparse._append_ref(new, want_min, want_max, offs, lens, P)
    _same_halves(got_min, want_min)
    _same_halves(got_max, want_max)
    full_min, full_max = sparse.page_summaries(k, offs, lens, P)  # and they are the summaries of the whole rows
    _same_halves(got_min, full_min)
    _same_halves(got_max, full_max)


def test_append_dispatches_to_the_kernel_on_cpu(monkeypatch):
    k, _, offs, lens, _ = ragged_pages([9, 17], 4, 16, torch.float32, seed=1)
    before = lens - 1
    kmin, kmax = sparse.page_summaries(k, offs, before, 4)
    new = k[(offs + before).long()].view(1, 2, 1, 16)

    def refused(*args, **kwargs):
        raise AssertionError("the torch append ran")

    monkeypatch.setattr(sparse, "_append_ref", refused)
    got = kmin.clone(), kmax.clone()
    sparse.append_summaries(new, *got, offs, lens, 4)
    torch.ops.kvpress_ada.append_page_summaries(new, kmin, kmax, offs, lens, 4)  # the raw op (compiled steps)
    monkeypatch.undo()
    assert torch.equal(got[0], kmin) and torch.equal(got[1], kmax)
    with use_cpu_kernel(False):
        assert not fused.append_summaries_cpu(new, kmin, kmax, offs, lens, 4)
    assert not fused.append_summaries_cpu(new, kmin.float(), kmax.float(), offs, lens, 4)  # float32 summaries: torch
    assert not fused.append_summaries_cpu(new, kmin, kmax, offs.long(), lens.long(), 4)  # int64 offsets: torch
