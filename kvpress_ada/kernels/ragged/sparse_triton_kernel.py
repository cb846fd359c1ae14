"""Triton kernel of :func:`kvpress_ada.kernels.ragged.sparse.sparse_ragged_attention`: attention over the selected
pages of each ragged row (Quest, Tang et al., ICML 2024), split-K as FlashDecoding (Dao et al. 2023). Imports
triton.

* Each row's selected pages are listed first, in page order (a few device-side torch ops, no host sync): their
  flat page ids and their places ``j`` in the row, padded to the table's width ``W``, and their count.
* The row's selected pages, seen as one sequence of ``count * P`` slots, are cut into splits of ``split_pages``
  pages; each program finds its (row, split) from an in-kernel prefix sum of the counts (as the ragged kernel
  does over lengths), packs the ``G * Q`` queries of the row into one ``BLOCK_M >= 16`` tile, and reads
  ``BLOCK_N`` slots at a time, gathered page by page (any page size: a tile may span several pages or part of
  one). Only the selected pages' held entries are loaded: the bytes read per step are those of the read budget.
* The partials ``(m, l, acc)`` of the splits are merged by the ragged kernel's second launch
  (:func:`~.triton_kernel.merge_splits`, which also adds the sinks); a row that reads nothing, and a query that
  sees nothing, give exact zeros, never NaN. Soft-capping is compiled in only when used.

Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (fp32/fp16 only: the interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..support import check_head_dim
from .triton_kernel import (
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

__all__ = ["selected_pages", "page_split", "page_slots", "sparse_attention_triton"]


@triton.jit
def page_split(pid, CNT_ptr, LEN_ptr, R, SPLIT, PAGE: tl.constexpr, R_PAD: tl.constexpr):
    """Which work program ``pid`` runs when each row's selected pages (``CNT_ptr[r]`` of them), seen as one sequence
    of ``count * PAGE`` slots, are cut into splits of ``SPLIT`` pages, row after row: ``(total, row, n, lo, hi)``,
    ``total`` the programs with work (``pid >= total``: none), ``n`` the row's length and ``[lo, hi)`` the places
    of the split's slots in the row's sequence."""
    total, row, local = row_split(pid, CNT_ptr, R, SPLIT, R_PAD)
    count = tl.load(CNT_ptr + row, mask=pid < total, other=0).to(tl.int32)
    n = tl.load(LEN_ptr + row, mask=pid < total, other=0).to(tl.int32)
    lo = local * SPLIT * PAGE
    hi = tl.minimum(local * SPLIT + SPLIT, count) * PAGE
    return total, row, n, lo, hi


@triton.jit
def page_slots(PAGE_ptr, J_ptr, lists, t, hi, n, PAGE: tl.constexpr):
    """Slots at places ``t`` (``< hi``) of a row's selected-page sequence (its page lists at ``lists``:
    :func:`selected_pages`): ``(pos, held, slot)``, each slot's rank in its row, whether it holds an entry (a
    place ``< hi`` and a rank ``< n``: others are never loaded) and its flat slot (int64)."""
    inside = t < hi
    pi = t // PAGE
    s = t % PAGE
    j = tl.load(J_ptr + lists + pi, mask=inside, other=0).to(tl.int32)
    page = tl.load(PAGE_ptr + lists + pi, mask=inside, other=0).to(tl.int64)
    pos = j * PAGE + s
    return pos, inside & (pos < n), page * PAGE + s


@triton.jit
def _sparse_split_kernel(
    Q_ptr, K_ptr, V_ptr, LEN_ptr, CNT_ptr, PAGE_ptr, J_ptr, PM_ptr, PL_ptr, PACC_ptr,
    qk_scale,  # scale * log2(e); scale / softcap when SOFTCAP
    cap_log2,  # softcap * log2(e) (read when SOFTCAP)
    R, H_kv, G, NQ, M_TOTAL,
    SPLIT,  # pages per split
    W,  # row stride of the page lists
    stride_qb, stride_qh, stride_qq,
    stride_k, stride_v,
    stride_pm, stride_pacc_s, stride_pacc_m,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    mt = tl.program_id(1)

    total, row, n, lo, hi = page_split(pid, CNT_ptr, LEN_ptr, R, SPLIT, PAGE, R_PAD)
    if pid < total:
        q, offs_m, offs_d, m_valid, limit = query_tile(Q_ptr, row, mt, n, H_kv, G, NQ, M_TOTAL, stride_qb, stride_qh,
                                                       stride_qq, HEAD_DIM, BLOCK_M)
        m_i, l_i, acc = softmax_start(BLOCK_M, HEAD_DIM)
        lists = row.to(tl.int64) * W
        offs_t = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            pos, held, slot = page_slots(PAGE_ptr, J_ptr, lists, start + offs_t, hi, n, PAGE)
            k = tl.load(K_ptr + slot[:, None] * stride_k + offs_d[None, :], mask=held[:, None], other=0.0)
            sc = dot(q, tl.trans(k), IEEE) * qk_scale
            if SOFTCAP:
                sc = soft_cap(sc, cap_log2)
            vis = (pos[None, :] < limit[:, None]) & held[None, :]
            sc = tl.where(vis, sc, float("-inf"))
            m_i, alpha, p, l_i = online_softmax(sc, m_i, l_i)
            v = tl.load(V_ptr + slot[:, None] * stride_v + offs_d[None, :], mask=held[:, None], other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)

        store_partials(PM_ptr, PL_ptr, PACC_ptr, pid, offs_m, offs_d, m_valid, m_i, l_i, acc, stride_pm, stride_pacc_s,
                       stride_pacc_m)


def selected_pages(table: torch.Tensor, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's selected pages listed first, in page order: ``(pages, js, counts)`` with ``pages, js [R, W]``
    int32 (the flat page ids and their places in the row; the tail past ``counts[r]`` is padding) and ``counts
    [R]`` int32. A page past the row's capacity (``table < 0``) is never listed. Device-side ops, no host sync."""
    R, W = table.shape
    sel = selected & (table >= 0)
    counts = sel.sum(-1, dtype=torch.int32)
    col = torch.where(sel, torch.cumsum(sel, -1) - 1, W)  # each selected page's place in the list (W: dropped)
    js = torch.zeros(R, W + 1, dtype=torch.long, device=table.device).scatter_(
        1, col, torch.arange(W, device=table.device).expand(R, W))[:, :W]
    pages = table.long().gather(1, js).clamp(min=0)
    return pages.to(torch.int32).contiguous(), js.to(torch.int32).contiguous(), counts


def split_geometry(cfg: dict, page_size: int, block_m: int, block_n: int, split_pages: int) -> tuple[int, int, int]:
    """``(block_m, block_n, split)`` of a split kernel over selected pages: the given ones, zeros from ``cfg``
    (:func:`~.triton_kernel.default_config`; a split of a quarter of its split size, in pages); a one-line error for
    blocks that are not powers of two >= 16 or a split that is not positive."""
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    split = split_pages or max(1, cfg["split_size"] // (4 * page_size))
    if block_m < 16 or block_n < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_m={block_m}, block_n={block_n}: must be powers of two >= 16")
    if split <= 0:
        raise ValueError(f"split_pages={split} must be positive")
    return block_m, block_n, split


def split_partials(n_pages: int, split: int, rows: int, m_total: int, block_m: int, head_dim: int,
                   device: torch.device) -> tuple[int, int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(m_tiles, slots, (pm, pl, pacc))``: the query tiles, the grid's split slots (at least the splits of rows
    holding distinct pages of a cache of ``n_pages``) and each slot's float32 partial maxima, sums and outputs."""
    m_tiles = triton.cdiv(m_total, block_m)
    slots = triton.cdiv(n_pages, split) + rows
    pm = torch.empty(slots, m_tiles * block_m, device=device, dtype=torch.float32)
    return m_tiles, slots, (pm, torch.empty_like(pm), torch.empty(slots, m_tiles * block_m, head_dim, device=device,
                                                                   dtype=torch.float32))


def sparse_attention_triton(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, row_lengths: torch.Tensor,
                            table: torch.Tensor, selected: torch.Tensor, page_size: int, scale: float, *,
                            softcap: float = 0.0, sinks: torch.Tensor | None = None, split_pages: int = 0,
                            block_n: int = 0, block_m: int = 0, num_warps: int = 0,
                            num_stages: int = 0) -> torch.Tensor:
    """Attention of ``q [B, H_q, Q, D]`` over the entries of each row's selected pages (inputs validated by
    :func:`~kvpress_ada.kernels.ragged.sparse.sparse_ragged_attention`; distinct pages per row, rows not sharing
    pages, so the splits fit the grid). Two launches plus the page lists, no host sync. Zero launch arguments:
    chosen from :func:`~.triton_kernel.default_config` (``split_pages``: its split over the cache's capacity, a
    quarter of it, in pages; a read budget is a fraction of the cache, so shorter splits keep the device busy;
    untuned)."""
    B, H_q, Q, D = q.shape
    check_head_dim(D)
    if q.stride(-1) != 1:
        q = q.contiguous()
    R, W = table.shape
    H_kv = R // B
    G = H_q // H_kv
    M_total = G * Q
    P = int(page_size)
    n_pages = k_flat.shape[0] // P
    cfg = default_config(D, M_total, k_flat.shape[0], q.dtype, q.device)
    block_m, block_n, split = split_geometry(cfg, P, block_m, block_n, split_pages)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if R == 0 or W == 0:
        return out.zero_()
    pages, js, counts = selected_pages(table, selected)
    m_tiles, slots, (pm, pl, pacc) = split_partials(n_pages, split, R, M_total, block_m, D, q.device)
    _sparse_split_kernel[(slots, m_tiles)](
        q, k_flat, v_flat, row_lengths, counts, pages, js, pm, pl, pacc,
        float(scale) / softcap if softcap else float(scale) * LOG2E, float(softcap) * LOG2E,
        R, H_kv, G, Q, M_total, split, W,
        q.stride(0), q.stride(1), q.stride(2),
        k_flat.stride(0), v_flat.stride(0),
        pm.stride(0), pacc.stride(0), pacc.stride(1),
        PAGE=P, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, R_PAD=max(16, triton.next_power_of_2(R)),
        IEEE=q.dtype == torch.float32, SOFTCAP=bool(softcap),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    merge_splits(out, counts, pm, pl, pacc, H_kv, G, split, sinks)
    return out
