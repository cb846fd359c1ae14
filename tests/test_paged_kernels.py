"""Paged per-(request, kv head) attention: the torch reference against an fp64 oracle per request, the
ragged kernel on the same rows (paged == ragged), the Triton kernel (interpreted on CPU) against the
reference, strided page views as an engine's interleaved ``[pages, S, 2 * D]`` tensor gives them, and the
compiled op."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # standalone runs; conftest sets it too

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import kernels
from kvpress_ada.kernels import ragged_attention_ref, use_backend
from kvpress_ada.kernels.paged.ops import paged_attention, paged_attention_ref, token_rows

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or kernels.triton_interpret()) or not kernels.triton_available(),
    reason="Triton on CPU needs TRITON_INTERPRET=1 and triton")

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def paged_layout(lengths: list[list[int]], page: int, D: int, dtype=torch.float32, seed: int = 0,
                 interleaved: bool = False):
    """Random keys/values for ``lengths[n][h]`` entries of request ``n``, kv head ``h``, in pages handed out
    in a shuffled order (rows do not own neighbouring pages); returns the pages, the table, the lengths
    and each row's entries as dense tensors."""
    g = torch.Generator().manual_seed(seed)
    rows = [n for per_request in lengths for n in per_request]
    need = [-(-n // page) for n in rows]
    P = sum(need) + 3  # a few pages nobody uses
    order = torch.randperm(P, generator=g).tolist()
    if interleaved:  # an engine's [pages, S, 2 * D] tensor: keys then values in the last dim
        both = torch.randn(P, page, 2 * D, generator=g).to(dtype)
        k_pages, v_pages = both[..., :D], both[..., D:]
    else:
        k_pages = torch.randn(P, page, D, generator=g).to(dtype)
        v_pages = torch.randn(P, page, D, generator=g).to(dtype)
    M = max(need + [1])
    table = torch.full((len(rows), M), -1, dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for r, n in enumerate(rows):
        ids = order[used:used + need[r]]
        used += need[r]
        table[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        idx = torch.tensor(ids, dtype=torch.long)
        dense_k.append(k_pages[idx].reshape(-1, D)[:n] if ids else torch.zeros(0, D, dtype=dtype))
        dense_v.append(v_pages[idx].reshape(-1, D)[:n] if ids else torch.zeros(0, D, dtype=dtype))
    return k_pages, v_pages, table, torch.tensor(rows, dtype=torch.int32), dense_k, dense_v


def oracle(q, dense_k, dense_v, lengths, query_counts, scale, softcap=None, sinks=None):
    """fp64, request by request, kv head by kv head, token by token; ``softcap``: logits ``l`` become
    ``softcap * tanh(l / softcap)`` (Gemma 2), ``sinks [H_q]``: one more logit per query head in the softmax,
    dropped before the values (GPT-OSS)."""
    T, H_q, D = q.shape
    H_kv = len(lengths[0])
    G = H_q // H_kv
    out = torch.zeros(T, H_q, D, dtype=torch.float64)
    t = 0
    for n, Q in enumerate(query_counts):
        for i in range(Q):
            for h in range(H_kv):
                r = n * H_kv + h
                seen = lengths[n][h] - (Q - 1 - i)
                if seen <= 0:
                    continue
                k, v = dense_k[r][:seen].double(), dense_v[r][:seen].double()
                for g in range(G):
                    logits = scale * (k @ q[t + i, h * G + g].double())
                    if softcap:
                        logits = softcap * torch.tanh(logits / softcap)
                    if sinks is not None:
                        p = torch.softmax(torch.cat([logits, sinks[h * G + g:h * G + g + 1].double()]), dim=0)[:-1]
                    else:
                        p = torch.softmax(logits, dim=0)
                    out[t + i, h * G + g] = p @ v
        t += Q
    return out


requests = st.lists(st.tuples(st.lists(st.integers(0, 70), min_size=2, max_size=2), st.integers(1, 4)),
                    min_size=1, max_size=4)


@settings(max_examples=30, deadline=None)
@given(requests=requests, page=st.sampled_from([4, 16]), seed=st.integers(0, 10_000))
def test_the_reference_matches_the_oracle(requests, page, seed):
    lengths = [r[0] for r in requests]
    counts = [r[1] for r in requests]
    D, H_q = 16, 6
    k_pages, v_pages, table, lens, dk, dv = paged_layout(lengths, page, D, seed=seed)
    q = torch.randn(sum(counts), H_q, D, generator=torch.Generator().manual_seed(seed + 1))
    start = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = paged_attention_ref(q, k_pages, v_pages, table, lens, start, 0.3)
    assert torch.allclose(out.double(), oracle(q, dk, dv, lengths, counts, 0.3), atol=1e-5)


def test_paged_equals_ragged_on_the_same_rows():
    """Decode of a batch whose rows are laid out once ragged and once in shuffled pages."""
    lengths = [[37, 5], [0, 64], [12, 12]]
    D, H_q, Q = 32, 4, 2
    k_pages, v_pages, table, lens, dk, dv = paged_layout(lengths, 16, D, seed=3)
    offsets = torch.tensor([0] + [len(k) for k in dk]).cumsum(0)[:-1].to(torch.int32)
    k_flat, v_flat = torch.cat(dk), torch.cat(dv)
    q = torch.randn(len(lengths), H_q, Q, D)
    ragged = ragged_attention_ref(q, k_flat, v_flat, offsets, lens, 0.2)  # [B, H_q, Q, D]
    start = torch.arange(0, (len(lengths) + 1) * Q, Q, dtype=torch.int32)
    paged = paged_attention(q.transpose(1, 2).reshape(-1, H_q, D), k_pages, v_pages, table, lens, start, 0.2)
    assert torch.allclose(paged.view(len(lengths), Q, H_q, D).transpose(1, 2), ragged, atol=1e-6)


def test_a_token_that_sees_nothing_gives_zeros():
    k_pages, v_pages, table, lens, _, _ = paged_layout([[0, 3]], 4, 16)
    q = torch.randn(5, 2, 16)  # 5 new tokens over 3 entries: the first 2 see nothing in head 1, all in head 0
    out = paged_attention_ref(q, k_pages, v_pages, table, lens, torch.tensor([0, 5], dtype=torch.int32), 1.0)
    assert torch.equal(out[:, 0], torch.zeros(5, 16)) and torch.equal(out[:2, 1], torch.zeros(2, 16))
    assert not torch.isnan(out).any() and out[2:, 1].abs().sum() > 0


def test_token_rows_gives_each_token_its_request_and_the_tokens_after_it():
    request, ahead = token_rows(torch.tensor([0, 1, 4, 4, 6], dtype=torch.int32), 6)
    assert request.tolist() == [0, 1, 1, 1, 3, 3] and ahead.tolist() == [0, 2, 1, 0, 1, 0]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_the_triton_kernel_matches_the_reference(dtype, interleaved):
    lengths = [[33, 0, 7], [16, 40, 1]]
    counts = [1, 3]
    D, H_q = 32, 6
    k_pages, v_pages, table, lens, _, _ = paged_layout(lengths, 16, D, dtype=dtype, seed=5, interleaved=interleaved)
    q = torch.randn(sum(counts), H_q, D).to(dtype)
    start = torch.tensor([0, 1, 4], dtype=torch.int32)
    with use_backend("torch"):
        ref = paged_attention(q, k_pages, v_pages, table, lens, start, 0.25)
    with use_backend("triton"):
        tri = paged_attention(q, k_pages, v_pages, table, lens, start, 0.25)
    assert tri.dtype == dtype and not torch.isnan(tri).any()
    assert torch.allclose(tri.float(), ref.float(), atol=TOL[dtype])


def test_bad_inputs_are_refused_in_one_line():
    k_pages, v_pages, table, lens, _, _ = paged_layout([[3, 3]], 4, 16)
    q = torch.randn(1, 3, 16)  # 3 query heads over 2 kv heads
    with pytest.raises(ValueError) as err:
        paged_attention(q, k_pages, v_pages, table, lens, torch.tensor([0, 1], dtype=torch.int32), 1.0)
    assert "\n" not in str(err.value) and "query heads" in str(err.value)
    with pytest.raises(TypeError, match="page_table"):
        paged_attention(torch.randn(1, 2, 16), k_pages, v_pages, table.float(), lens,
                        torch.tensor([0, 1], dtype=torch.int32), 1.0)


def test_the_op_compiles_without_a_graph_break():
    k_pages, v_pages, table, lens, _, _ = paged_layout([[9, 20]], 8, 16)
    start = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(1, 4, 16)

    def step(q, k_pages, v_pages, table, lens, start):
        return paged_attention(q * 2, k_pages, v_pages, table, lens, start, 0.5) + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with use_backend("torch"):
        assert torch.allclose(compiled(q, k_pages, v_pages, table, lens, start),
                              step(q, k_pages, v_pages, table, lens, start), atol=1e-6)


def test_a_fresh_prefill_takes_the_causal_path_and_agrees_with_the_oracle():
    """Every head of the request holds exactly its Q new tokens (a prefill from nothing): the plain causal path."""
    lengths = [[40, 40], [7, 7]]
    counts = [40, 7]
    k_pages, v_pages, table, lens, dk, dv = paged_layout(lengths, 8, 16, seed=11)
    q = torch.randn(sum(counts), 4, 16, generator=torch.Generator().manual_seed(12))
    start = torch.tensor([0, 40, 47], dtype=torch.int32)
    out = paged_attention_ref(q, k_pages, v_pages, table, lens, start, 0.4)
    assert torch.allclose(out.double(), oracle(q, dk, dv, lengths, counts, 0.4), atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.lists(st.integers(0, 50), min_size=3, max_size=3), min_size=2, max_size=5),
       seed=st.integers(0, 10_000))
def test_a_decode_batch_takes_the_batched_path_and_agrees_with_the_oracle(lengths, seed):
    """One token per request: every request at once; slots past a head's length hold NaN and change nothing."""
    D, H_q = 16, 6
    k_pages, v_pages, table, lens, dk, dv = paged_layout(lengths, 8, D, seed=seed)
    used = {int(p) for p in table.flatten().tolist() if p >= 0}
    for p in range(k_pages.shape[0]):
        if p not in used:
            k_pages[p], v_pages[p] = float("nan"), float("nan")
    for r, n in enumerate(lens.tolist()):  # the rest of each row's last page
        last = table[r, (n - 1) // 8] if n else -1
        if n % 8 and last >= 0:
            k_pages[last, n % 8:], v_pages[last, n % 8:] = float("nan"), float("nan")
    q = torch.randn(len(lengths), H_q, D, generator=torch.Generator().manual_seed(seed + 1))
    start = torch.arange(len(lengths) + 1, dtype=torch.int32)
    out = paged_attention_ref(q, k_pages, v_pages, table, lens, start, 0.3)
    assert not torch.isnan(out).any()
    assert torch.allclose(out.double(), oracle(q, dk, dv, lengths, [1] * len(lengths), 0.3), atol=1e-5)


# ----------------------------------------------------------------------------- soft-capping and sinks

EXTRAS = [pytest.param(softcap, with_sinks, id=f"softcap={softcap}-sinks={with_sinks}")
          for softcap in (None, 2.0) for with_sinks in (False, True)]


def _sinks(H_q, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H_q, generator=g) * 2 + 1).to(dtype)


@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@settings(max_examples=20, deadline=None)
@given(requests=requests, page=st.sampled_from([4, 16]), seed=st.integers(0, 10_000),
       sinks_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_extras_reference_matches_the_oracle(softcap, with_sinks, requests, page, seed, sinks_dtype):
    """Soft-cap and sinks on or off, over requests of 1 to 4 tokens and rows of 0 to 70 entries (the general
    path; a token that sees nothing outputs 0 either way)."""
    lengths = [r[0] for r in requests]
    counts = [r[1] for r in requests]
    D, H_q = 16, 6
    k_pages, v_pages, table, lens, dk, dv = paged_layout(lengths, page, D, seed=seed)
    q = torch.randn(sum(counts), H_q, D, generator=torch.Generator().manual_seed(seed + 1)) * 4
    sinks = _sinks(H_q, seed, sinks_dtype) if with_sinks else None
    start = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = paged_attention_ref(q, k_pages, v_pages, table, lens, start, 0.3, softcap=softcap, sinks=sinks)
    want = oracle(q, dk, dv, lengths, counts, 0.3, softcap, sinks)
    assert torch.allclose(out.double(), want, atol=1e-5)


@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@pytest.mark.parametrize("shape", ["decode batch", "fresh prefill"])
def test_extras_on_the_batched_and_prefill_paths(softcap, with_sinks, shape):
    """The one-token-per-request batch (every request at once, a zero-length row among them) and a fresh prefill
    (which leaves the plain causal path when a logit term is on) agree with the oracle."""
    if shape == "decode batch":
        lengths, counts = [[0, 9], [30, 4], [17, 17]], [1, 1, 1]
    else:
        lengths, counts = [[12, 12], [5, 5]], [12, 5]
    D, H_q = 16, 4
    k_pages, v_pages, table, lens, dk, dv = paged_layout(lengths, 8, D, seed=21)
    q = torch.randn(sum(counts), H_q, D, generator=torch.Generator().manual_seed(22)) * 4
    sinks = _sinks(H_q, 23) if with_sinks else None
    start = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = paged_attention_ref(q, k_pages, v_pages, table, lens, start, 0.4, softcap=softcap, sinks=sinks)
    assert torch.allclose(out.double(), oracle(q, dk, dv, lengths, counts, 0.4, softcap, sinks), atol=1e-5)
    if shape == "decode batch":  # request 0's head 0 holds nothing: exact zeros, with or without sinks
        assert torch.equal(out[0, :2], torch.zeros(2, D))


@needs_triton
@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extras_triton_matches_the_oracle(softcap, with_sinks, dtype):
    """The Triton kernel with the soft-cap on every logit and the sinks starting each head's online softmax; a
    zero-length row and tokens that see nothing give exact zeros."""
    lengths = [[33, 0, 7], [16, 40, 1]]
    counts = [1, 3]
    D, H_q = 32, 6
    k_pages, v_pages, table, lens, dk, dv = paged_layout(lengths, 16, D, dtype=dtype, seed=5)
    q = (torch.randn(sum(counts), H_q, D, generator=torch.Generator().manual_seed(6)) * 4).to(dtype)
    sinks = _sinks(H_q, 7) if with_sinks else None
    start = torch.tensor([0, 1, 4], dtype=torch.int32)
    with use_backend("triton"):
        tri = paged_attention(q, k_pages, v_pages, table, lens, start, 0.25, softcap=softcap, sinks=sinks)
    want = oracle(q, dk, dv, lengths, counts, 0.25, softcap, sinks)
    assert tri.dtype == dtype and not torch.isnan(tri).any()
    assert torch.allclose(tri.double(), want, atol=TOL[dtype])
    assert torch.equal(tri[0, 2:4], torch.zeros(2, D, dtype=dtype))  # request 0, kv head 1: an empty row
    assert torch.equal(tri[1:3, 4:6], torch.zeros(2, 2, D, dtype=dtype))  # 1 entry: only the last token sees it


def test_extras_refusals_and_compiled_op():
    k_pages, v_pages, table, lens, dk, dv = paged_layout([[9, 20]], 8, 16)
    start = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(1, 4, 16)
    for extras, pattern in ((dict(softcap=0.0 - 2), "softcap=-2.0 must be a finite positive number"),
                            (dict(sinks=torch.zeros(2)), r"sinks must be a float tensor \[H_q=4\]")):
        with pytest.raises(ValueError, match=pattern) as err:
            paged_attention(q, k_pages, v_pages, table, lens, start, 0.5, **extras)
        assert "\n" not in str(err.value)
    sinks = _sinks(4, 1)

    def step(q, k_pages, v_pages, table, lens, start, sinks):
        return paged_attention(q * 2, k_pages, v_pages, table, lens, start, 0.5, softcap=3.0, sinks=sinks) + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with use_backend("torch"):
        got = compiled(q, k_pages, v_pages, table, lens, start, sinks)
    want = oracle(q * 2, dk, dv, [[9, 20]], [1], 0.5, 3.0, sinks) + 1
    assert torch.allclose(got.double(), want, atol=1e-5)
    torch.library.opcheck(torch.ops.kvpress_ada.paged_attention, (q, k_pages, v_pages, table, lens, start, 0.5, 3.0,
                                                                  sinks))
