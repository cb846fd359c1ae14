"""Page summaries of the ragged cache and attention over selected pages (Quest, Tang et al., ICML 2024).

Pages: the ragged layout (``k_flat [N, D]``, row ``r`` at ``row_offsets[r]``) cut into pages of ``P`` consecutive
slots, page ``g`` holding slots ``g * P .. g * P + P - 1``: with every row offset and ``N`` multiples of ``P``,
page ``j`` of row ``r`` is flat page ``row_offsets[r] / P + j`` and holds the row's entries ``j * P ..``.
A page's summary is the channel-wise ``kmin, kmax [N / P, D]`` of the keys it holds (``+inf`` / ``-inf`` where
it holds none: the identities of ``min`` / ``max``, so an append only reduces into them), in 16 bits
(:func:`summary_dtype`): a 16-bit key's own dtype (exact), float16 for float32 keys with ``kmin`` rounded down and
``kmax`` rounded up (:func:`round_outward`), so they still contain every key (``2 * D * 2 / P`` bytes per slot).
Its bound on a query's logit, ``q+ . kmax + q- . kmin`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``), equals
``sum_d max(q_d kmin_d, q_d kmax_d) >= q . k`` for every key ``k`` of the page (Quest's bound, in two matmuls,
in float32).

* :func:`page_summaries`, :func:`page_table` - built from the layout (eager, at each re-layout);
* :func:`append_summaries` - an in-place custom op: the appended keys reduced into their pages' summaries;
* :func:`page_bounds` - each query head's bound over each page of its row (plain torch: traced in a compiled step);
* :func:`sparse_quantized_attention` - a custom op: the same over rows of quantized records (int8, int4, fp8), only
  the selected pages' records dequantized: the Triton kernel (:mod:`..quantized.sparse_triton_kernel`: the page walk
  below, each tile dequantized in registers as the dense kernel over records does) on CUDA, on CPU the fused C kernel
  (:func:`~..quantized.cpu_kernel.sparse_quantized_attention_cpu`: each selected page's records read and dequantized
  where they lie) for decode-shaped calls, else the torch reference here;
* :func:`sparse_ragged_attention` - a custom op: attention over the entries of the selected pages only, dispatched
  as the ragged ops are (:mod:`..support`): the Triton kernel (:mod:`.sparse_triton_kernel`, split-K over each
  row's selected pages) on CUDA, on CPU the fused C kernel (:mod:`.sparse_cpu_kernel`: each selected page read where
  it lies) for decode-shaped calls, else the torch reference here (each row's pages gathered, one batched ``bmm``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from ..quantized.cpu_kernel import sparse_quantized_attention_cpu
from ..quantized.ops import op_fields, op_layout
from ..quantized.scheme import RecordLayout, check_side, dequantize, key_rotation, residual_of, side_operands
from ..support import check_logit_extras, resolve_backend, triton_module
from .reference import capped
from .sparse_cpu_kernel import append_summaries_cpu, page_bounds_cpu, sparse_attention_cpu

__all__ = ["summary_dtype", "round_outward", "page_summaries", "page_table", "append_summaries", "page_bounds",
           "sparse_ragged_attention", "sparse_attention_ref", "sparse_quantized_attention",
           "sparse_quantized_attention_ref"]


def _slot_rows(n_slots: int, row_offsets: Tensor, row_lengths: Tensor) -> Tensor:
    """``[n_slots]`` bool: the slots that hold an entry (rows in ascending offset order, as laid out)."""
    offs = row_offsets.long()
    slots = torch.arange(n_slots, device=offs.device)
    row = (torch.searchsorted(offs, slots, right=True) - 1).clamp(min=0)
    return (slots >= offs[row]) & (slots - offs[row] < row_lengths.long()[row])


def summary_dtype(key_dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype page summaries of keys of ``key_dtype`` are kept in: a 16-bit float key's own (float16,
    bfloat16: exact), float16 otherwise (float32 keys, or keys read back from records in float32: rounded
    outward, :func:`round_outward`)."""
    return key_dtype if key_dtype in (torch.float16, torch.bfloat16) else torch.float16


def round_outward(x: Tensor, dtype: torch.dtype, up: bool) -> Tensor:
    """``x`` in ``dtype`` (a 16-bit float), rounded up (``up``: the least value of ``dtype`` at or above each element)
    or down (the greatest at or below): a ``kmax`` rounded up and a ``kmin`` rounded down still bound every key. A
    value past ``dtype``'s range rounds out to ``+inf`` (up) or ``-inf`` (down): a page holding such a key then
    bounds, for a query whose channel has the key's sign, at that channel times float32's largest value (``+inf``
    once it overflows; :func:`page_bounds`): still an upper bound, the page is simply always competitive. Exact
    where ``x`` is representable (always when ``x`` is of ``dtype``); NaN stays NaN. No host sync."""
    y = x.to(dtype)
    if x.dtype == dtype:
        return y
    wide = torch.promote_types(x.dtype, torch.float32)  # holds x and every 16-bit value exactly
    xw, yw = x.to(wide), y.to(wide)
    off = yw < xw if up else yw > xw  # rounded to nearest, to the wrong side
    return torch.where(off, torch.nextafter(y, torch.full_like(y, float("inf") if up else float("-inf"))), y)


def page_summaries(k_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """``(kmin, kmax) [N / P, D]`` in :func:`summary_dtype` of the cache's: each page's channel-wise min (rounded
    down) and max (rounded up) over the keys it holds (``+inf`` / ``-inf`` where it holds none). ``N`` and every
    offset must be multiples of ``page_size``."""
    N, D = k_flat.shape
    held = _slot_rows(N, row_offsets, row_lengths)[:, None]
    inf = torch.tensor(float("inf"), dtype=k_flat.dtype, device=k_flat.device)
    kmin = torch.where(held, k_flat, inf).view(N // page_size, page_size, D).amin(1)
    kmax = torch.where(held, k_flat, -inf).view(N // page_size, page_size, D).amax(1)
    dtype = summary_dtype(k_flat.dtype)  # rounding is monotone: the rounded min is the min of the rounded keys
    return round_outward(kmin, dtype, up=False), round_outward(kmax, dtype, up=True)


def page_table(row_offsets: Tensor, n_slots: int, page_size: int) -> Tensor:
    """``[R, W]`` int64: flat page id of page ``j`` of row ``r`` (``-1`` past the row's capacity), ``W`` the most
    pages a row has room for. Rows in ascending offset order, each row's capacity up to the next one's offset."""
    offs = row_offsets.long()
    ends = torch.cat([offs[1:], offs.new_tensor([n_slots])])
    caps = (ends - offs) // page_size
    width = max(int(caps.max()) if caps.numel() else 0, 1)  # one host sync, at re-layout time
    j = torch.arange(width, device=offs.device)
    return torch.where(j < caps[:, None], offs[:, None] // page_size + j, -1)


def page_bounds(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, scale: float,
                softcap: float | None = None) -> Tensor:
    """``[B, H_kv, G * Q, W]`` fp32: an upper bound of each query's logit (``scale * q . k``, soft-capped when
    ``softcap``: a monotone map) over every entry of page ``j`` of its kv row, for ``q [B, H_q, Q, D]``, computed in
    float32 from the summaries (any float dtype); ``-inf`` for a page past the row's capacity or that holds
    nothing. A summary rounded out to ``+-inf`` (a key past its 16-bit range) counts as float32's extreme: the
    bound is then at least ``|q_d| * 3.4e38`` (``+inf`` once that overflows) for a query channel of its sign, and
    ``+inf`` where overflowing terms of both signs meet. No host sync. Eager CPU calls run the fused kernel
    (:mod:`.sparse_cpu_kernel`: the summaries read where they lie), traced and other calls this torch code."""
    fused = page_bounds_cpu(q, kmin, kmax, table, scale, softcap)
    if fused is not None:
        return fused
    B, Hq, Q, D = q.shape
    R, W = table.shape
    page = table.clamp(min=0)
    lo, hi = kmin[page].float(), kmax[page].float()  # [R, W, D]
    empty = (table < 0) | (lo[..., 0] > hi[..., 0])  # [R, W]: a page holding nothing (+inf / -inf)
    top = torch.finfo(torch.float32).max  # a summary rounded out to +-inf: the float32 extreme (0 * inf is NaN)
    lo, hi = lo.clamp(min=-top), hi.clamp(max=top)
    qs = q.float().reshape(R, (Hq // (R // B)) * Q, D) * scale
    bound = (torch.bmm(qs.clamp(min=0), hi.transpose(1, 2))
             + torch.bmm(qs.clamp(max=0), lo.transpose(1, 2)))  # [R, GQ, W]
    bound = torch.where(torch.isnan(bound), float("inf"), bound)  # overflowing terms of both signs: no bound
    if softcap:
        bound = softcap * torch.tanh(bound / softcap)
    return bound.masked_fill(empty[:, None, :], float("-inf")).view(B, R // B, -1, W)


# ----------------------------------------------------------------------------- append (custom op)
def _append_impl(k_new: Tensor, kmin: Tensor, kmax: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                 page_size: int) -> None:
    if append_summaries_cpu(k_new, kmin, kmax, row_offsets, row_lengths, page_size):  # CPU: the fused kernel
        return
    _append_ref(k_new, kmin, kmax, row_offsets, row_lengths, page_size)


def _append_ref(k_new: Tensor, kmin: Tensor, kmax: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                page_size: int) -> None:
    """The torch code of :func:`append_summaries` (two ``scatter_reduce_``)."""
    B, H, Q, D = k_new.shape
    first = row_offsets.long() + row_lengths.long() - Q  # the new entries' first slot in each row
    pages = ((first[:, None] + torch.arange(Q, device=first.device)) // page_size).reshape(-1, 1).expand(-1, D)
    keys = k_new.reshape(-1, D)
    kmin.scatter_reduce_(0, pages, round_outward(keys, kmin.dtype, up=False), "amin", include_self=True)
    kmax.scatter_reduce_(0, pages, round_outward(keys, kmax.dtype, up=True), "amax", include_self=True)


_append_op = torch.library.custom_op("kvpress_ada::append_page_summaries", _append_impl,
                                     mutates_args=("kmin", "kmax"))


@_append_op.register_fake
def _(k_new, kmin, kmax, row_offsets, row_lengths, page_size):
    _check_append(k_new, kmin, kmax, row_offsets, row_lengths)


def _check_append(k_new: Tensor, kmin: Tensor, kmax: Tensor, row_offsets: Tensor, row_lengths: Tensor) -> None:
    if k_new.dim() != 4 or k_new.shape[0] * k_new.shape[1] != row_offsets.shape[0]:
        raise ValueError(f"k_new {tuple(k_new.shape)} must be [B, H_kv, Q, D] with B * H_kv = "
                         f"{row_offsets.shape[0]} rows")
    if kmin.shape != kmax.shape or kmin.dim() != 2 or kmin.shape[1] != k_new.shape[-1]:
        raise ValueError(f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} must both be "
                         f"[pages, D={k_new.shape[-1]}]")
    if row_lengths.shape != row_offsets.shape:
        raise ValueError(f"row_lengths {tuple(row_lengths.shape)} and row_offsets {tuple(row_offsets.shape)} differ")


def append_summaries(k_new: Tensor, kmin: Tensor, kmax: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                     page_size: int) -> None:
    """Reduce ``k_new [B, H_kv, Q, D]``, just appended (``row_lengths`` counts them already), into the summaries
    of their pages, in place: each key rounded down into ``kmin`` and up into ``kmax`` (:func:`round_outward`, to
    the summaries' dtype). Device-side index ops (no host sync); on CPU the fused kernel
    (:func:`~.sparse_cpu_kernel.append_summaries_cpu`: the same bits), in a compiled step too."""
    _check_append(k_new, kmin, kmax, row_offsets, row_lengths)
    if not torch.compiler.is_compiling() and all(type(t) is Tensor for t in (k_new, kmin, kmax)):
        _append_impl(k_new, kmin, kmax, row_offsets, row_lengths, int(page_size))
        return
    _append_op(k_new, kmin, kmax, row_offsets, row_lengths, int(page_size))


# ----------------------------------------------------------------------------- sparse attention (custom op)
def _listed_pages(table: Tensor, selected: Tensor) -> tuple[Tensor, Tensor, int]:
    """``(js [R, M], counts [R], M)``: each row's selected pages (places ``j`` in the row, page order; rows that
    read fewer than ``M``, the most any row reads, padded with 0) and how many it reads. One host sync (``M``)."""
    R, W = table.shape
    dev = table.device
    sel = selected & (table >= 0)
    counts = sel.sum(-1)
    M = max(int(counts.max()), 1) if R else 1
    col = torch.where(sel, torch.cumsum(sel, -1) - 1, M)  # each selected page's place among its row's (M: dropped)
    js = torch.zeros(R, M + 1, dtype=torch.long, device=dev).scatter_(
        1, col, torch.arange(W, device=dev).expand(R, W))[:, :M]
    return js, counts, M


def _attend(q: Tensor, kc: Tensor, vc: Tensor, js: Tensor, counts: Tensor, row_lengths: Tensor, page_size: int,
            scale: float, softcap: float, sinks: Tensor | None) -> Tensor:
    """float32 ``[B, H_q, Q, D]``: each row's query group over the keys and values of its listed pages,
    ``kc, vc`` float32 ``[R, M * P, D]`` in list order (the entries each query sees: bottom-right causal)."""
    B, Hq, Q, D = q.shape
    R, M = js.shape
    GQ = (Hq // (R // B)) * Q
    P = page_size
    dev = q.device
    seen = torch.where(torch.arange(M, device=dev) < counts[:, None], row_lengths.long()[:, None] - js * P, 0)
    ahead = torch.arange(Q - 1, -1, -1, device=dev).repeat(GQ // Q)  # [GQ]: Q - 1 - i (bottom-right causal)
    limit = seen[:, None, :, None] - ahead[None, :, None, None]  # [R, GQ, M, 1]
    visible = (torch.arange(P, device=dev) < limit).view(R, GQ, M * P)
    qr = (q.float() * scale).reshape(R, GQ, D)
    s = torch.bmm(qr, kc.transpose(1, 2))  # [R, GQ, M * P]
    if softcap:
        capped(s, softcap)
    s.masked_fill_(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sinks is not None:  # [R, GQ, 1]: query head h * G + g of row b * H_kv + h, for each of its Q queries
        sink = sinks.float().view(1, R // B, GQ // Q, 1).expand(B, -1, -1, Q).reshape(R, GQ, 1)
        m = torch.maximum(m, sink)
    m = m.clamp_min(torch.finfo(torch.float32).min)  # rows that see nothing: exp(-inf - finite) = 0
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    return (torch.bmm(p, vc) / denom.clamp_min(torch.finfo(torch.float32).tiny)).view(B, Hq, Q, D)


def sparse_attention_ref(q: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                         table: Tensor, selected: Tensor, page_size: int, scale: float, softcap: float = 0.0,
                         sinks: Tensor | None = None) -> Tensor:
    """Torch reference of :func:`sparse_ragged_attention`: each row's selected pages gathered in page order
    (``[R, M * P, D]``, ``M`` the most pages a row reads; rows that read fewer are padded and masked), scored
    against the row's query group in one batched ``bmm``, a softmax, one more ``bmm`` for the values. Reads only
    the selected pages (and the padding of rows that read fewer than ``M``)."""
    R = table.shape[0]
    D = q.shape[-1]
    P = page_size
    js, counts, M = _listed_pages(table, selected)
    pages = table.gather(1, js).clamp(min=0).view(-1)  # whole pages copied (P * D contiguous elements each)
    kc = k_flat.view(-1, P, D).index_select(0, pages).view(R, M * P, D)
    vc = v_flat.view(-1, P, D).index_select(0, pages).view(R, M * P, D)
    if kc.dtype != torch.float32:
        kc, vc = kc.float(), vc.float()
    return _attend(q, kc, vc, js, counts, row_lengths, P, scale, softcap, sinks).to(q.dtype)


def _sparse_impl(q: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor, table: Tensor,
                 selected: Tensor, page_size: int, scale: float, softcap: float = 0.0,
                 sinks: Tensor | None = None) -> Tensor:
    if q.numel() == 0:
        return torch.zeros_like(q)
    if resolve_backend(q.device, q.shape[-1]) == "triton":
        return triton_module("ragged.sparse_triton_kernel").sparse_attention_triton(
            q, k_flat, v_flat, row_lengths, table, selected, page_size, scale, softcap=softcap, sinks=sinks)
    fused = sparse_attention_cpu(q, k_flat, v_flat, row_lengths, table, selected, page_size, scale, softcap, sinks)
    if fused is not None:
        return fused
    return sparse_attention_ref(q, k_flat, v_flat, row_offsets, row_lengths, table, selected, page_size, scale,
                                softcap, sinks)


_sparse_op = torch.library.custom_op("kvpress_ada::sparse_ragged_attention", _sparse_impl, mutates_args=())


@_sparse_op.register_fake
def _(q, k_flat, v_flat, row_offsets, row_lengths, table, selected, page_size, scale, softcap=0.0, sinks=None):
    _check_sparse(q, k_flat, v_flat, row_offsets, row_lengths, table, selected, page_size, softcap, sinks)
    return torch.empty_like(q)


def _check_sparse(q: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor, table: Tensor,
                  selected: Tensor, page_size: int, softcap: float | None, sinks: Tensor | None,
                  records: bool = False) -> float:
    """Raise a one-line error on arguments :func:`sparse_ragged_attention` (``records``: of
    :func:`sparse_quantized_attention`) cannot take; return the soft-cap."""
    if q.dim() != 4 or k_flat.dim() != 2 or k_flat.shape != v_flat.shape or (
            not records and q.shape[-1] != k_flat.shape[-1]) or (records and k_flat.dtype != torch.uint8):
        what = "uint8 records [N, width]" if records else "[N, D] of the same D"
        raise ValueError(f"q {tuple(q.shape)} must be [B, H_q, Q, D] and k_flat {tuple(k_flat.shape)}, v_flat "
                         f"{tuple(v_flat.shape)} both {what}")
    R = row_offsets.shape[0]
    B = q.shape[0]
    if B == 0 or R % B or q.shape[1] % (R // B):
        raise ValueError(f"{R} cache rows do not split into batch {B} x kv heads dividing H_q={q.shape[1]}")
    if row_lengths.shape != row_offsets.shape:
        raise ValueError(f"row_lengths {tuple(row_lengths.shape)} and row_offsets {tuple(row_offsets.shape)} differ")
    if table.dim() != 2 or table.shape[0] != R or selected.shape != table.shape or selected.dtype != torch.bool:
        raise ValueError(f"table {tuple(table.shape)} must be [R={R}, W] and selected a bool mask of its shape, got "
                         f"{selected.dtype} {tuple(selected.shape)}")
    if page_size < 1 or k_flat.shape[0] % page_size:
        raise ValueError(f"page_size={page_size} must divide the {k_flat.shape[0]} slots of the cache")
    return check_logit_extras(softcap, sinks, q.shape[1], q.device)


def sparse_ragged_attention(q: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                            table: Tensor, selected: Tensor, page_size: int, scale: float, *,
                            softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """:func:`~.ops.ragged_attention` over the entries of the selected pages only.

    ``table [R, W]``: flat page ids of each row's pages (:func:`page_table`); ``selected [R, W]`` bool: the pages
    row ``r`` reads (a page past the row's capacity is never read). Query ``i`` of ``Q`` sees the selected
    entries among the first ``row_lengths[r] - (Q - 1 - i)`` of its row (bottom-right causal); a query that sees
    nothing outputs 0. ``softcap`` and ``sinks`` as in ragged attention. With every page selected this is
    ragged attention (the same sums, in another order: equal to float rounding). Returns ``[B, H_q, Q, D]`` in
    ``q.dtype`` (fp32 accumulation)."""
    cap = _check_sparse(q, k_flat, v_flat, row_offsets, row_lengths, table, selected, page_size, softcap, sinks)
    args = (q, k_flat, v_flat, row_offsets, row_lengths, table, selected)
    if not torch.compiler.is_compiling() and all(type(t) is Tensor for t in args) and (
            sinks is None or type(sinks) is Tensor):
        return _sparse_impl(*args, int(page_size), float(scale), cap, sinks)
    return _sparse_op(*args, int(page_size), float(scale), cap, sinks)


# ----------------------------------------------------------------------------- over quantized records (custom op)
def sparse_quantized_attention_ref(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor,
                                   row_lengths: Tensor, side: Tensor, table: Tensor, selected: Tensor, page_size: int,
                                   scale: float, layout: RecordLayout, softcap: float = 0.0,
                                   sinks: Tensor | None = None) -> Tensor:
    """Torch reference of :func:`sparse_quantized_attention`: each row's selected pages of records gathered in page
    order and dequantized (only those: ``[R, M * P, D]`` float32, keys in the records' space ``y``), the slots a row
    reads in full precision (its anchor at rank 0, its residual ring's newest entries:
    :func:`~..quantized.scheme.side_slots`) taken from ``side``, then the rotated query attends as in
    :func:`sparse_attention_ref` (the rows' rotated centres added to the keys when ``softcap`` or ``sinks`` need
    ``q . k`` itself, as :func:`~..quantized.scheme.quantized_attention_ref` does)."""
    R = table.shape[0]
    D = q.shape[-1]
    P = page_size
    js, counts, M = _listed_pages(table, selected)
    pages = table.gather(1, js).clamp(min=0).view(-1)
    width = k_rec.shape[1]
    kc = dequantize(k_rec.view(-1, P, width).index_select(0, pages), D, layout, q.dtype, torch.float32)
    vc = dequantize(v_rec.view(-1, P, width).index_select(0, pages), D, layout, q.dtype, torch.float32)
    kc, vc = kc.view(R, M * P, D), vc.view(R, M * P, D)
    residual = residual_of(side)
    rank = ((js * P)[:, :, None] + torch.arange(P, device=q.device)).view(R, M * P)  # each slot's rank in its row
    full = side_operands(side, layout)  # [2 (1 + residual), rows, D]: anchor and ring keys, then values
    src = torch.where(rank == 0, 0, -1)
    if residual:  # rank k >= 1 among the row's newest `residual` reads its ring slot k % residual
        newest = (rank >= 1) & (rank >= row_lengths.long()[:, None] - residual)
        src = torch.where(newest, 1 + torch.remainder(rank, residual), src)
    pick = src.clamp(min=0)[..., None].expand(R, M * P, D)
    exact = (src >= 0)[..., None]
    kc = torch.where(exact, full[:1 + residual].transpose(0, 1).gather(1, pick), kc)
    vc = torch.where(exact, full[1 + residual:].transpose(0, 1).gather(1, pick), vc)
    rotation = key_rotation(layout, D, q.device)
    if softcap or sinks is not None:  # both need q . k itself, not q . (k - c)
        centre = side[2].float()
        kc = kc + (centre if rotation is None else centre @ rotation)[:, None, :]
    q_rot = q.float() if rotation is None else q.float() @ rotation
    return _attend(q_rot, kc, vc, js, counts, row_lengths, P, scale, softcap, sinks).to(q.dtype)


def _sparse_quantized_impl(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                           side: Tensor, table: Tensor, selected: Tensor, page_size: int, scale: float,
                           layout: RecordLayout, softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    if q.numel() == 0:
        return torch.zeros_like(q)
    if resolve_backend(q.device, q.shape[-1]) == "triton":
        return triton_module("quantized.sparse_triton_kernel").sparse_quantized_attention_triton(
            q, k_rec, v_rec, row_lengths, side, table, selected, page_size, scale, layout, softcap=softcap, sinks=sinks)
    fused = sparse_quantized_attention_cpu(q, k_rec, v_rec, row_lengths, side, table, selected, page_size, scale,
                                           layout, softcap, sinks)
    if fused is not None:
        return fused
    return sparse_quantized_attention_ref(q, k_rec, v_rec, row_offsets, row_lengths, side, table, selected,
                                          page_size, scale, layout, softcap, sinks)


@torch.library.custom_op("kvpress_ada::sparse_quantized_attention", mutates_args=())
def _sparse_quantized_op(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                         side: Tensor, table: Tensor, selected: Tensor, page_size: int, scale: float, encoding: str,
                         fields: list[int], softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """Raw op behind :func:`sparse_quantized_attention` (no validation): ``encoding`` and ``fields`` (the other record
    fields a quantized op receives, as integers) rebuild the layout."""
    layout = op_layout(encoding, *cast(list[Any], fields))  # bits, group, rotate_keys (0 / 1), ...
    return _sparse_quantized_impl(q, k_rec, v_rec, row_offsets, row_lengths, side, table, selected, page_size, scale,
                                  layout, softcap, sinks)


@_sparse_quantized_op.register_fake
def _(q, k_rec, v_rec, row_offsets, row_lengths, side, table, selected, page_size, scale, encoding, fields,
      softcap=0.0, sinks=None):
    return torch.empty_like(q)


def sparse_quantized_attention(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                               side: Tensor, table: Tensor, selected: Tensor, page_size: int, scale: float,
                               layout: RecordLayout, *, softcap: float | None = None,
                               sinks: Tensor | None = None) -> Tensor:
    """:func:`~..quantized.ops.quantized_attention` over the entries of the selected pages only (``table``,
    ``selected``, ``page_size``: as :func:`sparse_ragged_attention`): rows of records ``k_rec, v_rec uint8 [N,
    width]`` of ``layout`` with their ``side`` tensors, each non-empty row's first entry read as its anchor and
    its newest ``residual`` entries from its ring, only the selected pages' records dequantized. The Triton kernel
    on CUDA (:mod:`..quantized.sparse_triton_kernel`; as :func:`sparse_ragged_attention` dispatches); on CPU the
    fused kernel for decode-shaped calls (at most :data:`~..quantized.cpu_kernel.MAX_QUERIES` queries per row;
    ``KVPRESS_ADA_CPU_KERNEL=0`` or ``use_cpu_kernel(False)``: the torch reference), the torch reference otherwise.
    With every page selected this is quantized attention (the same read-back keys and values; sums in another
    order)."""
    cap = _check_sparse(q, k_rec, v_rec, row_offsets, row_lengths, table, selected, page_size, softcap, sinks,
                        records=True)
    check_side(side, row_offsets.shape[0], q.shape[-1], q.dtype, q.device)
    args = (q, k_rec, v_rec, row_offsets, row_lengths, side, table, selected)
    if not torch.compiler.is_compiling() and all(type(t) is Tensor for t in args) and (
            sinks is None or type(sinks) is Tensor):
        return _sparse_quantized_impl(*args, int(page_size), float(scale), layout.records(), cap, sinks)
    encoding, *fields = op_fields(layout)
    return _sparse_quantized_op(*args, int(page_size), float(scale), encoding, [int(f) for f in fields], cap, sinks)
