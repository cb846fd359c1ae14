"""Paged per-(request, kv head) attention: the storage of a serving engine's pages, owned head by head.

Layout of one layer: ``k_pages, v_pages [P, S, D]`` (``S`` entries per page; strided views of one
engine tensor are fine as long as the head dim has unit stride), ``page_table [R, M]`` int32 and
``row_lengths [R]`` int32 with ``R = N * H_kv`` rows, row ``n * H_kv + h`` holding kv head ``h`` of
request ``n``: its entry ``j`` lives in page ``page_table[row, j // S]``, slot ``j % S`` (pages past a
row's length are never read; ``-1`` marks an unused table slot). Queries are packed over requests as
an engine does (``q [T, H_q, D]``, request ``n``'s tokens at ``query_start[n] : query_start[n + 1]``),
and the last of a request's ``Q`` tokens are its newest: token ``i`` of ``Q`` sees the first
``row_lengths[row] - (Q - 1 - i)`` entries of each of its rows (bottom-right causal, as the ragged
kernels; a token that sees nothing outputs 0). Query heads ``h*G .. h*G+G-1`` read kv head ``h``.

:func:`paged_attention` is a ``torch.library`` custom op with a fake kernel (compiles with
``fullgraph=True``); it runs the Triton kernel (:mod:`.triton_kernel`) on CUDA and the torch reference
(:func:`paged_attention_ref`) elsewhere, as chosen by :mod:`.support`. Like the ragged op it takes logit
soft-capping (``softcap``, Gemma 2) and attention sinks (``sinks [H_q]``, GPT-OSS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ragged.reference import capped, sink_softmax
from ..support import check_logit_extras, resolve_backend, triton_module

__all__ = ["paged_attention", "paged_attention_ref", "token_rows"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def token_rows(query_start: Tensor, n_tokens: int) -> tuple[Tensor, Tensor]:
    """``(request [T], ahead [T])`` int32 of packed queries: each token's request, and how many later
    tokens of its request this call holds (``Q - 1 - i``). Device ops only (no host sync)."""
    starts = query_start.long()
    counts = starts[1:] - starts[:-1]
    request = torch.repeat_interleave(torch.arange(counts.shape[0], device=starts.device), counts,
                                      output_size=n_tokens)
    ahead = starts[1:].index_select(0, request) - 1 - torch.arange(n_tokens, device=starts.device)
    return request.to(torch.int32), ahead.to(torch.int32)


def _gather_rows(k_pages: Tensor, v_pages: Tensor, table: Tensor, lengths: Tensor,
                 width: int) -> tuple[Tensor, Tensor, Tensor]:
    """float32 ``(keys, values [..., width, D], hidden bool [..., width])`` of the rows whose page ids are
    ``table [..., M]`` and lengths ``lengths [...]``: the first ``width`` slots of each row's pages, slots past
    its length ``hidden`` and their values zeroed (the rest of a last page, or pages a row does not hold, may
    hold anything, even NaN, which a zero softmax weight would not cancel)."""
    lead, D, S = table.shape[:-1], k_pages.shape[-1], k_pages.shape[1]
    pages = table[..., :-(-width // S)].long().clamp(min=0).reshape(-1)
    keys = k_pages.index_select(0, pages).view(*lead, -1, D)[..., :width, :].float()
    values = v_pages.index_select(0, pages).view(*lead, -1, D)[..., :width, :].float()
    hidden = torch.arange(width, device=table.device) >= lengths[..., None]
    return keys, values.masked_fill_(hidden[..., None], 0.0), hidden


def _probabilities(s: Tensor, sink: Tensor | None) -> Tensor:
    """Softmax of logits ``s`` (``-inf`` where hidden) with an optional sink logit (broadcast to ``s[..., :1]``);
    a query that sees nothing gets weight 0 everywhere."""
    if sink is None:
        return torch.softmax(s, dim=-1).nan_to_num_(0.0)
    return sink_softmax(s, sink)


def paged_attention_ref(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, row_lengths: Tensor,
                        query_start: Tensor, scale: float, *, softcap: float | None = None,
                        sinks: Tensor | None = None) -> Tensor:
    """The torch reference (and CPU path) of :func:`paged_attention`: request by request, the pages its
    rows use are gathered once and every token of the request attends over them; fp32 accumulation,
    output ``[T, H_q, D]`` in ``q.dtype``. ``softcap`` (None / 0: off) and ``sinks [H_q]``: as
    :func:`paged_attention` (not validated here)."""
    T, H_q, D = q.shape
    R, M = page_table.shape
    N = query_start.shape[0] - 1
    H_kv = R // max(N, 1)
    G = H_q // max(H_kv, 1)
    out = torch.zeros(T, H_q, D, dtype=torch.float32, device=q.device)
    starts = query_start.tolist()
    lengths = row_lengths.view(N, H_kv).long()
    longest = lengths.amax(-1).tolist() if N else []
    cap = float(softcap or 0.0)
    sink = None if sinks is None else sinks.float().view(H_kv, G, 1, 1)
    if N > 1 and starts == list(range(N + 1)):  # a decode batch, one token per request: every request at once
        return _decode_batch(q, k_pages, v_pages, page_table, lengths, max(longest), scale, cap,
                             None if sink is None else sink[..., 0]).to(q.dtype)
    for n in range(N):
        t0, t1 = starts[n], starts[n + 1]
        width = int(longest[n])
        if t1 == t0 or width <= 0:
            continue
        keys, values, _ = _gather_rows(k_pages, v_pages, page_table[n * H_kv:(n + 1) * H_kv], lengths[n], width)
        Q = t1 - t0
        if Q == width and not cap and sink is None and bool((lengths[n] == width).all()):
            # a fresh prefill: plain causal attention
            out[t0:t1] = F.scaled_dot_product_attention(
                q[t0:t1].float().transpose(0, 1)[None], keys[None], values[None], is_causal=True, scale=scale,
                enable_gqa=G > 1)[0].transpose(0, 1)
            continue
        qg = q[t0:t1].float().view(Q, H_kv, G, D).permute(1, 2, 0, 3).reshape(H_kv, G * Q, D)
        s = torch.bmm(qg, keys.transpose(1, 2)).mul_(scale).view(H_kv, G, Q, width)
        if cap:
            capped(s, cap)
        ahead = torch.arange(Q - 1, -1, -1, device=q.device)
        visible = lengths[n][:, None] - ahead[None, :]  # [H_kv, Q] entries each token sees in each row
        hidden = torch.arange(width, device=q.device)[None, None, :] >= visible[:, :, None]
        s.masked_fill_(hidden[:, None], float("-inf"))
        p = _probabilities(s, sink)  # a token that sees nothing: 0
        o = torch.bmm(p.view(H_kv, G * Q, width), values).view(H_kv, G, Q, D)
        out[t0:t1] = o.permute(2, 0, 1, 3).reshape(Q, H_q, D)
    return out.to(q.dtype)


def _decode_batch(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, lengths: Tensor, width: int,
                  scale: float, softcap: float = 0.0, sink: Tensor | None = None) -> Tensor:
    """:func:`paged_attention_ref` of one token per request (``q [N, H_q, D]``, ``lengths [N, H_kv]``): the pages of
    every row gathered at once, ``width`` the longest row; fp32 ``[N, H_q, D]``. ``sink [H_kv, G, 1]``: fp32."""
    N, H_q, D = q.shape
    H_kv = lengths.shape[1]
    if width <= 0:
        return torch.zeros(N, H_q, D, dtype=torch.float32, device=q.device)
    keys, values, hidden = _gather_rows(k_pages, v_pages, page_table.reshape(N, H_kv, -1), lengths, width)
    s = torch.matmul(q.float().view(N, H_kv, H_q // H_kv, D), keys.transpose(-1, -2)).mul_(scale)
    if softcap:
        capped(s, softcap)
    s.masked_fill_(hidden[:, :, None, :], float("-inf"))
    p = _probabilities(s, sink)  # a row that holds nothing: 0
    return torch.matmul(p, values).view(N, H_q, D)


def _validate(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, row_lengths: Tensor,
              query_start: Tensor, softcap: float | None = None, sinks: Tensor | None = None) -> float:
    """Raise on bad arguments; return the soft-cap as a float (0.0: off)."""
    for name, x, ndim in (("q", q, 3), ("k_pages", k_pages, 3), ("v_pages", v_pages, 3),
                          ("page_table", page_table, 2), ("row_lengths", row_lengths, 1),
                          ("query_start", query_start, 1)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} differ in shape")
    if q.dtype not in _FLOAT_DTYPES or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise TypeError(f"q, k_pages and v_pages must share one of {_FLOAT_DTYPES}, got {q.dtype}, "
                        f"{k_pages.dtype}, {v_pages.dtype}")
    if q.shape[-1] != k_pages.shape[-1] or k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError(f"head dims must agree with a unit stride: q {tuple(q.shape)}, pages {tuple(k_pages.shape)}")
    for name, x in (("page_table", page_table), ("row_lengths", row_lengths), ("query_start", query_start)):
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 (or int64), got {x.dtype}")
    R, N = page_table.shape[0], query_start.shape[0] - 1
    if row_lengths.shape[0] != R or N < 1 or R % N or q.shape[1] % (R // N):
        raise ValueError(f"{R} rows (page_table, row_lengths {tuple(row_lengths.shape)}) must be {N} requests x kv "
                         f"heads, and the kv heads must divide the {q.shape[1]} query heads")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages), ("page_table", page_table),
                    ("row_lengths", row_lengths), ("query_start", query_start)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    return check_logit_extras(softcap, sinks, q.shape[1], q.device)


def _impl(q, k_pages, v_pages, page_table, row_lengths, query_start, scale, softcap=0.0, sinks=None):
    if q.numel() == 0:
        return torch.zeros_like(q)
    if resolve_backend(q.device, q.shape[-1]) == "triton":
        request, ahead = token_rows(query_start, q.shape[0])
        kv_heads = page_table.shape[0] // (query_start.shape[0] - 1)
        kernel = triton_module("paged.triton_kernel").paged_attention_triton
        return kernel(q, k_pages, v_pages, page_table, row_lengths, request, ahead, kv_heads, scale, softcap=softcap,
                      sinks=sinks)
    return paged_attention_ref(q, k_pages, v_pages, page_table, row_lengths, query_start, scale, softcap=softcap,
                               sinks=sinks)


@torch.library.custom_op("kvpress_ada::paged_attention", mutates_args=())
def _paged_attention_op(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, row_lengths: Tensor,
                        query_start: Tensor, scale: float, softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    return _impl(q, k_pages, v_pages, page_table, row_lengths, query_start, scale, softcap, sinks)


@_paged_attention_op.register_fake
def _(q, k_pages, v_pages, page_table, row_lengths, query_start, scale, softcap=0.0, sinks=None):
    _validate(q, k_pages, v_pages, page_table, row_lengths, query_start, softcap, sinks)
    return torch.empty_like(q)


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, row_lengths: Tensor,
                    query_start: Tensor, scale: float, *, softcap: float | None = None,
                    sinks: Tensor | None = None) -> Tensor:
    """``softmax(scale * q k^T) v`` of packed queries ``q [T, H_q, D]`` over per-(request, kv head) paged
    rows (the layout in the module docstring): ``[T, H_q, D]`` in ``q.dtype``, fp32 accumulation.
    ``softcap`` (Gemma 2; None or 0: off): logits ``l`` become ``softcap * tanh(l / softcap)``; ``sinks``
    (GPT-OSS): a float tensor ``[H_q]``, one logit per query head in each softmax denominator, carrying no
    value (a token that sees nothing outputs 0 either way)."""
    cap = _validate(q, k_pages, v_pages, page_table, row_lengths, query_start, softcap, sinks)
    tensors = (q, k_pages, v_pages, page_table, row_lengths, query_start)
    plain = all(type(t) is Tensor for t in tensors) and (sinks is None or type(sinks) is Tensor)
    if not torch.compiler.is_compiling() and plain:
        return _impl(*tensors, float(scale), cap, sinks)
    return _paged_attention_op(*tensors, float(scale), cap, sinks)
