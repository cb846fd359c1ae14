"""The fused CPU kernels of sparse reads (kvpress_ada/kernels/ragged/sparse_cpu_kernel.c) against the torch code:
attention over the selected pages (and an fp64 oracle), the Quest page bounds, the top-k with position ties; the
ops dispatch to them on CPU and turning them off gives the torch code exactly; no compiler is one warning."""

import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sparse_kernels import oracle, ragged_pages

from kvpress_ada import ranking
from kvpress_ada.kernels.quantized.cpu_kernel import MAX_QUERIES, use_cpu_kernel
from kvpress_ada.kernels.ragged import sparse
from kvpress_ada.kernels.ragged import sparse_cpu_kernel as fused

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
