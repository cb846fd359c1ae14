"""The ragged-cache ops compile with ``torch.compile(fullgraph=True)``, no graph breaks,
and the compiled steps equal eager (torch and interpreted-Triton backends)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # standalone runs; conftest sets it too

import pytest
import torch
from torch._dynamo.utils import counters

from kvpress_ada.kernels import append, compact, ragged_attention, use_backend

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, H_KV, G, D, L = 2, 2, 2, 32, 24
SCALE = D**-0.5


def decode_step(q, k_new, v_new, k_flat, v_flat, row_offsets, row_lengths):
    """One decode step of one layer: append the new token's K/V in place, then attend."""
    append(k_new, v_new, k_flat, v_flat, row_offsets, row_lengths)
    return ragged_attention(q, k_flat, v_flat, row_offsets, row_lengths, SCALE)


def compress_step(keys, values, keep, row_offsets, k_flat, v_flat):
    """End of prefill: compact the kept tokens and derive the row lengths."""
    compact(keys, values, keep, row_offsets, k_flat, v_flat)
    return keep.sum(-1, dtype=torch.int32).flatten()


@pytest.fixture(scope="module")
def compiled():
    """Compile both steps once per module (the first CPU compile takes ~15-20 s)."""
    counters.clear()
    return {
        "decode": torch.compile(decode_step, fullgraph=True, dynamic=False),
        "compress": torch.compile(compress_step, fullgraph=True, dynamic=False),
    }


def make_state(seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, L, H_KV, D, generator=g).transpose(1, 2).to(DEV)  # strided view
    values = torch.randn(B, H_KV, L, D, generator=g).to(DEV)
    keep = (torch.rand(B, H_KV, L, generator=g) < 0.5).to(DEV)
    keep[0, 0] = False  # an empty row
    caps = torch.full((B * H_KV,), L + 4, dtype=torch.int32)
    offs = (torch.cumsum(caps, 0) - caps).to(torch.int32).to(DEV)
    N = int(caps.sum())
    k_flat = torch.zeros(N, D, device=DEV)
    v_flat = torch.zeros(N, D, device=DEV)
    q = torch.randn(B, H_KV * G, 1, D, generator=g).to(DEV)
    k_new = torch.randn(B, H_KV, 1, D, generator=g).to(DEV)
    v_new = torch.randn(B, H_KV, 1, D, generator=g).to(DEV)
    return keys, values, keep, offs, k_flat, v_flat, q, k_new, v_new


def run(fns, seed, backend):
    keys, values, keep, offs, k_flat, v_flat, q, k_new, v_new = make_state(seed)
    with use_backend(backend):
        lens = fns["compress"](keys, values, keep, offs, k_flat, v_flat)
        outs = [fns["decode"](q, k_new, v_new, k_flat, v_flat, offs, lens)]
        outs.append(fns["decode"](q * 0.5, v_new, k_new, k_flat, v_flat, offs, lens))
    return outs, lens, k_flat, v_flat


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed", [0, 1])
def test_compiled_steps_match_eager(compiled, backend, seed):
    eager = {"decode": decode_step, "compress": compress_step}
    got = run(compiled, seed, backend)
    want = run(eager, seed, backend)
    for a, b in zip(got[0], want[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], want[1])  # row_lengths mutated in place by append
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert counters["graph_break"] == {}, dict(counters["graph_break"])


def test_no_graph_breaks_and_no_recompiles(compiled):
    for seed in range(2):
        run(compiled, seed, "torch")
    assert counters["graph_break"] == {}
    # two functions, each compiled once: new lengths/backends do not trigger recompiles
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_explain_reports_zero_breaks():
    keys, values, keep, offs, k_flat, v_flat, q, k_new, v_new = make_state(3)
    lens = compress_step(keys, values, keep, offs, k_flat, v_flat)
    explain = torch._dynamo.explain(decode_step)(q, k_new, v_new, k_flat, v_flat, offs, lens)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
