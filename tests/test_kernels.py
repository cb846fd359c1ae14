"""Ragged-cache kernels: torch references vs a dense oracle, Triton (interpreted on CPU) vs
the references, compaction/append round trips, backend dispatch and error messages."""

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # standalone runs; conftest sets it too

import pytest
import torch
from attention_oracle import dense_attention
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import kernels
from kvpress_ada.kernels import (
    append,
    append_ref,
    compact,
    compact_ref,
    ragged_attention,
    ragged_attention_ref,
    use_backend,
)
from kvpress_ada.kernels.ragged import reference

triton = pytest.importorskip("triton")
from kvpress_ada.kernels.ragged import triton_kernel as tk  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    not torch.cuda.is_available() and not kernels.triton_interpret(),
    reason="Triton on CPU needs TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# ----------------------------------------------------------------------------- helpers


def make_cache(lens, D, dtype, *, gaps=None, perm=None, extra=3, seed=0):
    """Flat K/V with rows of the given lengths placed in storage order ``perm`` with
    ``gaps`` spare slots after each row; spare slots hold huge garbage (must never be read)."""
    g = torch.Generator().manual_seed(seed)
    R = len(lens)
    gaps = gaps or [0] * R
    perm = perm or list(range(R))
    offs = [0] * R
    pos = 0
    for r in perm:
        offs[r] = pos
        pos += lens[r] + gaps[r]
    N = pos + extra
    k = torch.full((N, D), 1e4, dtype=torch.float32)
    v = torch.full((N, D), -1e4, dtype=torch.float32)
    for r in range(R):
        k[offs[r] : offs[r] + lens[r]] = torch.randn(lens[r], D, generator=g)
        v[offs[r] : offs[r] + lens[r]] = torch.randn(lens[r], D, generator=g)
    return (
        k.to(dtype).to(DEV),
        v.to(dtype).to(DEV),
        torch.tensor(offs, dtype=torch.int32, device=DEV),
        torch.tensor(lens, dtype=torch.int32, device=DEV),
    )


@st.composite
def attention_case(draw, dtypes=(torch.float32, torch.float16), head_dims=(16, 32, 64), max_len=80):
    B = draw(st.integers(1, 2))
    H_kv = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from(head_dims))
    Q = draw(st.sampled_from([1, 2, 5]))
    R = B * H_kv
    lens = draw(
        st.lists(
            st.one_of(st.sampled_from([0, 1, 2, Q]), st.integers(0, max_len)), min_size=R, max_size=R
        )
    )
    gaps = draw(st.lists(st.integers(0, 4), min_size=R, max_size=R))
    perm = draw(st.permutations(list(range(R))))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**16))
    return dict(B=B, H_kv=H_kv, G=G, D=D, Q=Q, lens=lens, gaps=gaps, perm=perm, dtype=dtype, seed=seed)


def build(case):
    k, v, offs, lens = make_cache(
        case["lens"], case["D"], case["dtype"], gaps=case["gaps"], perm=case["perm"], seed=case["seed"]
    )
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(case["B"], case["H_kv"] * case["G"], case["Q"], case["D"], generator=g)
    return q.to(case["dtype"]).to(DEV), k, v, offs, lens, case["D"] ** -0.5


def assert_close(out, ref, dtype):
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), atol=TOL[dtype], rtol=TOL[dtype])


# ----------------------------------------------------------------------------- reference


@settings(max_examples=40, deadline=None)
@given(attention_case(dtypes=(torch.float32, torch.float16, torch.bfloat16), head_dims=(16, 32, 64, 96)))
def test_reference_attention_matches_dense(case):
    q, k, v, offs, lens, scale = build(case)
    out = ragged_attention_ref(q, k, v, offs, lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, dense_attention(q, k, v, offs, lens, scale), case["dtype"])


@settings(max_examples=40, deadline=None)
@given(attention_case(dtypes=(torch.float32, torch.float16, torch.bfloat16), head_dims=(16, 64), max_len=40),
       st.sampled_from([4, 8, 32]))
def test_loop_free_attention_matches_dense_and_the_row_loop(case, chunk):
    """The loop-free split-K pass (rows of different lengths, chunk-aligned layout) equals dense
    attention and the per-row loop; spare slots hold garbage that must never be read."""
    lens = case["lens"]
    gaps = [-(-(n + g) // chunk) * chunk - n for n, g in zip(lens, case["gaps"])]
    if sum(n + g for n, g in zip(lens, gaps)) == 0:
        gaps[0] = chunk
    k, v, offs, lens_t = make_cache(lens, case["D"], case["dtype"], gaps=gaps, extra=0, seed=case["seed"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(case["B"], case["H_kv"] * case["G"], case["Q"], case["D"], generator=g).to(case["dtype"]).to(DEV)
    scale = case["D"] ** -0.5
    assert reference.chunk_aligned(k, offs, chunk=chunk)
    out = reference.ragged_attention_chunked(q, k, v, offs, lens_t, scale, chunk=chunk)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, dense_attention(q, k, v, offs, lens_t, scale), case["dtype"])
    loop_free = reference.LOOP_FREE
    try:
        reference.LOOP_FREE = False
        loop = ragged_attention_ref(q, k, v, offs, lens_t, scale)
    finally:
        reference.LOOP_FREE = loop_free
    assert_close(out, loop.double(), case["dtype"])


@pytest.mark.parametrize("lens, loop_free", [([5, 70, 0, 33], True),  # short rows: the loop-free pass
                                              ([300, 700, 290, 410], False),  # long rows: one matmul pair each
                                              ([5, 70], False)])  # too few rows for the pass to pay
def test_reference_picks_the_loop_free_path_for_many_short_rows(monkeypatch, lens, loop_free):
    C = reference.CHUNK
    k, v, offs, lens_t = make_cache(lens, 16, torch.float32, gaps=[-(-(n + 1) // C) * C - n for n in lens], extra=0)
    q = torch.randn(len(lens) // 2, 4, 1, 16, device=DEV)
    calls = []
    real = reference.ragged_attention_chunked
    monkeypatch.setattr(reference, "ragged_attention_chunked", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = ragged_attention_ref(q, k, v, offs, lens_t, 0.25)
    assert calls == ([1] if loop_free else [])
    assert_close(out, dense_attention(q, k, v, offs, lens_t, 0.25), torch.float32)


@pytest.mark.parametrize("Q", [1, 3])
def test_reference_uniform_fast_path(Q):
    """Equal lengths at a regular stride take the batched no-copy path."""
    B, H_kv, G, D, n = 2, 3, 2, 32, 7
    lens = [n] * (B * H_kv)
    k, v, offs, lens_t = make_cache(lens, D, torch.float32, gaps=[2] * (B * H_kv))
    q = torch.randn(B, H_kv * G, Q, D, device=DEV)
    out = ragged_attention_ref(q, k, v, offs, lens_t, 0.3)
    assert_close(out, dense_attention(q, k, v, offs, lens_t, 0.3), torch.float32)


def test_reference_noncontiguous_q():
    B, H_kv, G, Q, D = 1, 2, 2, 5, 16
    k, v, offs, lens = make_cache([9, 3], D, torch.float32)
    q = torch.randn(B, Q, H_kv * G, D, device=DEV).transpose(1, 2)  # HF layout
    assert not q.is_contiguous()
    out = ragged_attention(q, k, v, offs, lens, 0.25)
    assert_close(out, dense_attention(q, k, v, offs, lens, 0.25), torch.float32)


def test_zero_visible_is_zero_not_nan():
    D = 16
    k, v, offs, lens = make_cache([0, 1, 0, 2], D, torch.float32)
    q = torch.randn(2, 4, 5, D, device=DEV)  # Q=5 > every row length
    for backend in ("torch", "triton"):
        with use_backend(backend):
            out = ragged_attention(q, k, v, offs, lens, 1.0)
        assert torch.isfinite(out).all()
        assert (out[0, 0:2] == 0).all() and (out[1, 0:2] == 0).all()  # empty rows
        assert (out[0, 2:4, :4] == 0).all()  # 1 token: only the last query sees it
        assert (out[0, 2:4, 4] != 0).any()
        assert (out[1, 2:4, :3] == 0).all() and (out[1, 2:4, 3:] != 0).any()  # 2 tokens
        assert_close(out, dense_attention(q, k, v, offs, lens, 1.0), torch.float32)


# ----------------------------------------------------------------------------- triton


@needs_interpreter
@settings(max_examples=30, deadline=None)
@given(
    attention_case(),
    st.sampled_from([16, 32, 48, 64, 128]),
    st.sampled_from([16, 32, 64]),
)
def test_triton_attention_matches_reference(case, split_size, block_n):
    q, k, v, offs, lens, scale = build(case)
    out = tk.ragged_attention_triton(q, k, v, offs, lens, scale, split_size=split_size, block_n=block_n)
    ref = ragged_attention_ref(q, k, v, offs, lens, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, ref, case["dtype"])


@needs_interpreter
@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_large_head_dims(D, dtype):
    k, v, offs, lens = make_cache([40, 0, 1, 70], D, dtype, gaps=[1, 0, 2, 0], perm=[2, 0, 3, 1])
    q = torch.randn(2, 4, 2, D, device=DEV).to(dtype)
    with use_backend("triton"):
        out = ragged_attention(q, k, v, offs, lens, D**-0.5)
    assert_close(out, dense_attention(q, k, v, offs, lens, D**-0.5), dtype)


@needs_interpreter
def test_triton_default_config_and_noncontiguous_q():
    B, H_kv, G, Q, D = 2, 2, 4, 2, 64
    k, v, offs, lens = make_cache([130, 5, 0, 77], D, torch.float16)
    q = torch.randn(B, Q, H_kv * G, D, device=DEV).to(torch.float16).transpose(1, 2)
    with use_backend("triton"):
        out = ragged_attention(q, k, v, offs, lens, 0.125)
    assert_close(out, dense_attention(q, k, v, offs, lens, 0.125), torch.float16)


@needs_interpreter
def test_triton_big_query_tile():
    """G * Q > 64: several M tiles per row (chunked-prefill shape)."""
    k, v, offs, lens = make_cache([40, 25], 32, torch.float32)
    q = torch.randn(1, 8, 20, 32, device=DEV)  # G=4, Q=20 -> 80 rows
    out = tk.ragged_attention_triton(q, k, v, offs, lens, 0.2, split_size=16, block_m=32)
    assert_close(out, dense_attention(q, k, v, offs, lens, 0.2), torch.float32)


def test_triton_unsupported_head_dim():
    k, v, offs, lens = make_cache([3, 4], 96, torch.float32)
    q = torch.randn(1, 2, 1, 96, device=DEV)
    with use_backend("triton"), pytest.raises(ValueError, match=r"head_dim=96.*\(16, 32, 64, 128, 256\)"):
        ragged_attention(q, k, v, offs, lens, 1.0)
    with use_backend("torch"):  # the torch path takes any head dim
        ragged_attention(q, k, v, offs, lens, 1.0)


# ----------------------------------------------------------------------------- soft-capping and sinks
# Gemma 2's logit soft-cap and GPT-OSS's attention sinks, each on or off, against the dense oracle (which applies
# them as transformers' eager attention does), on every path of the reference and on Triton.

EXTRAS = [pytest.param(softcap, with_sinks, id=f"softcap={softcap}-sinks={with_sinks}")
          for softcap in (None, 3.0) for with_sinks in (False, True)]


def make_sinks(H_q, seed, dtype=torch.float32):
    """One logit per query head, some large enough to take most of a softmax's mass."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H_q, generator=g) * 2 + torch.tensor([4.0, -1.0]).repeat(H_q)[:H_q]).to(dtype).to(DEV)


def extras_case(case, with_sinks, sinks_dtype=torch.float32):
    """``build(case)`` with queries 4x larger (logits of several units: the soft-cap changes them) and sinks."""
    q, k, v, offs, lens, scale = build(case)
    sinks = make_sinks(q.shape[1], case["seed"], sinks_dtype) if with_sinks else None
    return (q.float() * 4).to(q.dtype), k, v, offs, lens, scale, sinks


@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@settings(max_examples=25, deadline=None)
@given(case=attention_case(dtypes=(torch.float32, torch.float16, torch.bfloat16), head_dims=(16, 64, 96), max_len=40),
       chunk=st.sampled_from([8, 32]), sinks_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_extras_every_reference_path_matches_dense(softcap, with_sinks, case, chunk, sinks_dtype):
    """The loop-free split-K pass, the per-row loop (Q = 1 hot path and the masked Q > 1 one) and the reference's
    own choice, on a chunk-aligned layout whose spare slots hold garbage, equal the dense formula."""
    lens = case["lens"]
    gaps = [-(-(n + g) // chunk) * chunk - n for n, g in zip(lens, case["gaps"])]
    if sum(n + g for n, g in zip(lens, gaps)) == 0:
        gaps[0] = chunk
    k, v, offs, lens_t = make_cache(lens, case["D"], case["dtype"], gaps=gaps, extra=0, seed=case["seed"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q = (torch.randn(case["B"], case["H_kv"] * case["G"], case["Q"], case["D"], generator=g) * 4).to(case["dtype"])
    q = q.to(DEV)
    sinks = make_sinks(q.shape[1], case["seed"], sinks_dtype) if with_sinks else None
    scale = case["D"] ** -0.5
    want = dense_attention(q, k, v, offs, lens_t, scale, softcap=softcap, sinks=sinks)
    outs = [reference.ragged_attention_chunked(q, k, v, offs, lens_t, scale, chunk=chunk, softcap=softcap,
                                               sinks=sinks),
            ragged_attention_ref(q, k, v, offs, lens_t, scale, softcap=softcap, sinks=sinks)]
    loop_free = reference.LOOP_FREE
    try:
        reference.LOOP_FREE = False
        outs.append(ragged_attention_ref(q, k, v, offs, lens_t, scale, softcap=softcap, sinks=sinks))
    finally:
        reference.LOOP_FREE = loop_free
    for out in outs:
        assert out.dtype == q.dtype and out.shape == q.shape
        assert_close(out, want, case["dtype"])


@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@pytest.mark.parametrize("Q", [1, 3])
def test_extras_uniform_fast_path_matches_dense(softcap, with_sinks, Q):
    """Equal lengths at a regular stride (the batched no-copy view) with the logit terms."""
    B, H_kv, G, D, n = 2, 3, 2, 32, 7
    k, v, offs, lens = make_cache([n] * (B * H_kv), D, torch.float32, gaps=[2] * (B * H_kv))
    q = torch.randn(B, H_kv * G, Q, D, device=DEV) * 4
    sinks = make_sinks(H_kv * G, 1) if with_sinks else None
    assert reference.uniform_layout(offs.tolist(), lens.tolist(), B * H_kv)
    out = ragged_attention_ref(q, k, v, offs, lens, 0.3, softcap=softcap, sinks=sinks)
    assert_close(out, dense_attention(q, k, v, offs, lens, 0.3, softcap=softcap, sinks=sinks), torch.float32)


@needs_interpreter
@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@settings(max_examples=8, deadline=None)
@given(case=attention_case(max_len=60), split_size=st.sampled_from([16, 48, 128]))
def test_extras_triton_matches_dense(softcap, with_sinks, case, split_size):
    """Split-K with the soft-cap in the first kernel and the sinks in the merge (rows over several splits, empty
    rows, queries that see nothing)."""
    q, k, v, offs, lens, scale, sinks = extras_case(case, with_sinks)
    out = tk.ragged_attention_triton(q, k, v, offs, lens, scale, split_size=split_size, softcap=softcap or 0.0,
                                     sinks=sinks)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, dense_attention(q, k, v, offs, lens, scale, softcap=softcap, sinks=sinks), case["dtype"])


@pytest.mark.parametrize("softcap, with_sinks", EXTRAS)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_extras_empty_rows_and_blind_queries_give_zeros(softcap, with_sinks, backend):
    """A zero-length row, and a query that sees no entry, output exact zeros with sinks (the sink takes all the
    mass: 0 / exp(0)) as without them (0 by convention, never NaN)."""
    D = 16
    k, v, offs, lens = make_cache([0, 1, 0, 2], D, torch.float32)
    q = torch.randn(2, 4, 5, D, device=DEV) * 4  # Q = 5 > every row length
    sinks = make_sinks(4, 2) if with_sinks else None
    with use_backend(backend):
        out = ragged_attention(q, k, v, offs, lens, 1.0, softcap=softcap, sinks=sinks)
    assert torch.isfinite(out).all()
    assert (out[0, 0:2] == 0).all() and (out[1, 0:2] == 0).all()  # empty rows
    assert (out[0, 2:4, :4] == 0).all() and (out[0, 2:4, 4] != 0).any()  # 1 entry: only the last query sees it
    assert (out[1, 2:4, :3] == 0).all() and (out[1, 2:4, 3:] != 0).any()  # 2 entries
    assert_close(out, dense_attention(q, k, v, offs, lens, 1.0, softcap=softcap, sinks=sinks), torch.float32)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_extras_off_is_the_default_and_limits(backend):
    """``softcap`` None or 0 and no sinks give the default output bit for bit; a soft-cap far above every logit
    and sinks far below them approach it; a sink far above every logit takes all the mass (output -> 0)."""
    k, v, offs, lens = make_cache([9, 3, 30, 0], 32, torch.float32, gaps=[1, 2, 0, 3])
    q = torch.randn(2, 4, 2, 32, device=DEV)
    with use_backend(backend):
        default = ragged_attention(q, k, v, offs, lens, 0.2)
        assert torch.equal(ragged_attention(q, k, v, offs, lens, 0.2, softcap=None, sinks=None), default)
        assert torch.equal(ragged_attention(q, k, v, offs, lens, 0.2, softcap=0), default)
        assert_close(ragged_attention(q, k, v, offs, lens, 0.2, softcap=1e5), default, torch.float32)
        low = torch.full((4,), -60.0, device=DEV)
        assert_close(ragged_attention(q, k, v, offs, lens, 0.2, sinks=low), default, torch.float32)
        high = ragged_attention(q, k, v, offs, lens, 0.2, sinks=torch.full((4,), 60.0, device=DEV))
    assert high.abs().max() < 1e-12


def _eager(module_name, module, query, key, value, mask, scaling, **kwargs):
    """transformers' ``eager_attention_forward`` of a model family: ``[B, Q, H_q, D]``."""
    import importlib

    fn = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}").eager_attention_forward
    return fn(module, query, key, value, mask, scaling=scaling, dropout=0.0, **kwargs)[0]


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
@pytest.mark.parametrize("Q", [1, 4])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_extras_match_transformers_eager_attention(family, Q, backend):
    """Gemma 2's soft-capped and GPT-OSS's sink attention as transformers computes them (eager), over a full
    cache of L entries whose last Q are the new tokens (causal among them)."""
    from types import SimpleNamespace

    B, H_kv, G, L, D = 2, 2, 3, 11, 32
    g = torch.Generator().manual_seed(7)
    query = torch.randn(B, H_kv * G, Q, D, generator=g) * 4
    key, value = torch.randn(B, H_kv, L, D, generator=g), torch.randn(B, H_kv, L, D, generator=g)
    mask = torch.zeros(B, 1, Q, L).masked_fill(~torch.ones(Q, L, dtype=torch.bool).tril(L - Q), float("-inf"))
    sinks = torch.randn(H_kv * G, generator=g) * 2
    module = SimpleNamespace(num_key_value_groups=G, training=False, head_dim=D, sinks=sinks)
    scaling = D**-0.5
    if family == "gemma2":
        want = _eager(family, module, query, key, value, mask, scaling, softcap=2.5)
        extras = dict(softcap=2.5)
    else:
        want = _eager(family, module, query, key, value, mask, scaling)
        extras = dict(sinks=sinks.to(DEV))
    k_flat, v_flat = key.reshape(B * H_kv * L, D).to(DEV), value.reshape(B * H_kv * L, D).to(DEV)
    offs = torch.arange(0, B * H_kv * L, L, dtype=torch.int32, device=DEV)
    lens = torch.full((B * H_kv,), L, dtype=torch.int32, device=DEV)
    with use_backend(backend):
        out = ragged_attention(query.to(DEV), k_flat, v_flat, offs, lens, scaling, **extras)
    assert_close(out.transpose(1, 2), want, torch.float32)


@pytest.mark.parametrize(
    "extras, pattern",
    [
        (dict(softcap=-1.0), r"softcap=-1.0 must be a finite positive number"),
        (dict(softcap=float("inf")), r"softcap=inf must be a finite positive number"),
        (dict(softcap=float("nan")), r"softcap=nan must be"),
        (dict(softcap="50"), r"softcap='50' must be a positive number"),
        (dict(sinks=torch.zeros(3)), r"sinks must be a float tensor \[H_q=4\] .*got torch.float32 \(3,\)"),
        (dict(sinks=torch.zeros(1, 4)), r"sinks must be a float tensor \[H_q=4\] .*\(1, 4\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), r"sinks must be a float tensor .*torch.int64"),
        (dict(sinks=[0.0] * 4), r"sinks must be a float tensor \[H_q=4\], got list"),
        (dict(sinks=torch.zeros(4, device="meta")), r"sinks is on meta but the queries are on"),
    ],
)
def test_extras_errors(extras, pattern):
    args = _good()
    with pytest.raises(ValueError, match=pattern) as err:
        ragged_attention(**args, **extras)
    assert "\n" not in str(err.value)


def test_extras_raw_op_opcheck_and_compiled():
    """The op's schema carries ``softcap`` and ``sinks`` (opcheck), and a step calling the op with both compiles
    with ``fullgraph=True``, no graph break, to what eager gives."""
    from torch._dynamo.utils import counters

    k, v, offs, lens = make_cache([5, 0, 3, 9], 16, torch.float32, gaps=[2, 2, 2, 2])
    q = torch.randn(2, 4, 2, 16, device=DEV) * 4
    sinks = make_sinks(4, 3)
    out = torch.ops.kvpress_ada.ragged_attention(q, k, v, offs, lens, 0.5, 0, 2.0, sinks)
    assert_close(out, dense_attention(q, k, v, offs, lens, 0.5, softcap=2.0, sinks=sinks), torch.float32)
    torch.library.opcheck(torch.ops.kvpress_ada.ragged_attention, (q, k, v, offs, lens, 0.5, 0, 2.0, sinks))

    def step(q, k, v, offs, lens, sinks):
        return ragged_attention(q * 1.5, k, v, offs, lens, 0.5, softcap=2.0, sinks=sinks) + 1

    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, offs, lens, sinks), step(q, k, v, offs, lens, sinks))
    assert counters["graph_break"] == {}


# ----------------------------------------------------------------------------- compact / append


@st.composite
def compact_case(draw):
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, 3))
    L = draw(st.integers(1, 70))
    D = draw(st.sampled_from([16, 24, 64]))
    density = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**16))
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    return B, H, L, D, density, seed, layout, dtype


def make_kv(B, H, L, D, layout, dtype, g):
    if layout == "transposed":  # [B, L, H, D] -> [B, H, L, D] view
        x = torch.randn(B, L, H, D, generator=g).transpose(1, 2)
    elif layout == "sliced":  # a window of a longer cache
        x = torch.randn(B, H, L + 5, D, generator=g)[:, :, 3 : 3 + L]
    else:
        x = torch.randn(B, H, L, D, generator=g)
    return x.to(dtype).to(DEV)


def compact_oracle(keys, keep, row_offsets, k_flat):
    out = k_flat.clone()
    B, H, L, _ = keys.shape
    for b in range(B):
        for h in range(H):
            o = int(row_offsets[b * H + h])
            for j, pos in enumerate(keep[b, h].nonzero().flatten().tolist()):
                out[o + j] = keys[b, h, pos]
    return out


@settings(max_examples=40, deadline=None)
@given(compact_case())
def test_compact_matches_oracle(case):
    B, H, L, D, density, seed, layout, dtype = case
    g = torch.Generator().manual_seed(seed)
    keys = make_kv(B, H, L, D, layout, dtype, g)
    values = make_kv(B, H, L, D, layout, dtype, g)
    keep = (torch.rand(B, H, L, generator=g) < density).to(DEV)
    counts = keep.sum(-1).flatten().tolist()
    caps = [c + 2 for c in counts]
    offs = torch.tensor([sum(caps[:r]) for r in range(B * H)], dtype=torch.int32, device=DEV)
    N = sum(caps) + 1
    k_exp = compact_oracle(keys, keep, offs, torch.zeros(N, D, dtype=dtype, device=DEV))
    v_exp = compact_oracle(values, keep, offs, torch.zeros(N, D, dtype=dtype, device=DEV))
    backends = ["torch", "triton"] if kernels.triton_interpret() or DEV == "cuda" else ["torch"]
    for backend in backends:
        k_flat = torch.zeros(N, D, dtype=dtype, device=DEV)
        v_flat = torch.zeros(N, D, dtype=dtype, device=DEV)
        with use_backend(backend):
            compact(keys, values, keep, offs, k_flat, v_flat)
        assert torch.equal(k_flat, k_exp), backend
        assert torch.equal(v_flat, v_exp), backend


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_compact_append_attend_round_trip(backend):
    """Compact a dense prefill cache, append Q decode tokens, attend: equals dense attention
    over (kept tokens ++ new tokens) with causal masking among the new tokens."""
    torch.manual_seed(0)
    B, H, G, L, D, Q = 2, 2, 2, 37, 32, 2
    keys = torch.randn(B, H, L, D, device=DEV)
    values = torch.randn(B, H, L, D, device=DEV)
    keep = torch.rand(B, H, L, device=DEV) < 0.4
    keep[0, 1] = False  # one row keeps nothing
    counts = keep.sum(-1).flatten()
    caps = counts + Q + 3
    offs = (torch.cumsum(caps, 0) - caps).to(torch.int32)
    N = int(caps.sum())
    k_flat = torch.zeros(N, D, device=DEV)
    v_flat = torch.zeros(N, D, device=DEV)
    lens = counts.to(torch.int32).clone()
    k_new = torch.randn(B, H, Q, D, device=DEV)
    v_new = torch.randn(B, H, Q, D, device=DEV)
    q = torch.randn(B, H * G, Q, D, device=DEV)
    with use_backend(backend):
        compact(keys, values, keep, offs, k_flat, v_flat)
        append(k_new, v_new, k_flat, v_flat, offs, lens)
        out = ragged_attention(q, k_flat, v_flat, offs, lens, 0.2)
    assert lens.tolist() == (counts + Q).tolist()
    for b in range(B):
        for h in range(H):
            r = b * H + h
            o, n = int(offs[r]), int(lens[r])
            kk = torch.cat([keys[b, h][keep[b, h]], k_new[b, h]])
            vv = torch.cat([values[b, h][keep[b, h]], v_new[b, h]])
            assert torch.equal(k_flat[o : o + n], kk) and torch.equal(v_flat[o : o + n], vv)
            s = (q[b, h * G : h * G + G] @ kk.T) * 0.2  # [G, Q, n]
            causal = torch.ones(Q, n, dtype=torch.bool).tril(n - Q)
            p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
            torch.testing.assert_close(out[b, h * G : h * G + G], p @ vv, atol=1e-5, rtol=1e-5)


def test_append_ref_in_place():
    k, v, offs, lens = make_cache([2, 0, 5], 16, torch.float32, gaps=[3, 3, 3])
    k_new = torch.randn(1, 3, 3, 16, device=DEV)
    v_new = torch.randn(1, 3, 3, 16, device=DEV)
    k0 = k.clone()
    append_ref(k_new, v_new, k, v, offs, lens)
    assert lens.tolist() == [5, 3, 8]
    for r, (o, n0) in enumerate([(0, 2), (5, 0), (8, 5)]):
        assert torch.equal(k[o : o + n0], k0[o : o + n0])
        assert torch.equal(k[o + n0 : o + n0 + 3], k_new[0, r])
        assert torch.equal(v[o + n0 : o + n0 + 3], v_new[0, r])


def test_compact_ref_empty_keep_is_noop():
    keys = torch.randn(1, 2, 4, 16)
    k_flat = torch.zeros(3, 16)
    offs = torch.tensor([0, 1], dtype=torch.int32)
    compact_ref(keys, keys, torch.zeros(1, 2, 4, dtype=torch.bool), offs, k_flat, k_flat)
    assert (k_flat == 0).all()


# ----------------------------------------------------------------------------- dispatch


def test_backend_override_and_env(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.get_backend() == "auto"
    assert kernels.resolve_backend(torch.device("cpu")) == "torch"
    with use_backend("triton"):
        assert kernels.get_backend() == "triton"
        with use_backend("torch"):
            assert kernels.get_backend() == "torch"
        assert kernels.get_backend() == "triton"
    assert kernels.get_backend() == "auto"
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert kernels.get_backend() == "torch"
    with use_backend("auto"):  # explicit choice wins over the variable
        assert kernels.get_backend() == "auto"
    monkeypatch.setenv(kernels.ENV_VAR, "cuda-magic")
    with pytest.raises(ValueError, match="cuda-magic"):
        kernels.get_backend()
    with pytest.raises(ValueError, match="'fast'"):
        use_backend("fast")
    prev = use_backend("torch")  # plain setter
    try:
        assert kernels.get_backend() == "torch"
    finally:
        prev.__exit__(None, None, None)


def test_triton_backend_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.resolve_backend(torch.device("cpu"))


def test_works_without_triton():
    """The package imports and the torch path runs when triton is not installed."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kvpress_ada.kernels import ragged_attention, triton_available, compact, append\n"
        "assert not triton_available()\n"
        "k = torch.randn(10, 16); offs = torch.tensor([0, 5], dtype=torch.int32)\n"
        "lens = torch.tensor([3, 4], dtype=torch.int32)\n"
        "out = ragged_attention(torch.randn(1, 4, 1, 16), k, k.clone(), offs, lens, 1.0)\n"
        "assert out.shape == (1, 4, 1, 16) and torch.isfinite(out).all()\n"
        "append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), k, k.clone(), offs, lens)\n"
        "assert lens.tolist() == [4, 5]\n"
        "assert 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
    )
    env = dict(os.environ, KVPRESS_ADA_KERNELS="")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# ----------------------------------------------------------------------------- errors


def _good():
    k, v, offs, lens = make_cache([3, 4, 0, 2], 16, torch.float32)
    q = torch.randn(2, 4, 1, 16, device=DEV)
    return dict(q=q, k_flat=k, v_flat=v, row_offsets=offs, row_lengths=lens, scale=1.0)


@pytest.mark.parametrize(
    "change, exc, pattern",
    [
        (lambda a: a.update(q=a["q"].half()), ValueError, r"q is torch.float16 but the cache .* torch.float32"),
        (lambda a: a.update(q=a["q"][..., :8].contiguous()), ValueError, r"head_dim mismatch.*head_dim=8.*16"),
        (lambda a: a.update(q=torch.randn(2, 3, 1, 16)), ValueError, r"H_q=3 .* multiple of the kv heads H_kv=2"),
        (lambda a: a.update(q=torch.randn(4, 1, 16)), ValueError, r"q must have 4 dims, got shape \(4, 1, 16\)"),
        (lambda a: a.update(q=torch.randn(3, 4, 1, 16)), ValueError, r"R=4 .* batch size B=3"),
        (lambda a: a.update(k_flat=a["k_flat"][None]), ValueError, r"k_flat must have 2 dims"),
        (lambda a: a.update(v_flat=a["v_flat"].half()), ValueError,
         r"k_flat is torch.float32 but v_flat is torch.float16"),
        (lambda a: a.update(row_offsets=a["row_offsets"].float()), TypeError, r"row_offsets must be int32.*float32"),
        (lambda a: a.update(row_lengths=a["row_lengths"][:3]), ValueError,
         r"row_lengths \(3,\) and row_offsets \(4,\)"),
        (lambda a: a.update(q=a["q"].to(torch.float64), k_flat=a["k_flat"].double(), v_flat=a["v_flat"].double()),
         TypeError, r"torch.float64 is not supported"),
        (lambda a: a.update(q=[1, 2]), TypeError, r"q must be a torch.Tensor, got list"),
        (lambda a: a.update(k_flat=a["k_flat"].t().contiguous().t()), ValueError, r"unit stride on the head dim"),
    ],
)
def test_attention_errors(change, exc, pattern):
    args = _good()
    change(args)
    with pytest.raises(exc, match=pattern):
        ragged_attention(**args)


@pytest.mark.skipif(DEV != "cpu", reason="needs a second device type")
def test_attention_mixed_devices_error():
    args = _good()
    args["q"] = args["q"].to("meta")
    with pytest.raises(ValueError, match=r"q is on meta but the cache \(k_flat\) is on cpu"):
        ragged_attention(**args)


def test_compact_append_errors():
    k_flat = torch.zeros(20, 16)
    offs = torch.tensor([0, 10], dtype=torch.int32)
    lens = torch.tensor([0, 0], dtype=torch.int32)
    keys = torch.randn(1, 2, 5, 16)
    keep = torch.ones(1, 2, 5, dtype=torch.bool)
    with pytest.raises(TypeError, match="keep must be a bool mask, got torch.int64"):
        compact(keys, keys, keep.long(), offs, k_flat, k_flat.clone())
    with pytest.raises(ValueError, match=r"keep \(1, 2, 4\) must have shape"):
        compact(keys, keys, keep[..., :4], offs, k_flat, k_flat.clone())
    with pytest.raises(ValueError, match="keys is torch.float16 but the cache"):
        compact(keys.half(), keys.half(), keep, offs, k_flat, k_flat.clone())
    with pytest.raises(ValueError, match="keys has 1 kv heads but the cache has 2 rows"):
        compact(keys[:, :1], keys[:, :1], keep[:, :1], offs, k_flat, k_flat.clone())
    with pytest.raises(ValueError, match=r"k_new \(1, 2, 1, 16\) and v_new \(1, 2, 2, 16\) differ"):
        append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 2, 16), k_flat, k_flat.clone(), offs, lens)
    with pytest.raises(ValueError, match="head_dim mismatch: k_new has head_dim=8"):
        append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), k_flat, k_flat.clone(), offs, lens)


# ----------------------------------------------------------------------------- real codegen


def test_triton_kernels_compile_for_hopper():
    """Full Triton codegen for sm_90 (bundled ptxas, no GPU needed) with the default launch
    configs: catches what the interpreter cannot (codegen errors, shared memory, pipelining).
    Runs in a subprocess because codegen needs TRITON_INTERPRET unset."""
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kvpress_ada.kernels.aot_check", "--dtype", "bf16", "fp32", "--head-dim", "128",
           "--m", "4", "32"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    for row in rows:
        assert row["split"]["shared"] <= 99 * 1024, row  # fits sm_86 and up
        assert row["split"]["cp_async"] > 0, row  # K/V loads are software-pipelined


def test_triton_kernels_with_logit_extras_compile_for_hopper():
    """The variants with soft-capping and sinks compiled in (``--extras``) pass sm_90 codegen with the same
    shared memory bound and software-pipelined K/V loads."""
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kvpress_ada.kernels.aot_check", "--dtype", "bf16", "--head-dim", "128", "--m", "4",
           "--extras"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["extras"]
    assert rows[0]["split"]["shared"] <= 99 * 1024 and rows[0]["split"]["cp_async"] > 0, rows[0]
    assert all(rows[0][f"quantized_split_{name}"]["shared"] <= 99 * 1024 for name in ("int8", "int4", "e4m3"))


# ----------------------------------------------------------------------------- op registration


def test_raw_ops_eager_and_opcheck():
    """The registered ops (what torch.compile sees) agree with the eager wrappers, and
    ``torch.library.opcheck`` accepts their schemas, fake kernels and mutation claims."""
    k, v, offs, lens = make_cache([5, 0, 3, 9], 16, torch.float32, gaps=[2, 2, 2, 2])
    q = torch.randn(2, 4, 2, 16, device=DEV)
    out = torch.ops.kvpress_ada.ragged_attention(q, k, v, offs, lens, 0.5)
    assert_close(out, dense_attention(q, k, v, offs, lens, 0.5), torch.float32)
    torch.library.opcheck(torch.ops.kvpress_ada.ragged_attention, (q, k, v, offs, lens, 0.5))

    k_new = torch.randn(2, 2, 1, 16, device=DEV)
    k2, v2, lens2 = k.clone(), v.clone(), lens.clone()
    torch.ops.kvpress_ada.append(k_new, k_new, k2, v2, offs, lens2)
    assert lens2.tolist() == [6, 1, 4, 10]
    torch.library.opcheck(torch.ops.kvpress_ada.append, (k_new, k_new, k.clone(), v.clone(), offs, lens.clone()))

    keys = torch.randn(2, 2, 6, 16, device=DEV)
    keep = torch.rand(2, 2, 6, device=DEV) < 0.5
    kf = torch.zeros(40, 16, device=DEV)
    torch.library.opcheck(torch.ops.kvpress_ada.compact, (keys, keys, keep, offs, kf, kf.clone()))


# ----------------------------------------------------------------------------- GPU benchmark script

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "bench_kernels.py")


def test_bench_script_help_and_cpu_smoke(capsys):
    res = subprocess.run([sys.executable, BENCH, "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--peak-bw" in res.stdout and "--cpu-smoke" in res.stdout
    if not kernels.triton_interpret():
        pytest.skip("in-process smoke needs the Triton interpreter")
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--cpu-smoke", "--contexts", "64", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "check compact" in out and "triton" in out


E2E = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "bench_e2e.py")


def test_e2e_bench_cpu_smoke(tmp_path):
    """The GPU end-to-end script's code paths run on CPU; its ragged-vs-masked check agrees exactly."""
    import importlib.util
    import json

    torch._dynamo.reset()  # its compiled steps start fresh, not at the recompile limit earlier tests' steps reached
    spec = importlib.util.spec_from_file_location("bench_e2e", E2E)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "e2e.json"
    assert mod.main(["--cpu-smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["errors"]
    labels = {(r["batch"], r["config"]) for r in result["results"]}
    assert {(1, "full"), (2, "ada_snapkv@0.75"), (2, "snapkv@0.75")} <= labels
    for row in result["results"]:
        if row["config"] != "full":
            assert row["kv_fraction"] < 0.5  # r = 0.75 plus the 32-slot reserve on a 256-token context
    assert result["check"] and all(c["token_agreement"] == 1.0 for c in result["check"])
