"""Triton kernel of :func:`kvpress_ada.kernels.ragged.sparse.sparse_quantized_attention`: attention over the selected
pages of rows of quantized records (Quest, Tang et al., ICML 2024; records: :mod:`.scheme`), split-K as FlashDecoding
(Dao et al. 2023). Imports triton.

The page walk of the full-precision kernel (:mod:`..ragged.sparse_triton_kernel`: each row's selected pages listed
in page order, cut into splits of ``split_pages`` pages found by an in-kernel prefix sum, ``BLOCK_N`` slots gathered
page by page, only held entries loaded) reading each tile as the dense kernel over records does
(:func:`~.triton_kernel.entry_tile`: integers or e4m3 bytes plus their scales dequantized in registers, a row's rank 0
as its anchor, its newest ``residual`` entries from its ring), with the dense kernel's query handling: the query
rotated once before the launch, each query's ``q . c`` added to its logits (``SHIFT``) only when soft-capping or sinks
need ``q . k`` itself. The splits' partials are merged by :func:`~..ragged.triton_kernel.merge_splits` (which adds
the sinks). Only the selected pages' records are read: the bytes per step are the read budget's, at ``bits / 16`` of
a 16-bit cache's plus the scales.

Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (fp32/fp16 only: the interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ragged.sparse_triton_kernel import page_slots, page_split, selected_pages, split_geometry, split_partials
from ..ragged.triton_kernel import (
    LOG2E,
    default_config,
    dot,
    merge_splits,
    online_softmax,
    query_tile,
    soft_cap,
    softmax_start,
    store_partials,
)
from ..support import check_head_dim
from .scheme import RecordLayout, attention_operands, centre_logits, check_record, residual_of, residual_operands
from .triton_kernel import entry_tile, row_anchor

__all__ = ["sparse_quantized_attention_triton"]


@triton.jit
def _sparse_quantized_split_kernel(
    Q_ptr, K_ptr, V_ptr, KS_ptr, VS_ptr, AK_ptr, AV_ptr, TK_ptr, TV_ptr, LEN_ptr, CNT_ptr, PAGE_ptr, J_ptr,
    PM_ptr, PL_ptr, PACC_ptr,
    BIAS_ptr,  # [R, M_TOTAL] float32 q . c of each query (read when SHIFT)
    qk_scale,  # scale * log2(e); scale / softcap when SOFTCAP
    cap_log2,  # softcap * log2(e) (read when SOFTCAP)
    R, H_kv, G, NQ, M_TOTAL,
    SPLIT,  # pages per split
    W,  # row stride of the page lists
    stride_qb, stride_qh, stride_qq,
    rec_width,  # bytes per record
    sc_width,  # scale-dtype elements per record
    stride_pm, stride_pacc_s, stride_pacc_m,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, E4M3: tl.constexpr,
    RESID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr, SHIFT: tl.constexpr,
):
    pid = tl.program_id(0)
    mt = tl.program_id(1)
    total, row, n, lo, hi = page_split(pid, CNT_ptr, LEN_ptr, R, SPLIT, PAGE, R_PAD)
    if pid < total:
        q, offs_m, offs_d, m_valid, limit = query_tile(Q_ptr, row, mt, n, H_kv, G, NQ, M_TOTAL, stride_qb, stride_qh,
                                                       stride_qq, HEAD_DIM, BLOCK_M)
        if SHIFT:
            bias = tl.load(BIAS_ptr + row.to(tl.int64) * M_TOTAL + offs_m, mask=m_valid, other=0.0)
        anchor_k, anchor_v = row_anchor(AK_ptr, AV_ptr, row, offs_d, HEAD_DIM)
        m_i, l_i, acc = softmax_start(BLOCK_M, HEAD_DIM)
        lists = row.to(tl.int64) * W
        offs_t = tl.arange(0, BLOCK_N)
        # not software-pipelined, as the dense kernel over records (its masked float32 ring loads)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=1):
            pos, held, slot = page_slots(PAGE_ptr, J_ptr, lists, start + offs_t, hi, n, PAGE)
            k = entry_tile(K_ptr, KS_ptr, TK_ptr, anchor_k, slot, pos, held, n, row, R, offs_d, rec_width, sc_width,
                           HEAD_DIM, BITS, GROUP, E4M3, RESID).to(q.dtype)
            s = dot(q, tl.trans(k), IEEE)
            if SHIFT:
                s = s + bias[:, None]
            s = s * qk_scale
            if SOFTCAP:
                s = soft_cap(s, cap_log2)
            vis = (pos[None, :] < limit[:, None]) & held[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_i, alpha, p, l_i = online_softmax(s, m_i, l_i)
            v = entry_tile(V_ptr, VS_ptr, TV_ptr, anchor_v, slot, pos, held, n, row, R, offs_d, rec_width, sc_width,
                           HEAD_DIM, BITS, GROUP, E4M3, RESID).to(q.dtype)
            acc = acc * alpha[:, None] + dot(p.to(q.dtype), v, IEEE)

        store_partials(PM_ptr, PL_ptr, PACC_ptr, pid, offs_m, offs_d, m_valid, m_i, l_i, acc, stride_pm, stride_pacc_s,
                       stride_pacc_m)


def sparse_quantized_attention_triton(q: torch.Tensor, k_rec: torch.Tensor, v_rec: torch.Tensor,
                                      row_lengths: torch.Tensor, side: torch.Tensor, table: torch.Tensor,
                                      selected: torch.Tensor, page_size: int, scale: float, layout: RecordLayout, *,
                                      softcap: float = 0.0, sinks: torch.Tensor | None = None, split_pages: int = 0,
                                      block_n: int = 0, block_m: int = 0, num_warps: int = 0) -> torch.Tensor:
    """What :func:`~..ragged.sparse.sparse_quantized_attention_ref` returns for these arguments (validated by
    :func:`~..ragged.sparse.sparse_quantized_attention`; distinct pages per row, rows not sharing pages), reading
    only the selected pages' records. Two launches plus the page lists and the query's rotation, no host sync. Zero
    launch arguments: as :func:`~..ragged.sparse_triton_kernel.sparse_attention_triton` chooses them (untuned)."""
    B, H_q, Q, D = q.shape
    check_head_dim(D)
    check_record(D, layout, q.dtype)
    dtype = q.dtype
    shift = bool(softcap) or sinks is not None
    bias = centre_logits(q, side) if shift else None  # before q is replaced by its rotation
    q_rot, anchor_k = attention_operands(q, side, layout)
    q = q_rot.to(dtype).contiguous()
    anchor_k, anchor_v = anchor_k.contiguous(), side[1].contiguous()
    residual = residual_of(side)
    tail_k, tail_v = (t.contiguous() for t in residual_operands(side, layout)) if residual else (anchor_k, anchor_k)
    R, W = table.shape
    H_kv = R // B
    G = H_q // H_kv
    M_total = G * Q
    P = int(page_size)
    cfg = default_config(D, M_total, k_rec.shape[0], dtype, q.device)
    block_m, block_n, split = split_geometry(cfg, P, block_m, block_n, split_pages)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if R == 0 or W == 0:
        return out.zero_()
    pages, js, counts = selected_pages(table, selected)
    m_tiles, slots, (pm, pl, pacc) = split_partials(k_rec.shape[0] // P, split, R, M_total, block_m, D, q.device)
    sdtype = layout.scale_dtype(dtype)
    ks, vs = k_rec.view(sdtype), v_rec.view(sdtype)  # the same bytes, indexed in scale-sized elements
    _sparse_quantized_split_kernel[(slots, m_tiles)](
        q, k_rec, v_rec, ks, vs, anchor_k, anchor_v, tail_k, tail_v, row_lengths, counts, pages, js, pm, pl, pacc,
        pm if bias is None else bias,
        float(scale) / softcap if softcap else float(scale) * LOG2E, float(softcap) * LOG2E,
        R, H_kv, G, Q, M_total, split, W,
        q.stride(0), q.stride(1), q.stride(2),
        k_rec.shape[1], k_rec.shape[1] // sdtype.itemsize,
        pm.stride(0), pacc.stride(0), pacc.stride(1),
        PAGE=P, HEAD_DIM=D, BITS=layout.bits, GROUP=layout.group_size(D), E4M3=layout.encoding == "e4m3",
        RESID=residual, BLOCK_M=block_m, BLOCK_N=block_n, R_PAD=max(16, triton.next_power_of_2(R)),
        IEEE=dtype == torch.float32, SOFTCAP=bool(softcap), SHIFT=shift,
        num_warps=num_warps or cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    merge_splits(out, counts, pm, pl, pacc, H_kv, G, split, sinks)
    return out
