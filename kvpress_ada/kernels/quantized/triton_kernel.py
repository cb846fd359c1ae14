"""Triton ragged attention over quantized records (layout: :mod:`.quantized`).

The split-K scheme of :mod:`..ragged.triton_kernel` (FlashDecoding over variable-length rows: an in-kernel
prefix sum maps each program to its (row, split), the GQA group x queries packed into one tile, a
second launch merging the splits' online-softmax partials:
:func:`~kvpress_ada.kernels.ragged.triton_kernel.merge_splits`)
with two changes: each ``[BLOCK_N, D]`` tile of keys or values is read as integers plus the scales
and zero points of its tokens (e4m3 records: float8 bytes decoded with integer ops, plus their float32 scales)
and dequantized in registers (float32), then cast to the query's dtype for ``tl.dot``; and the scheme's rows
(:mod:`.quantized`): the query is rotated once before the launch (a layout that rotates keys:
``q @ R``, so the keys' ``y = (k - c) @ R`` are never un-rotated and the centre ``c`` shifts every logit
of a row alike, which softmax ignores), and a row's first slot reads as its anchor (the anchor key in the
records' space, ``(anchor - c) @ R``, float32, and the anchor value). The cache is read at ``bits / 16``
of a 16-bit cache's bytes plus the scales. A row's newest ``RESID`` slots (the storage's residual, when set)
read from its residual ring instead of their records (keys rotated into the records' space, float32).
Logit soft-capping and attention sinks, compiled in only when used (``SOFTCAP``, ``SHIFT``; sinks in the
merge), need the logits ``q . k`` themselves: ``SHIFT`` adds each query's ``q . c`` to its logits
(:func:`~.scheme.centre_logits`), which the centre-free logits over ``y`` otherwise leave out.

Importing this module imports triton; set ``TRITON_INTERPRET=1`` before importing it to run on CPU
tensors (fp32/fp16 only: the interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ragged.triton_kernel import (
    LOG2E,
    default_config,
    dot,
    merge_splits,
    online_softmax,
    query_tile,
    row_split,
    soft_cap,
    softmax_start,
    store_partials,
)
from ..support import check_head_dim
from .scheme import RecordLayout, attention_operands, centre_logits, check_record, residual_of, residual_operands

__all__ = ["quantized_attention_triton", "entry_tile"]


@triton.jit
def _e4m3(byte):
    """float32 values of float8 e4m3 (fn) bytes: (-1)^s (1 + m / 8) 2^(e - 7), or m 2^-9 when e = 0."""
    b = byte.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where(b >= 128, -magnitude, magnitude)


@triton.jit
def _dequantized_tile(REC_ptr, SC_ptr, rows, kv_mask, offs_d, rec_width, sc_width,
                      HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, E4M3: tl.constexpr):
    """``[BLOCK_N, HEAD_DIM]`` float32 entries of the records at ``rows`` (int64 ``[BLOCK_N, 1]``)."""
    if E4M3:
        elements = _e4m3(tl.load(REC_ptr + rows * rec_width + offs_d[None, :], mask=kv_mask, other=0))
    elif BITS == 8:
        elements = tl.load(REC_ptr + rows * rec_width + offs_d[None, :], mask=kv_mask, other=0).to(tl.float32)
    else:  # channel j in the low nibble of byte j, channel j + D/2 in its high nibble
        half = HEAD_DIM // 2
        byte = tl.load(REC_ptr + rows * rec_width + (offs_d % half)[None, :], mask=kv_mask, other=0)
        elements = ((byte >> ((offs_d // half) * 4).to(tl.uint8)[None, :]) & 15).to(tl.float32)
    n_groups = HEAD_DIM // GROUP
    first_scale = (HEAD_DIM * BITS // 8) // (SC_ptr.dtype.element_ty.primitive_bitwidth // 8)
    sc_ptrs = SC_ptr + rows * sc_width + first_scale + (offs_d // GROUP)[None, :]
    scale = tl.load(sc_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    if E4M3:
        out = elements * scale
    else:
        out = elements * scale + tl.load(sc_ptrs + n_groups, mask=kv_mask, other=0.0).to(tl.float32)
    return out


@triton.jit
def entry_tile(REC_ptr, SC_ptr, TAIL_ptr, first, slots, pos, held, n, row, R, offs_d, rec_width, sc_width,
               HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, E4M3: tl.constexpr,
               RESID: tl.constexpr):
    """``[BLOCK_N, HEAD_DIM]`` float32: the keys (or values) a row reads at ranks ``pos`` (its entries held at
    ``slots``, int64, where ``held``; ``[BLOCK_N]`` each): the records dequantized, the row's newest ``RESID`` of its
    ``n`` from its ring ``TAIL_ptr`` (float32 ``[RESID, R, HEAD_DIM]``, rank ``j`` at ``j % RESID``), rank 0 as
    ``first`` (``[1, HEAD_DIM]`` float32: its anchor). Nothing is loaded where not ``held`` (0 there)."""
    mask = held[:, None]
    x = _dequantized_tile(REC_ptr, SC_ptr, slots[:, None], mask, offs_d, rec_width, sc_width, HEAD_DIM, BITS, GROUP,
                          E4M3)
    if RESID > 0:
        in_tail = (pos >= n - RESID)[:, None] & mask
        tail = ((pos % RESID).to(tl.int64)[:, None] * R + row) * HEAD_DIM + offs_d[None, :]
        x = tl.where(in_tail, tl.load(TAIL_ptr + tail, mask=in_tail, other=0.0), x)
    return tl.where((pos == 0)[:, None] & mask, first, x)


@triton.jit
def row_anchor(AK_ptr, AV_ptr, row, offs_d, HEAD_DIM: tl.constexpr):
    """Row ``row``'s anchor (read in place of its rank 0), ``[1, HEAD_DIM]`` each: its key in the records' space
    (float32) and its value (as float32)."""
    base = row.to(tl.int64) * HEAD_DIM
    return tl.load(AK_ptr + base + offs_d)[None, :], tl.load(AV_ptr + base + offs_d).to(tl.float32)[None, :]


@triton.jit
def _quantized_split_kernel(
    Q_ptr, K_ptr, V_ptr, KS_ptr, VS_ptr, AK_ptr, AV_ptr, TK_ptr, TV_ptr, OFF_ptr, LEN_ptr, PM_ptr, PL_ptr, PACC_ptr,
    BIAS_ptr,  # [R, M_TOTAL] float32 q . c of each query (read when SHIFT)
    qk_scale,  # scale * log2(e); scale / softcap when SOFTCAP
    cap_log2,  # softcap * log2(e) (read when SOFTCAP)
    R, H_kv, G, NQ, M_TOTAL, SPLIT,
    stride_qb, stride_qh, stride_qq,
    rec_width,  # bytes per record
    sc_width,  # scale-dtype elements per record
    stride_pm, stride_pacc_s, stride_pacc_m,
    HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, E4M3: tl.constexpr, RESID: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr, SHIFT: tl.constexpr,
):
    pid = tl.program_id(0)
    mt = tl.program_id(1)
    total, row, local = row_split(pid, LEN_ptr, R, SPLIT, R_PAD)  # which (row, split) is this program?
    if pid < total:
        n = tl.load(LEN_ptr + row).to(tl.int32)
        base = tl.load(OFF_ptr + row).to(tl.int64)
        lo = local * SPLIT
        hi = tl.minimum(lo + SPLIT, n)
        q, offs_m, offs_d, m_valid, limit = query_tile(Q_ptr, row, mt, n, H_kv, G, NQ, M_TOTAL, stride_qb, stride_qh,
                                                       stride_qq, HEAD_DIM, BLOCK_M)
        if SHIFT:
            bias = tl.load(BIAS_ptr + row.to(tl.int64) * M_TOTAL + offs_m, mask=m_valid, other=0.0)
        anchor_k, anchor_v = row_anchor(AK_ptr, AV_ptr, row, offs_d, HEAD_DIM)
        m_i, l_i, acc = softmax_start(BLOCK_M, HEAD_DIM)
        offs_j = tl.arange(0, BLOCK_N)
        # not software-pipelined (as without a residual, whose masked float32 tail loads would otherwise be
        # staged through shared memory: 22 KB -> 150 KB per program at head dim 128 on sm_90)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=1):
            offs_n = start + offs_j
            held = offs_n < hi
            rows = base + offs_n.to(tl.int64)
            k = entry_tile(K_ptr, KS_ptr, TK_ptr, anchor_k, rows, offs_n, held, n, row, R, offs_d, rec_width,
                           sc_width, HEAD_DIM, BITS, GROUP, E4M3, RESID).to(q.dtype)
            s = dot(q, tl.trans(k), IEEE)
            if SHIFT:
                s = s + bias[:, None]
            s = s * qk_scale
            if SOFTCAP:
                s = soft_cap(s, cap_log2)
            vis = (offs_n[None, :] < limit[:, None]) & held[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_i, alpha, p, l_i = online_softmax(s, m_i, l_i)
            v = entry_tile(V_ptr, VS_ptr, TV_ptr, anchor_v, rows, offs_n, held, n, row, R, offs_d, rec_width,
                           sc_width, HEAD_DIM, BITS, GROUP, E4M3, RESID).to(q.dtype)
            acc = acc * alpha[:, None] + dot(p.to(q.dtype), v, IEEE)

        store_partials(PM_ptr, PL_ptr, PACC_ptr, pid, offs_m, offs_d, m_valid, m_i, l_i, acc, stride_pm, stride_pacc_s,
                       stride_pacc_m)


def quantized_attention_triton(q: torch.Tensor, k_rec: torch.Tensor, v_rec: torch.Tensor, row_offsets: torch.Tensor,
                               row_lengths: torch.Tensor, side: torch.Tensor, scale: float, layout: RecordLayout, *,
                               split_size: int = 0, softcap: float = 0.0,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Split-K ragged attention over quantized records with the rows' ``side`` tensors (two launches, no host
    sync); inputs validated by :func:`~.quantized_ops.quantized_attention`. ``split_size`` 0:
    :func:`~kvpress_ada.kernels.ragged.triton_kernel.default_config`. ``softcap`` (0: off) and ``sinks [H_q]``
    (None: off): the logit terms of :func:`~.ops.quantized_attention`."""
    B, H_q, Q, D = q.shape
    check_head_dim(D)
    check_record(D, layout, q.dtype)
    if layout.encoding not in ("int", "e4m3"):
        raise ValueError(f"the Triton kernel reads int and e4m3 records, not {layout.encoding!r}")
    dtype = q.dtype
    shift = bool(softcap) or sinks is not None
    bias = centre_logits(q, side) if shift else None  # before q is replaced by its rotation
    q_rot, anchor_k = attention_operands(q, side, layout)
    q = q_rot.to(dtype).contiguous()
    anchor_k, anchor_v = anchor_k.contiguous(), side[1].contiguous()
    residual = residual_of(side)
    tail_k, tail_v = (t.contiguous() for t in residual_operands(side, layout)) if residual else (anchor_k, anchor_k)
    R = row_offsets.shape[0]
    H_kv = R // B
    G = H_q // H_kv
    M_total = G * Q
    n_cap = k_rec.shape[0]
    cfg = default_config(D, M_total, n_cap, q.dtype, q.device)
    block_m, block_n, split = cfg["block_m"], cfg["block_n"], split_size or cfg["split_size"]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if R == 0:
        return out.zero_()
    m_tiles = triton.cdiv(M_total, block_m)
    slots = triton.cdiv(n_cap, split) + R
    pm = torch.empty(slots, m_tiles * block_m, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(slots, m_tiles * block_m, D, device=q.device, dtype=torch.float32)
    sdtype = layout.scale_dtype(q.dtype)
    itemsize = sdtype.itemsize
    ks, vs = k_rec.view(sdtype), v_rec.view(sdtype)  # the same bytes, indexed in scale-sized elements
    _quantized_split_kernel[(slots, m_tiles)](
        q, k_rec, v_rec, ks, vs, anchor_k, anchor_v, tail_k, tail_v, row_offsets, row_lengths, pm, pl, pacc,
        pm if bias is None else bias,
        float(scale) / softcap if softcap else float(scale) * math.log2(math.e), float(softcap) * LOG2E,
        R, H_kv, G, Q, M_total, split,
        q.stride(0), q.stride(1), q.stride(2),
        k_rec.shape[1], k_rec.shape[1] // itemsize,
        pm.stride(0), pacc.stride(0), pacc.stride(1),
        HEAD_DIM=D, BITS=layout.bits, GROUP=layout.group_size(D), E4M3=layout.encoding == "e4m3", RESID=residual,
        BLOCK_M=block_m, BLOCK_N=block_n,
        R_PAD=max(16, 1 << max(0, (R - 1).bit_length())), IEEE=q.dtype == torch.float32,
        SOFTCAP=bool(softcap), SHIFT=shift,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    merge_splits(out, row_lengths, pm, pl, pacc, H_kv, G, split, sinks)
    return out
