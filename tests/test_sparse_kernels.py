"""Attention over selected pages of the ragged cache: the Triton kernel (interpreted on CPU, fp32/fp16) against an
fp64 oracle that reads each row's held entries of its selected pages, and against the torch reference; every page
selected is ragged attention; rows and queries that read nothing give zeros; the op dispatches to the kernel."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # standalone runs; conftest sets it too

import pytest
import torch

from kvpress_ada import kernels
from kvpress_ada.kernels import ragged_attention_ref, use_backend
from kvpress_ada.kernels.ragged.sparse import page_table, sparse_attention_ref, sparse_ragged_attention

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or kernels.triton_interpret()) or not kernels.triton_available(),
    reason="Triton on CPU needs TRITON_INTERPRET=1 and triton")

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def _tk():
    from kvpress_ada.kernels.ragged import sparse_triton_kernel

    return sparse_triton_kernel


def ragged_pages(lengths: list[int], page: int, D: int, dtype=torch.float32, seed: int = 0, spare: int = 1,
                 gap_value: float = 0.0):
    """A ragged layout of rows of ``lengths`` entries, each row starting on a page boundary with ``spare`` unused
    pages after it (slots past a row's length hold ``gap_value``), and its page table."""
    g = torch.Generator().manual_seed(seed)
    caps = [(-(-n // page) + spare) * page for n in lengths]
    offs = [sum(caps[:r]) for r in range(len(lengths))]
    N = sum(caps)
    k = torch.full((N, D), gap_value)
    v = torch.full((N, D), gap_value)
    for o, n in zip(offs, lengths):
        k[o:o + n] = torch.randn(n, D, generator=g)
        v[o:o + n] = torch.randn(n, D, generator=g)
    ti = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return k.to(dtype), v.to(dtype), ti(offs), ti(lengths), page_table(ti(offs), N, page)


def oracle(q, k, v, offs, lens, table, selected, page, scale, softcap=None, sinks=None):
    """fp64, row by row, query by query: softmax over the held entries of the selected pages the query sees."""
    B, H_q, Q, D = q.shape
    R = offs.shape[0]
    G = H_q // (R // B)
    out = torch.zeros(B, H_q, Q, D, dtype=torch.float64)
    for r in range(R):
        b, h = divmod(r, R // B)
        o, n = int(offs[r]), int(lens[r])
        keys, values = k[o:o + n].double(), v[o:o + n].double()
        chosen = (selected[r] & (table[r] >= 0))[torch.arange(n) // page]
        for i in range(Q):
            seen = chosen & (torch.arange(n) < n - (Q - 1 - i))
            for gi in range(G):
                hq = h * G + gi
                logits = scale * (keys @ q[b, hq, i].double())
                if softcap:
                    logits = softcap * torch.tanh(logits / softcap)
                logits = logits.masked_fill(~seen, float("-inf"))
                if sinks is not None:
                    logits = torch.cat([logits, sinks[hq:hq + 1].double()])
                if not seen.any():
                    continue
                out[b, hq, i] = torch.softmax(logits, 0)[:n] @ values
    return out


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page,Q,G,extras", [(16, 1, 2, "plain"), (4, 3, 2, "softcap"), (8, 1, 4, "sinks"),
                                              (1, 2, 1, "plain"), (32, 1, 3, "sinks")])
def test_triton_kernel_is_attention_over_the_selected_entries(dtype, page, Q, G, extras):
    g = torch.Generator().manual_seed(page * 10 + Q)
    B, H_kv, D = 2, 2, 16
    lengths = [37, 0, 70, 5] if page < 32 else [37, 0, 70, 33]  # an empty row; rows ending mid-page
    k, v, offs, lens, table = ragged_pages(lengths, page, D, dtype, seed=page, gap_value=float("nan"))
    q = torch.randn(B, H_kv * G, Q, D, generator=g).to(dtype)
    selected = torch.rand(table.shape, generator=g) < 0.5
    selected[3] = False  # a row that reads nothing
    softcap = 3.0 if extras == "softcap" else None
    sinks = torch.randn(H_kv * G, generator=g) if extras == "sinks" else None
    want = oracle(q, k, v, offs, lens, table, selected, page, 0.3, softcap, sinks)
    for split in (0, 1, 3):  # one page per split, uneven splits, the default
        got = _tk().sparse_attention_triton(q, k, v, lens, table, selected, page, 0.3, softcap=softcap or 0.0,
                                            sinks=sinks, split_pages=split)
        assert got.dtype == dtype and bool(torch.isfinite(got).all())  # NaN in unheld slots is never read
        torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert bool((got[1, G:] == 0).all())  # row 3 (batch 1, kv head 1) reads nothing: zeros with or without sinks


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_the_torch_reference_and_dense_reads(dtype):
    g = torch.Generator().manual_seed(3)
    B, H_kv, G, D, P = 2, 3, 2, 32, 8
    k, v, offs, lens, table = ragged_pages([60, 9, 0, 41, 24, 80], P, D, dtype, seed=3, spare=2)
    q = torch.randn(B, H_kv * G, 2, D, generator=g).to(dtype)
    selected = torch.rand(table.shape, generator=g) < 0.3
    got = _tk().sparse_attention_triton(q, k, v, lens, table, selected, P, 0.2)
    ref = sparse_attention_ref(q, k, v, offs, lens, table, selected, P, 0.2)
    torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype])
    every = torch.ones_like(selected)  # every page read: ragged attention
    got = _tk().sparse_attention_triton(q, k, v, lens, table, every, P, 0.2, split_pages=2)
    torch.testing.assert_close(got, ragged_attention_ref(q, k, v, offs, lens, 0.2), atol=TOL[dtype],
                               rtol=TOL[dtype])


@needs_triton
def test_triton_kernel_lists_each_rows_selected_pages_in_order():
    table = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6]])
    selected = torch.tensor([[True, False, True, True], [False, True, False, True]])
    pages, js, counts = _tk().selected_pages(table, selected)
    assert counts.tolist() == [2, 2]  # the page past row 0's capacity is never listed
    assert pages[0, :2].tolist() == [0, 2] and js[0, :2].tolist() == [0, 2]
    assert pages[1, :2].tolist() == [4, 6] and js[1, :2].tolist() == [1, 3]


@needs_triton
def test_the_op_dispatches_to_the_triton_kernel(monkeypatch):
    g = torch.Generator().manual_seed(7)
    k, v, offs, lens, table = ragged_pages([20, 35], 4, 16, seed=7)
    q = torch.randn(1, 4, 1, 16, generator=g)
    selected = torch.rand(table.shape, generator=g) < 0.6
    calls = []
    real = _tk().sparse_attention_triton
    monkeypatch.setattr(_tk(), "sparse_attention_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with use_backend("triton"):
        got = sparse_ragged_attention(q, k, v, offs, lens, table, selected, 4, 0.25)
        raw = torch.ops.kvpress_ada.sparse_ragged_attention(q, k, v, offs, lens, table, selected, 4, 0.25)
    with use_backend("torch"):
        ref = sparse_ragged_attention(q, k, v, offs, lens, table, selected, 4, 0.25)
    assert len(calls) == 2
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(raw, ref, atol=2e-5, rtol=2e-5)


@functools.cache
def hopper_codegen(extras: bool) -> tuple[dict, ...]:
    """The rows of ``python -m kvpress_ada.kernels.aot_check`` (full sm_90 codegen, bundled ptxas, no GPU) at bf16 and
    fp32, head dim 128, 4 queries, with or without the logit extras; run once per session (the sparse kernels' tests
    read it); skips without Triton's NVIDIA backend."""
    import json
    import subprocess
    import sys

    import triton

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kvpress_ada.kernels.aot_check", "--dtype", "bf16", "fp32", "--head-dim", "128",
           "--m", "4", *(["--extras"] if extras else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = tuple(json.loads(line) for line in res.stdout.splitlines() if line.startswith("{"))
    assert len(rows) == 2
    return rows


def test_triton_kernel_compiles_for_hopper():
    """Full sm_90 codegen of the split kernel over selected pages, with and without the logit extras: shared memory
    fits sm_86 and up, and the gathered K/V loads are still software-pipelined."""
    for extras in (False, True):
        for row in hopper_codegen(extras):
            assert row["sparse_split"]["shared"] <= 99 * 1024 and row["sparse_split"]["cp_async"] > 0, row
