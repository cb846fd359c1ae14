"""Triton kernels for the ragged (Ada-KV) KV cache: FlashDecoding-style split-K attention
over variable-length rows, and compaction of kept tokens into the ragged layout.

Importing this module imports triton; ``kvpress_ada.kernels`` only does so lazily. On a
machine without a GPU set ``TRITON_INTERPRET=1`` *before* this module is imported to run
the kernels on CPU tensors (fp32/fp16 only: the interpreter's ``tl.dot`` on bf16 is wrong).

Ragged attention (FlashDecoding, Dao et al. 2023, adapted to variable-length rows):

* work is cut into splits of ``split_size`` tokens; row ``r`` gets
  ``cdiv(row_lengths[r], split_size)`` splits, numbered consecutively over rows. Each
  program of the first kernel finds its (row, split) from an in-kernel prefix sum of the
  row lengths (no host sync, no extra launches), so every program does at most
  ``split_size`` tokens of work whatever the spread of row lengths (Ada-KV rows differ by
  10x and more). The grid is ``cdiv(N_cap, split_size) + R`` programs, an upper bound of the
  number of splits when rows do not overlap; surplus programs exit at once.
* the ``G * Q`` queries that share a kv row (the GQA group times the new tokens) are packed
  into one ``BLOCK_M >= 16`` tile, so K/V of a row are read once per split;
* each split writes online-softmax partials ``(m, l, acc)`` (fp32); a second kernel merges
  the splits of each (row, query). Empty rows, empty splits and fully masked queries give
  exact zeros, never NaN.
* optional logit terms, compiled in only when used (``constexpr`` flags): soft-capping
  (Gemma 2: ``softcap * tanh(l / softcap)``, applied to every logit in the first kernel) and
  attention sinks (GPT-OSS: one logit per query head, added to the merge as one more partial
  ``(m, l, acc) = (sink, 1, 0)``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..support import SUPPORTED_HEAD_DIMS, check_head_dim, triton_interpret

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "check_head_dim",
    "interpreted",
    "ragged_attention_triton",
    "compact_triton",
    "default_config",
    "merge_splits",
    "dot",
    "online_softmax",
    "soft_cap",
    "LOG2E",
]

LOG2E = math.log2(math.e)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """``tl.dot(a, b)``, in IEEE fp32 precision when ``IEEE`` (fp32 inputs: no TF32 rounding)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def soft_cap(x, cap_log2):
    """``cap_log2 * tanh(x)`` (``x`` float32: the logit over the soft-cap; ``cap_log2``: the soft-cap times
    ``log2(e)``, so the result is a base-2 logit), with ``tanh`` from ``exp2`` (no libdevice call: the
    interpreter has none): ``sign(x) (1 - e) / (1 + e)``, ``e = exp(-2 |x|)``, which never overflows, and for
    ``|x| < 0.1``, where ``1 - e`` would cancel, its Taylor series to ``x^7`` (both within ~3e-7 relative)."""
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2 |x|) = 2^(-2 log2(e) |x|)
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    t = tl.where(tl.abs(x) < 0.1, series, tl.where(x < 0, -t, t))
    return t * cap_log2


@triton.jit
def row_split(pid, LEN_ptr, R, SPLIT, R_PAD: tl.constexpr):
    """Which work program ``pid`` runs when row ``r`` of ``R`` (``LEN_ptr[r]`` items) is cut into splits of
    ``SPLIT`` items, numbered row after row (an in-kernel prefix sum): ``(total, row, split)``, ``total`` the
    number of programs with work (``pid >= total``: none; ``row`` and ``split`` are then meaningless)."""
    ridx = tl.arange(0, R_PAD)
    lens = tl.load(LEN_ptr + ridx, mask=ridx < R, other=0).to(tl.int32)
    nsp = (lens + SPLIT - 1) // SPLIT
    cum = tl.cumsum(nsp, axis=0)  # inclusive
    row = tl.sum((cum <= pid).to(tl.int32), axis=0)
    first = tl.sum(tl.where(ridx == row, cum - nsp, 0), axis=0)
    return tl.sum(nsp, axis=0), row, pid - first


@triton.jit
def query_tile(Q_ptr, row, mt, n, H_kv, G, NQ, M_TOTAL, stride_qb, stride_qh, stride_qq, HEAD_DIM: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """Tile ``mt`` of the ``M_TOTAL = G * NQ`` (query head of the group, query) pairs of ragged row ``row`` (kv head
    ``row % H_kv`` of batch row ``row // H_kv``, ``n`` entries): ``(q [BLOCK_M, HEAD_DIM], offs_m, offs_d, m_valid,
    limit)``, ``q`` zero past ``M_TOTAL``, ``limit`` each pair's bottom-right causal limit (query ``i`` of ``NQ``
    sees the row's first ``n - (NQ - 1 - i)`` entries)."""
    b = row // H_kv
    h = row % H_kv
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < M_TOTAL
    g = offs_m // NQ
    qi = offs_m % NQ
    q = tl.load(Q_ptr + b.to(tl.int64) * stride_qb + (h * G + g).to(tl.int64)[:, None] * stride_qh
                + qi[:, None] * stride_qq + offs_d[None, :], mask=m_valid[:, None], other=0.0)
    return q, offs_m, offs_d, m_valid, n - (NQ - 1 - qi)


@triton.jit
def online_softmax(s, m_i, l_i):
    """One tile ``s [M, N]`` (base-2 logits, ``-inf`` where hidden) of an online softmax with running maxima
    ``m_i`` and sums ``l_i [M]``: returns the new maxima, the factor ``alpha`` that rescales the partials so far,
    the tile's weights ``p`` and the new sums. A row that has seen only ``-inf`` keeps weight 0, never NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def softmax_start(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """An empty online softmax (float32): running maxima ``-inf`` and sums 0 ``[BLOCK_M]``, outputs 0
    ``[BLOCK_M, HEAD_DIM]``."""
    return (tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
            tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32))


@triton.jit
def store_partials(PM_ptr, PL_ptr, PACC_ptr, slot, offs_m, offs_d, m_valid, m_i, l_i, acc, stride_pm, stride_pacc_s,
                   stride_pacc_m):
    """Split ``slot``'s partial maxima, sums and outputs (the merge's inputs), for the real queries only
    (``m_valid``: the merge reads only those)."""
    slot = slot.to(tl.int64)
    tl.store(PM_ptr + slot * stride_pm + offs_m, m_i, mask=m_valid)
    tl.store(PL_ptr + slot * stride_pm + offs_m, l_i, mask=m_valid)
    tl.store(PACC_ptr + slot * stride_pacc_s + offs_m[:, None] * stride_pacc_m + offs_d[None, :], acc,
             mask=m_valid[:, None])


@triton.jit
def _ragged_attn_split_kernel(
    Q_ptr,
    K_ptr,
    V_ptr,
    OFF_ptr,
    LEN_ptr,
    PM_ptr,
    PL_ptr,
    PACC_ptr,
    qk_scale,  # scale * log2(e); scale / softcap when SOFTCAP
    cap_log2,  # softcap * log2(e) (read when SOFTCAP)
    R,
    H_kv,
    G,
    NQ,  # queries per head (Q)
    M_TOTAL,  # G * Q
    SPLIT,  # tokens per split
    stride_qb,
    stride_qh,
    stride_qq,
    stride_k,  # row stride of k_flat
    stride_v,
    stride_pm,  # partial m/l: [slots, M_PAD]
    stride_pacc_s,  # partial acc: [slots, M_PAD, D]
    stride_pacc_m,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
        m_i, l_i, acc = softmax_start(BLOCK_M, HEAD_DIM)
        # 64-bit base pointers of this split, 32-bit offsets inside it (split <= 2^31 / D)
        k_base = K_ptr + (base + lo) * stride_k
        v_base = V_ptr + (base + lo) * stride_v
        offs_j = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + offs_j
            kv_mask = offs_n < hi
            rel = (offs_n - lo)[:, None]
            k = tl.load(k_base + rel * stride_k + offs_d[None, :], mask=kv_mask[:, None], other=0.0)
            s = dot(q, tl.trans(k), IEEE) * qk_scale
            if SOFTCAP:
                s = soft_cap(s, cap_log2)
            vis = (offs_n[None, :] < limit[:, None]) & kv_mask[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_i, alpha, p, l_i = online_softmax(s, m_i, l_i)
            v = tl.load(v_base + rel * stride_v + offs_d[None, :], mask=kv_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)

        store_partials(PM_ptr, PL_ptr, PACC_ptr, pid, offs_m, offs_d, m_valid, m_i, l_i, acc, stride_pm, stride_pacc_s,
                       stride_pacc_m)


@triton.jit
def _ragged_attn_reduce_kernel(
    O_ptr,
    LEN_ptr,
    PM_ptr,
    PL_ptr,
    PACC_ptr,
    SINK_ptr,  # [H_q] float32 base-2 sink logits (read when SINKS)
    R,
    H_kv,
    G,
    NQ,
    SPLIT,
    stride_ob,
    stride_oh,
    stride_oq,
    stride_pm,
    stride_pacc_s,
    stride_pacc_m,
    HEAD_DIM: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Merge the split partials of one (row, query): BLOCK_S splits per step; with SINKS, the query head's
    sink logit starts the merge as a partial of weight 1 and no value."""
    row = tl.program_id(0)
    m = tl.program_id(1)  # query index within the row's G * Q
    ridx = tl.arange(0, R_PAD)
    lens = tl.load(LEN_ptr + ridx, mask=ridx < R, other=0).to(tl.int32)
    nsp = (lens + SPLIT - 1) // SPLIT
    cum = tl.cumsum(nsp, axis=0)
    first = tl.sum(tl.where(ridx == row, cum - nsp, 0), axis=0)
    count = tl.sum(tl.where(ridx == row, nsp, 0), axis=0)

    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_S)
    m_run = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), axis=0)
    l_run = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), axis=0)
    if SINKS:
        m_run = tl.load(SINK_ptr + (row % H_kv) * G + m // NQ)
        l_run = l_run + 1.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, count, BLOCK_S):
        idx = s0 + offs_s
        valid = idx < count
        slot = (first + idx).to(tl.int64)
        pm = tl.load(PM_ptr + slot * stride_pm + m, mask=valid, other=float("-inf"))
        pl = tl.load(PL_ptr + slot * stride_pm + m, mask=valid, other=0.0)
        pa = tl.load(
            PACC_ptr + slot[:, None] * stride_pacc_s + m * stride_pacc_m + offs_d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m_run, tl.max(pm, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m_run - m_safe)
        w = tl.exp2(pm - m_safe)
        l_run = l_run * a + tl.sum(w * pl, axis=0)
        acc = acc * a + tl.sum(w[:, None] * pa, axis=0)
        m_run = m_new
    l_safe = tl.where(l_run > 0.0, l_run, 1.0)
    out = tl.where(l_run > 0.0, acc / l_safe, 0.0)

    b = row // H_kv
    h = row % H_kv
    g = m // NQ
    qi = m % NQ
    o_ptrs = (
        O_ptr
        + b.to(tl.int64) * stride_ob
        + (h * G + g).to(tl.int64) * stride_oh
        + qi * stride_oq
        + offs_d
    )
    tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty))


@triton.jit
def _compact_kernel(
    K_ptr,
    V_ptr,
    KEEP_ptr,
    CSUM_ptr,
    OFF_ptr,
    KF_ptr,
    VF_ptr,
    H,
    L,
    D,
    skb,
    skh,
    skl,
    skd,
    svb,
    svh,
    svl,
    svd,
    sxb,
    sxh,
    sxl,
    stride_kf,
    stride_vf,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    b = (row // H).to(tl.int64)
    h = (row % H).to(tl.int64)
    offs_l = blk * BLOCK_L + tl.arange(0, BLOCK_L)
    in_l = offs_l < L
    keep = tl.load(KEEP_ptr + b * sxb + h * sxh + offs_l * sxl, mask=in_l, other=0) != 0
    csum = tl.load(CSUM_ptr + row.to(tl.int64) * L + offs_l, mask=in_l, other=0)
    base = tl.load(OFF_ptr + row).to(tl.int64)
    dst = base + csum.to(tl.int64) - 1
    offs_d = tl.arange(0, BLOCK_D)
    mask = keep[:, None] & (offs_d < D)[None, :]
    lpos = offs_l.to(tl.int64)[:, None]
    k = tl.load(K_ptr + b * skb + h * skh + lpos * skl + offs_d[None, :] * skd, mask=mask)
    tl.store(KF_ptr + dst[:, None] * stride_kf + offs_d[None, :], k, mask=mask)
    v = tl.load(V_ptr + b * svb + h * svh + lpos * svl + offs_d[None, :] * svd, mask=mask)
    tl.store(VF_ptr + dst[:, None] * stride_vf + offs_d[None, :], v, mask=mask)


# ----------------------------------------------------------------------------- launchers

_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def default_config(
    head_dim: int, m_total: int, n_cap: int, dtype: torch.dtype, device: torch.device
) -> dict:
    """Launch parameters chosen from host-known shapes only (no sync).

    ``block_m`` packs the GQA group x queries (>= 16 for ``tl.dot``), ``block_n`` keys per
    inner step, ``split_size`` tokens per program (aiming at ~2 programs per SM over the
    layer's capacity ``n_cap``; untuned guess, see ``benchmarks/gpu/bench_kernels.py
    --sweep``). Shared memory stays under ~85 KB for every supported head dim / dtype
    (sm_80 and sm_86 included): 16-bit caches use 3 pipeline stages, fp32 ones 2 and half
    the ``block_n`` at ``head_dim >= 128``.
    """
    wide = dtype == torch.float32
    if wide:  # fp32 dots run on FMA units: small tiles, or registers spill
        block_m_cap = 32 if head_dim <= 64 else 16
    else:
        block_m_cap = 64 if head_dim <= 128 else 32
    block_m = min(max(16, _next_pow2(m_total)), block_m_cap)
    if wide:
        block_n = 64 if head_dim < 128 else 32
        num_stages = 2
    else:
        block_n = 64 if head_dim <= 128 else 32
        num_stages = 3
    if block_m >= 64:  # big query tiles (chunked prefill): keep registers in check
        block_n = min(block_n, 32)
    # ~2 programs per SM: with <= 3 resident per SM (smem), all splits run in one wave and
    # each still keeps >= 2 K/V tiles in flight; longer splits amortise per-program setup.
    target = 2 * _num_sms(device)
    avg = max(1, n_cap // max(1, target))
    split = min(max(_next_pow2(avg), 4 * block_n), 4096)
    return {
        "block_m": block_m,
        "block_n": block_n,
        "split_size": split,
        "num_warps": 8 if wide else 4,  # fp32 runs on FMA units: 4 warps spill
        "num_stages": num_stages,
    }


def ragged_attention_triton(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    row_offsets: torch.Tensor,
    row_lengths: torch.Tensor,
    scale: float,
    *,
    split_size: int = 0,
    block_n: int = 0,
    block_m: int = 0,
    num_warps: int = 0,
    num_stages: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashDecoding split-K attention over the ragged cache (two launches, no host sync).

    Inputs are assumed validated (see ``kvpress_ada.kernels.ragged.ops``); ``k_flat``/``v_flat``
    must have a unit stride on the head dim; rows must not overlap (so that
    ``sum(row_lengths) <= N_cap``, which bounds the number of splits). Zero arguments
    mean "choose automatically" (:func:`default_config`). ``softcap`` (0: off) and ``sinks [H_q]``
    (None: off): the logit terms of :func:`~kvpress_ada.kernels.ragged.ops.ragged_attention`.
    """
    B, H_q, Q, D = q.shape
    check_head_dim(D)
    if q.stride(-1) != 1:  # the kernel assumes a unit stride on the head dim
        q = q.contiguous()
    R = row_offsets.shape[0]
    H_kv = R // B
    G = H_q // H_kv
    M_total = G * Q
    n_cap = k_flat.shape[0]
    cfg = default_config(D, M_total, n_cap, q.dtype, q.device)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    split = split_size or cfg["split_size"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    if block_m < 16 or block_n < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_m={block_m}, block_n={block_n}: must be powers of two >= 16")
    if split <= 0:
        raise ValueError(f"split_size={split} must be positive")

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    m_tiles = triton.cdiv(M_total, block_m)
    m_pad = m_tiles * block_m
    slots = triton.cdiv(n_cap, split) + R
    pm = torch.empty(slots, m_pad, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(slots, m_pad, D, device=q.device, dtype=torch.float32)
    r_pad = max(16, _next_pow2(R))
    ieee = q.dtype == torch.float32
    if R > 0:
        _ragged_attn_split_kernel[(slots, m_tiles)](
            q,
            k_flat,
            v_flat,
            row_offsets,
            row_lengths,
            pm,
            pl,
            pacc,
            float(scale) / softcap if softcap else float(scale) * LOG2E,
            float(softcap) * LOG2E,
            R,
            H_kv,
            G,
            Q,
            M_total,
            split,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_flat.stride(0),
            v_flat.stride(0),
            pm.stride(0),
            pacc.stride(0),
            pacc.stride(1),
            HEAD_DIM=D,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            R_PAD=r_pad,
            IEEE=ieee,
            SOFTCAP=bool(softcap),
            num_warps=num_warps,
            num_stages=num_stages,
        )
        merge_splits(out, row_lengths, pm, pl, pacc, H_kv, G, split, sinks)
    else:
        out.zero_()
    return out


def merge_splits(out: torch.Tensor, row_lengths: torch.Tensor, pm: torch.Tensor, pl: torch.Tensor,
                 pacc: torch.Tensor, H_kv: int, G: int, split: int, sinks: torch.Tensor | None = None) -> None:
    """Second launch of a split-K ragged attention: merge the online-softmax partials ``(pm, pl, pacc)``
    of every split into ``out [B, H_q, Q, D]`` (shared by the full-precision and quantized kernels), with
    each query head's sink logit ``sinks [H_q]`` (natural units, any float dtype) in the denominator when
    given."""
    R = row_lengths.shape[0]
    Q, D = out.shape[2], out.shape[3]
    sink_log2 = pm if sinks is None else (sinks.float() * LOG2E).contiguous()
    _ragged_attn_reduce_kernel[(R, G * Q)](
        out,
        row_lengths,
        pm,
        pl,
        pacc,
        sink_log2,
        R,
        H_kv,
        G,
        Q,
        split,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        pm.stride(0),
        pacc.stride(0),
        pacc.stride(1),
        HEAD_DIM=D,
        R_PAD=max(16, _next_pow2(R)),
        BLOCK_S=32 if D <= 128 else 16,
        SINKS=sinks is not None,
        num_warps=4,
        num_stages=2,
    )


def compact_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    keep: torch.Tensor,
    row_offsets: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    *,
    block_l: int = 64,
) -> None:
    """Gather the kept tokens of each (batch, kv head) row into the ragged layout.

    One torch ``cumsum`` of ``keep`` gives each kept token its rank in its row; the kernel
    (grid ``(R, cdiv(L, block_l))``) then copies kept K/V rows to
    ``row_offsets[r] + rank``. ``keys``/``values``/``keep`` may be strided views."""
    B, H, L, D = keys.shape
    R = B * H
    if R == 0 or L == 0:
        return
    csum = torch.cumsum(keep, dim=-1, dtype=torch.int32)
    keep_u8 = keep.view(torch.uint8)
    block_d = max(16, _next_pow2(D))
    _compact_kernel[(R, triton.cdiv(L, block_l))](
        keys,
        values,
        keep_u8,
        csum,
        row_offsets,
        k_flat,
        v_flat,
        H,
        L,
        D,
        *keys.stride(),
        *values.stride(),
        *keep_u8.stride(),
        k_flat.stride(0),
        v_flat.stride(0),
        BLOCK_L=block_l,
        BLOCK_D=block_d,
        num_warps=4,
        num_stages=1,
    )


def interpreted() -> bool:
    """True when Triton runs in interpreter mode (kernels accept CPU tensors)."""
    return triton_interpret()
