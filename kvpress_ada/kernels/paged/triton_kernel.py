"""Triton kernel of :func:`kvpress_ada.kernels.paged.ops.paged_attention` (imports triton).

One program per (packed token, kv head): the GQA group's queries of that token (padded to a
``BLOCK_M >= 16`` tile for ``tl.dot``) stream the row's pages one page at a time with an online
softmax (fp32), reading only the entries the token sees. A token that sees nothing writes exact
zeros. Long rows are read by one program (no split-K yet: the decode batch of a serving engine
gives ``tokens x kv heads`` programs already). Under ``TRITON_INTERPRET=1`` it runs on CPU tensors
(fp32/fp16 only: the interpreter's bf16 ``tl.dot`` is wrong). Logit soft-capping and attention sinks
are compiled in only when used (``SOFTCAP``, ``SINKS``): a sink starts the online softmax as a logit of
weight 1 and no value.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ragged.triton_kernel import LOG2E, dot, online_softmax, soft_cap

__all__ = ["paged_attention_triton"]


@triton.jit
def _paged_attn_kernel(
    Q_ptr, K_ptr, V_ptr, TABLE_ptr, LEN_ptr, REQ_ptr, AHEAD_ptr, OUT_ptr, SINK_ptr,
    qk_scale,  # scale * log2(e); scale / softcap when SOFTCAP
    cap_log2,  # softcap * log2(e) (read when SOFTCAP)
    H_kv, G, M_PAGES,
    stride_qt, stride_qh,
    stride_kp, stride_ks,
    stride_vp, stride_vs,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    request = tl.load(REQ_ptr + t)
    row = request * H_kv + h
    n = tl.load(LEN_ptr + row).to(tl.int32) - tl.load(AHEAD_ptr + t).to(tl.int32)  # entries this token sees

    offs_g = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    g_valid = offs_g < G
    q = tl.load(Q_ptr + t.to(tl.int64) * stride_qt + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_valid[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:  # [H_q] base-2 sink logits: each query head's starts its softmax with weight 1
        m_i = tl.load(SINK_ptr + h * G + offs_g, mask=g_valid, other=float("-inf"))
        l_i = tl.where(g_valid, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offs_s = tl.arange(0, PAGE)
    for start in range(0, n, PAGE):
        page = tl.load(TABLE_ptr + row.to(tl.int64) * M_PAGES + start // PAGE).to(tl.int64)
        inside = (start + offs_s) < n
        k = tl.load(K_ptr + page * stride_kp + offs_s[:, None] * stride_ks + offs_d[None, :],
                    mask=inside[:, None], other=0.0)
        s = dot(q, tl.trans(k), IEEE) * qk_scale
        if SOFTCAP:
            s = soft_cap(s, cap_log2)
        s = tl.where(inside[None, :], s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(s, m_i, l_i)
        v = tl.load(V_ptr + page * stride_vp + offs_s[:, None] * stride_vs + offs_d[None, :],
                    mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT_ptr + t.to(tl.int64) * stride_ot + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
             out.to(OUT_ptr.dtype.element_ty), mask=g_valid[:, None])


def paged_attention_triton(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                           row_lengths: torch.Tensor, request: torch.Tensor, ahead: torch.Tensor, H_kv: int,
                           scale: float, *, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`_paged_attn_kernel` (inputs validated by :func:`~kvpress_ada.kernels.paged.ops.paged_attention`;
    ``request, ahead [T]``: each token's request and the later tokens of it, from ``paged.token_rows``; ``H_kv``
    kv heads per request; ``softcap`` 0 and ``sinks`` None: off)."""
    T, H_q, D = q.shape
    M = page_table.shape[1]
    G = H_q // H_kv
    S = k_pages.shape[1]
    if S & (S - 1) or D & (D - 1) or D < 16:
        raise ValueError(f"the Triton paged attention kernel needs a power-of-two page size and head dim >= 16, "
                         f"got page size {S}, head dim {D} (use the torch backend otherwise)")
    out = torch.empty_like(q)
    table = page_table.to(torch.int32).contiguous()
    sink_log2 = out if sinks is None else (sinks.float() * LOG2E).contiguous()
    _paged_attn_kernel[(T, H_kv)](
        q, k_pages, v_pages, table, row_lengths.contiguous(), request, ahead, out, sink_log2,
        scale / softcap if softcap else scale * math.log2(math.e), float(softcap) * LOG2E, H_kv, G, M,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1),
        v_pages.stride(0), v_pages.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=D, PAGE=S, BLOCK_M=max(16, triton.next_power_of_2(G)),
        IEEE=q.dtype == torch.float32, SOFTCAP=bool(softcap), SINKS=sinks is not None,
    )
    return out
