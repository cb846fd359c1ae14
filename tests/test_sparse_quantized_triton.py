"""The Triton kernel of attention over the selected pages of quantized records
(kvpress_ada/kernels/quantized/sparse_triton_kernel.py), interpreted on CPU (fp32/fp16): the torch reference
(sparse_quantized_attention_ref) over every encoding, with and without a residual ring, over empty rows, rows ending
mid-page, random / every / first-and-newest / no pages, GQA, 1-4 queries, soft-cap and sinks, reading no record it was
not given (unread records poisoned); every held page is the dense Triton kernel over records; the op, raw and compiled,
and a quantized layer under a reader run it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # standalone runs; conftest sets it too

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sparse_kernels import hopper_codegen
from test_sparse_quantized_cpu import _case, _extras, _poisoned, assert_blind_queries_zero

from kvpress_ada import kernels
from kvpress_ada.kernels import use_backend
from kvpress_ada.kernels.ragged import sparse

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or kernels.triton_interpret()) or not kernels.triton_available(),
    reason="Triton on CPU needs TRITON_INTERPRET=1 and triton")

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
EXTRAS = ["plain", "softcap", "sinks", "both"]


def _tk():
    from kvpress_ada.kernels.quantized import sparse_triton_kernel

    return sparse_triton_kernel


def _check(dtype, encoding, D, group, P, B, G, Q, lengths, residual, selection, extras, seed, split=0, scale_bits=0):
    """The kernel over poisoned copies of the records (a record it was not given to read is NaN) against the torch
    reference; a row that reads nothing, and a query that sees nothing, give exact zeros. Returns the output."""
    H_kv = 2
    q, k_rec, v_rec, offs, lens, side, table, selected, layout, _ = _case(
        dtype, encoding, D, group, P, B, H_kv, G, Q, lengths[:B * H_kv], residual, selection, seed, scale_bits)
    softcap, sinks = _extras(extras, H_kv * G, seed)
    got = _tk().sparse_quantized_attention_triton(q, *_poisoned(k_rec, v_rec, offs, lens, selected, P), lens, side,
                                                  table, selected, P, D ** -0.5, layout, softcap=softcap, sinks=sinks,
                                                  split_pages=split)
    ref = sparse.sparse_quantized_attention_ref(q, k_rec, v_rec, offs, lens, side, table, selected, P, D ** -0.5,
                                                layout, softcap, sinks)
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert_blind_queries_zero(got, lens, table, selected, P)
    return got


@pytest.mark.parametrize("selection", ["random", "every", "ends", "none"])
@pytest.mark.parametrize("residual", [0, 5])
@pytest.mark.parametrize("encoding", ["int4", "int8", "e4m3"])
def test_kernel_equals_the_reference(encoding, residual, selection):
    """Every encoding, ring and selection: an empty row, rows ending mid-page, one shorter than the ring, GQA groups of
    3, two queries; the logit extras and the dtype vary with the case."""
    case = ["int4", "int8", "e4m3"].index(encoding) * 8 + residual // 5 * 4 + ["random", "every", "ends",
                                                                               "none"].index(selection)
    dtype = torch.float32 if case % 3 else torch.float16
    _check(dtype, encoding, 32, 16 if encoding != "e4m3" else 0, 8, 2, 3, 2, [37, 0, 21, 3], residual, selection,
           EXTRAS[case % 4], case, split=1 + case % 2)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([torch.float32, torch.float16]), st.sampled_from(["int4", "int8", "e4m3"]),
       st.sampled_from([(16, 16), (32, 16), (32, 0), (64, 32)]), st.sampled_from([1, 4, 16]), st.integers(1, 2),
       st.sampled_from([1, 2, 4]), st.integers(1, 4), st.lists(st.integers(0, 40), min_size=4, max_size=4),
       st.sampled_from([0, 1, 5]), st.sampled_from(["random", "every", "ends", "none"]), st.sampled_from(EXTRAS),
       st.integers(0, 999), st.sampled_from([0, 1, 3]), st.sampled_from([0, 16]))
def test_kernel_equals_the_reference_over_shapes(dtype, encoding, dims, P, B, G, Q, lengths, residual, selection,
                                                 extras, seed, split, scale_bits):
    """Head dims 16-64 with groups of 16 / 32 or one scale per head, pages of 1-16, batch 1-2, GQA groups of 1-4, 1-4
    queries, float16 scales of float32 entries, splits of 1 and 3 pages and the default."""
    D, group = dims
    _check(dtype, encoding, D, group, P, B, G, Q, lengths, residual, selection, extras, seed, split, scale_bits)


@pytest.mark.parametrize("encoding", ["int4", "int8", "e4m3"])
@pytest.mark.parametrize("extras", ["plain", "both"])
def test_every_held_page_is_the_dense_triton_kernel(encoding, extras):
    """Every page a row holds selected: the dense Triton kernel over records (the same read-back entries, sums in
    another order), with a ring, an empty row and mid-page ends; one page fewer moves it."""
    from kvpress_ada.kernels.quantized.triton_kernel import quantized_attention_triton

    B, H_kv, G, P, D = 2, 2, 3, 8, 32
    q, k_rec, v_rec, offs, lens, side, table, _, layout, _ = _case(
        torch.float32, encoding, D, 16 if encoding != "e4m3" else 0, P, B, H_kv, G, 1, [37, 0, 16, 30], 5, "every", 4)
    held = (lens.long() + P - 1) // P
    selected = torch.arange(table.shape[1]) < held[:, None]
    softcap, sinks = _extras(extras, H_kv * G, 4)
    got = _tk().sparse_quantized_attention_triton(q, k_rec, v_rec, lens, side, table, selected, P, D ** -0.5, layout,
                                                  softcap=softcap, sinks=sinks)
    dense = quantized_attention_triton(q, k_rec, v_rec, offs, lens, side, D ** -0.5, layout, softcap=softcap,
                                       sinks=sinks)
    torch.testing.assert_close(got, dense, atol=2e-6, rtol=2e-6)
    fewer = selected.clone()
    fewer[0, 1] = False
    moved = _tk().sparse_quantized_attention_triton(q, k_rec, v_rec, lens, side, table, fewer, P, D ** -0.5, layout,
                                                    softcap=softcap, sinks=sinks)
    assert float((moved[0, :G] - dense[0, :G]).abs().max()) > 1e-4


def test_the_op_runs_the_kernel_eager_raw_and_compiled(monkeypatch):
    """Under the Triton backend the wrapper, the raw custom op and a step compiled with ``fullgraph=True`` (no graph
    break) all run the kernel, never the torch reference or the CPU kernel, and give the reference's output."""
    from torch._dynamo.utils import counters

    q, k_rec, v_rec, offs, lens, side, table, selected, layout, _ = _case(
        torch.float32, "int4", 32, 16, 8, 2, 2, 2, 1, [37, 0, 21, 9], 3, "random", 7)
    softcap, sinks = _extras("both", 4, 7)
    args = (q, k_rec, v_rec, offs, lens, side, table, selected, 8, 0.2)
    ref = sparse.sparse_quantized_attention_ref(*args, layout, softcap, sinks)
    calls = []
    real = _tk().sparse_quantized_attention_triton
    monkeypatch.setattr(_tk(), "sparse_quantized_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))

    def refused(*a, **k):
        raise AssertionError("not the Triton kernel")

    monkeypatch.setattr(sparse, "sparse_quantized_attention_ref", refused)
    monkeypatch.setattr(sparse, "sparse_quantized_attention_cpu", refused)
    encoding, *fields = sparse.op_fields(layout)

    def step(*a):
        return sparse.sparse_quantized_attention(*a, layout, softcap=softcap, sinks=sinks)

    counters.clear()
    with use_backend("triton"):
        got = sparse.sparse_quantized_attention(*args, layout, softcap=softcap, sinks=sinks)
        raw = torch.ops.kvpress_ada.sparse_quantized_attention(*args, encoding, [int(f) for f in fields], softcap,
                                                               sinks)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert len(calls) == 3 and counters["graph_break"] == {}
    for out in (got, raw, compiled):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_a_quantized_layer_under_a_reader_reads_through_the_kernel(kind):
    """A quantized layer's own records (compressed, then deferred and immediate appends) and page table: its sparse
    attention under the Triton backend is the torch backend's."""
    from kvpress_ada.hosts.transformers.quantized_cache import QuantizedRaggedLayer
    from kvpress_ada.kernels.quantized.scheme import RecordLayout
    from kvpress_ada.readers import TopPages

    g = torch.Generator().manual_seed(5)
    B, H, G, L, D, P = 2, 2, 2, 50, 16, 8
    layout = RecordLayout("int", 4, 16) if kind == "int4" else RecordLayout("e4m3", 8, 0, rotate_keys=False)
    layer = QuantizedRaggedLayer(replace(layout, residual=3), decode_reserve=3)
    layer.update(torch.randn(B, H, L, D, generator=g), torch.randn(B, H, L, D, generator=g))
    layer.read_with(TopPages(budget=2 * P, page_size=P))
    layer.compress(torch.rand(B, H, L, generator=g) < 0.6)
    for n in (2, 1, 4):
        layer.update(torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g))
    q = torch.randn(B, H * G, 1, D, generator=g)
    selected = torch.rand(layer.pages.table.shape, generator=g) < 0.4
    args = (q, layer.k_flat, layer.v_flat, layer.row_offsets, layer.row_lengths, layer.side, layer.pages.table,
            selected, P, 0.4, layer.layout)
    with use_backend("triton"):
        got = sparse.sparse_quantized_attention(*args, softcap=3.0)
    with use_backend("torch"):
        want = sparse.sparse_quantized_attention(*args, softcap=3.0)
    assert float(want.abs().max()) > 0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_kernel_compiles_for_hopper():
    """Full sm_90 codegen (bundled ptxas, no GPU) of the split kernel over selected pages of int8 / int4 / e4m3
    records, with and without the logit extras, at head dim 128: it compiles and its shared memory fits sm_86 and
    up."""
    for extras in (False, True):
        for row in hopper_codegen(extras):
            for name in ("int8", "int4", "e4m3"):
                assert row[f"sparse_quantized_split_{name}"]["shared"] <= 99 * 1024, row
