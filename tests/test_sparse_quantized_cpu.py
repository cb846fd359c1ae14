"""The fused CPU kernel of attention over the selected pages of quantized records (kvq_sparse_attention in
kvpress_ada/kernels/quantized/cpu_kernel.c) against the torch reference (sparse_quantized_attention_ref), an fp64
oracle over what the records read back as and the dense quantized kernel; the op dispatches to it on CPU and turning
it off gives the torch reference exactly."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quantized_kernels import _read_back, _records
from test_sparse_kernels import oracle, ragged_pages

from kvpress_ada.kernels.quantized import cpu_kernel as quantized_cpu
from kvpress_ada.kernels.quantized import scheme as qz
from kvpress_ada.kernels.quantized.cpu_kernel import MAX_QUERIES, use_cpu_kernel
from kvpress_ada.kernels.ragged import sparse

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernel cannot be built")

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SELECTIONS = ["random", "every", "ends", "none"]


def _layout(encoding, D, group, residual, scale_bits=0):
    if encoding == "e4m3":
        return qz.RecordLayout("e4m3", 8, group, residual, rotate_keys=False)
    return qz.RecordLayout("int", int(encoding[3:]), group or D, residual, scale_bits=scale_bits)


def _case(dtype, encoding, D, group, P, B, H_kv, G, Q, lengths, residual, selection, seed, scale_bits=0):
    """Quantized rows of ``lengths`` in pages of ``P`` (each row from a page boundary, spare pages after it: table
    entries of -1 past the last row's), their side tensors (anchor, centre, a ring of ``residual``), decode queries and
    a selection: ``random`` pages, ``every`` page, the ``ends`` (first and newest held page), or ``none``."""
    g = torch.Generator().manual_seed(seed + 1)  # not ragged_pages' draws: a query equal to a row's first key
    k, v, offs, lens, table = ragged_pages(lengths, P, D, torch.float32, seed=seed, spare=1 + seed % 2)
    k = (k * 2 + torch.linspace(-3, 5, D)).to(dtype)  # an offset per channel: a centre far from 0
    v = v.to(dtype)
    layout = _layout(encoding, D, group, residual, scale_bits)
    k_rec, v_rec, side, centres = _records(k, v, offs, lens, layout, residual)
    q = torch.randn(B, H_kv * G, Q, D, generator=g).to(dtype)
    if selection == "random":
        selected = torch.rand(table.shape, generator=g) < 0.4
    elif selection == "every":
        selected = torch.ones(table.shape, dtype=torch.bool)
    elif selection == "ends":
        held = (lens.long() + P - 1) // P
        j = torch.arange(table.shape[1])
        selected = (j == 0) | (j == (held - 1).clamp(min=0)[:, None])
    else:
        selected = torch.zeros(table.shape, dtype=torch.bool)
    return q, k_rec, v_rec, offs, lens, side, table, selected, layout, centres


def _extras(kind, H_q, seed):
    softcap = 2.5 if kind in ("softcap", "both") else 0.0
    sinks = (torch.randn(H_q, generator=torch.Generator().manual_seed(seed)) * 2 + 1) \
        if kind in ("sinks", "both") else None
    return softcap, sinks


def assert_blind_queries_zero(got, lens, table, selected, P):
    """A row that reads nothing, or a query that sees none of the entries read (``got [B, H_q, Q, D]``, queries
    bottom-right causal over rows of ``lens``): exact zeros."""
    B, H_q, Q, _ = got.shape
    H_kv = lens.shape[0] // B
    G = H_q // H_kv
    for r in range(B * H_kv):
        b, h = divmod(r, H_kv)
        n = int(lens[r])
        read = ((selected[r] & (table[r] >= 0))[torch.arange(n) // P]).nonzero()
        first = int(read.min()) if read.numel() else n  # the oldest entry read
        for i in range(Q):
            if first >= n - (Q - 1 - i):
                assert bool((got[b, h * G:(h + 1) * G, i] == 0).all())


def _poisoned(k_rec, v_rec, offs, lens, selected, P):
    """Copies of the records with every slot the kernel must not read (past a row's length, in a page not selected,
    in no row) set to 0xff bytes: NaN scales, so that a read of one shows in the output. (The reference reads the
    padding of rows that read fewer pages than the longest list, times 0: it takes the records as they are.)"""
    read = torch.zeros(k_rec.shape[0], dtype=torch.bool)
    for r, (o, n) in enumerate(zip(offs.tolist(), lens.tolist())):
        read[o:o + n] = selected[r][torch.arange(n) // P]
    return k_rec.masked_fill(~read[:, None], 0xFF), v_rec.masked_fill(~read[:, None], 0xFF)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.sampled_from(["int4", "int8", "e4m3"]),
       st.sampled_from([(32, 16), (64, 32), (64, 0), (128, 32), (48, 24)]), st.sampled_from([1, 4, 16]),
       st.integers(1, 2), st.sampled_from([1, 3]), st.integers(1, MAX_QUERIES),
       st.lists(st.integers(0, 70), min_size=4, max_size=4), st.sampled_from([0, 1, 5]),
       st.sampled_from(SELECTIONS), st.sampled_from(["plain", "softcap", "sinks", "both"]), st.integers(0, 999),
       st.sampled_from([0, 16]))
def test_kernel_equals_the_reference_and_the_oracle(dtype, encoding, dims, P, B, G, Q, lengths, residual, selection,
                                                    extras, seed, scale_bits):
    """Every encoding, specialised shapes (64 / 128 with groups of 32, e4m3 with one scale per head) and generic ones;
    rows empty, ending mid-page, shorter than the queries or the ring; pages past a row's capacity; GQA groups, 1-4
    queries; soft-cap and sinks; selections random, of every page, of the first and newest only, of none."""
    D, group = dims
    H_kv = 2
    q, k_rec, v_rec, offs, lens, side, table, selected, layout, centres = _case(
        dtype, encoding, D, group, P, B, H_kv, G, Q, lengths[:B * H_kv], residual, selection, seed, scale_bits)
    softcap, sinks = _extras(extras, H_kv * G, seed)
    got = quantized_cpu.sparse_quantized_attention_cpu(q, *_poisoned(k_rec, v_rec, offs, lens, selected, P), lens, side,
                                                       table, selected, P, D ** -0.5, layout, softcap, sinks)
    ref = sparse.sparse_quantized_attention_ref(q, k_rec, v_rec, offs, lens, side, table, selected, P, D ** -0.5,
                                                layout, softcap, sinks)
    deq_k, deq_v = _read_back(k_rec, v_rec, side, centres, offs, lens, layout, dtype)
    want = oracle(q, deq_k, deq_v, offs, lens, table, selected, P, D ** -0.5, softcap or None, sinks)
    assert got is not None and got.dtype == dtype and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    if selection == "every":  # every held page: the dense quantized kernel's attention
        dense = quantized_cpu.quantized_attention_cpu(q, k_rec, v_rec, offs, lens, side, D ** -0.5, layout,
                                                      softcap=softcap, sinks=sinks)
        torch.testing.assert_close(got.float(), dense.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert_blind_queries_zero(got, lens, table, selected, P)


@pytest.mark.parametrize("encoding", ["int4", "int8", "e4m3"])
def test_batch_row_is_the_row_alone(encoding):
    """Each batch row's output depends on its own rows only: computed alone (its queries, lengths, side tensors,
    table rows and selection, over the same records) it is the same."""
    B, H_kv, G, P, D = 3, 2, 2, 8, 64
    q, k_rec, v_rec, offs, lens, side, table, selected, layout, _ = _case(
        torch.float32, encoding, D, 32, P, B, H_kv, G, 1, [37, 0, 64, 9, 50, 17], 5, "random", 3)
    selected[:, 0] = True  # each row's first page, and others at random
    softcap, sinks = _extras("both", H_kv * G, 3)
    whole = quantized_cpu.sparse_quantized_attention_cpu(q, k_rec, v_rec, lens, side, table, selected, P, 0.125,
                                                         layout, softcap, sinks)
    for b in range(B):
        rows = slice(b * H_kv, (b + 1) * H_kv)
        alone = quantized_cpu.sparse_quantized_attention_cpu(q[b:b + 1], k_rec, v_rec, lens[rows], side[:, rows],
                                                             table[rows], selected[rows], P, 0.125, layout, softcap,
                                                             sinks)
        torch.testing.assert_close(alone, whole[b:b + 1], atol=1e-6, rtol=1e-6)
        assert float(whole[b].abs().max()) > 0  # something read in every batch row


@pytest.mark.parametrize("encoding", ["int4", "int8", "e4m3"])
@pytest.mark.parametrize("extras", ["plain", "both"])
def test_every_held_page_is_dense_quantized_attention(encoding, extras):
    """Selecting every page a row holds (and nothing past it) reads what dense attention over the records reads: the
    dense quantized kernel's output, with a ring and mid-page ends; one page fewer moves it."""
    B, H_kv, G, P, D = 2, 2, 3, 16, 128
    q, k_rec, v_rec, offs, lens, side, table, _, layout, _ = _case(
        torch.float32, encoding, D, 32, P, B, H_kv, G, 1, [70, 33, 16, 1], 5, "every", 11)
    held = (lens.long() + P - 1) // P
    selected = torch.arange(table.shape[1]) < held[:, None]
    softcap, sinks = _extras(extras, H_kv * G, 11)
    got = quantized_cpu.sparse_quantized_attention_cpu(q, k_rec, v_rec, lens, side, table, selected, P, D ** -0.5,
                                                       layout, softcap, sinks)
    dense = quantized_cpu.quantized_attention_cpu(q, k_rec, v_rec, offs, lens, side, D ** -0.5, layout,
                                                  softcap=softcap, sinks=sinks)
    torch.testing.assert_close(got, dense, atol=2e-6, rtol=2e-6)
    fewer = selected.clone()
    fewer[0, 1] = False
    moved = quantized_cpu.sparse_quantized_attention_cpu(q, k_rec, v_rec, lens, side, table, fewer, P, D ** -0.5,
                                                         layout, softcap, sinks)
    assert float((moved[0, :G] - dense[0, :G]).abs().max()) > 1e-4


def _op_case(Q=1):
    return _case(torch.float32, "int4", 64, 32, 16, 2, 2, 3, Q, [70, 33, 0, 41], 4, "random", 7)


def test_the_op_runs_the_kernel_on_cpu(monkeypatch):
    """The wrapper and the raw custom op run the kernel (the reference never runs); turned off, both give the torch
    reference bit for bit; more queries than the kernel takes go to the reference."""
    q, k_rec, v_rec, offs, lens, side, table, selected, layout, _ = _op_case()
    args = (q, k_rec, v_rec, offs, lens, side, table, selected, 16, 0.125)
    ref = sparse.sparse_quantized_attention_ref(*args, layout)
    fused = quantized_cpu.sparse_quantized_attention_cpu(q, k_rec, v_rec, lens, side, table, selected, 16, 0.125,
                                                         layout)

    def refused(*a, **k):
        raise AssertionError("the torch reference ran")

    monkeypatch.setattr(sparse, "sparse_quantized_attention_ref", refused)
    got = sparse.sparse_quantized_attention(*args, layout)
    encoding, *fields = sparse.op_fields(layout)
    raw = torch.ops.kvpress_ada.sparse_quantized_attention(*args, encoding, [int(f) for f in fields], 0.0, None)
    assert torch.equal(got, fused) and torch.equal(raw, fused)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    monkeypatch.undo()
    with use_cpu_kernel(False):
        assert quantized_cpu.sparse_quantized_attention_cpu(q, k_rec, v_rec, lens, side, table, selected, 16, 0.125,
                                                            layout) is None
        assert torch.equal(sparse.sparse_quantized_attention(*args, layout), ref)
    long = _op_case(MAX_QUERIES + 1)
    assert quantized_cpu.sparse_quantized_attention_cpu(*long[:3], *long[4:8], 16, 0.125, long[8]) is None
    assert torch.equal(sparse.sparse_quantized_attention(*long[:8], 16, 0.125, long[8]),
                       sparse.sparse_quantized_attention_ref(*long[:8], 16, 0.125, long[8]))


@pytest.mark.parametrize("value", ["0", "off"])
def test_variable_turns_the_kernel_off(monkeypatch, value):
    monkeypatch.setenv("KVPRESS_ADA_CPU_KERNEL", value)
    q, k_rec, v_rec, offs, lens, side, table, selected, layout, _ = _op_case()
    assert quantized_cpu.sparse_quantized_attention_cpu(q, k_rec, v_rec, lens, side, table, selected, 16, 0.125,
                                                        layout) is None
    args = (q, k_rec, v_rec, offs, lens, side, table, selected, 16, 0.125, layout)
    assert torch.equal(sparse.sparse_quantized_attention(*args), sparse.sparse_quantized_attention_ref(*args))


def test_a_page_past_the_records_is_refused():
    q, k_rec, v_rec, offs, lens, side, table, selected, layout, _ = _op_case()
    table = table.clone()
    table[0, 0], selected = k_rec.shape[0] // 16, selected.clone()
    selected[0, 0] = True
    with pytest.raises(ValueError, match="past the .* pages of the records"):
        quantized_cpu.sparse_quantized_attention_cpu(q, k_rec, v_rec, lens, side, table, selected, 16, 0.125, layout)
