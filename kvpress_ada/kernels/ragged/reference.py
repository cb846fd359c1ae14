"""Plain torch reference implementations of the ragged-cache kernels (Ada-KV layout).

The ground truth for the Triton kernels and the production CPU path (no padded copies of the cache):

* rows of equal length and regular stride (uniform presses): one batched no-copy view;
* rows of different lengths: one ``[G*Q, D] @ [D, n]`` matmul per kv row (the GQA group reads the
  row once); the ground truth the other two are tested against;
* many short rows in a chunk-aligned layout (what ``RaggedLayer`` builds, mean length under
  :data:`LOOP_FREE_BELOW`): the loop-free split-K pass :func:`ragged_attention_chunked`. The
  crossover is measured in ``benchmarks/README.md`` (the compiled decode step).

Layout (see ``kvpress_ada.kernels``): row ``r = b * H_kv + h`` of one layer lives in
``k_flat[row_offsets[r] : row_offsets[r] + row_lengths[r]]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ragged_attention_ref", "ragged_attention_chunked", "chunk_aligned", "compact_ref", "append_ref", "capped",
           "sink_softmax", "CHUNK"]

CHUNK = 32
"""Tokens per chunk of the loop-free path; :class:`~kvpress_ada.hosts.transformers.RaggedLayer` aligns
every row's capacity (and so every row offset) to a multiple of it."""
LOOP_FREE = True
"""Allow :func:`ragged_attention_chunked` for rows of different lengths (when the layout is chunk
aligned and the rows are short, see :data:`LOOP_FREE_BELOW`); ``False`` forces one matmul pair per
row (a switch for measurements, ``benchmarks/decode.py --row-loop``)."""
LOOP_FREE_BELOW = 256
"""Mean row length under which the loop-free pass is used (a loop row's fixed cost, in entries of
the loop-free pass), for at least 4 rows."""


def capped(s: Tensor, softcap: float) -> Tensor:
    """Logit soft-capping (Gemma 2) in place: ``softcap * tanh(s / softcap)``, as transformers' eager attention."""
    return s.div_(softcap).tanh_().mul_(softcap)


def sink_softmax(s: Tensor, sink: Tensor) -> Tensor:
    """Softmax over the last dim of ``s`` with one more logit ``sink`` (broadcast to ``s[..., :1]``) in the
    denominator that takes probability mass and carries no value (GPT-OSS attention sinks). Logits of
    ``-inf`` get weight 0; a row of only ``-inf`` gets all zeros (the sink takes everything)."""
    m = torch.maximum(s.amax(-1, keepdim=True), sink)
    p = torch.exp(s - m)
    return p.div_(p.sum(-1, keepdim=True) + torch.exp(sink - m))


def _attend(q: Tensor, k: Tensor, v: Tensor, n: int, out: Tensor, softcap: float = 0.0,
            sink: Tensor | None = None) -> None:
    """Bottom-right aligned causal attention of ``q [..., G, Q, D]`` (fp32, pre-scaled)
    over ``k, v [..., n, D]``; writes ``out [..., G, Q, D]``. Queries that see nothing are
    left untouched (the caller zero-fills ``out``). ``softcap`` (0: off) caps the logits, ``sink``
    (broadcast to ``[..., G, 1, 1]``, fp32) joins each softmax's denominator."""
    *lead, G, Q, D = q.shape
    if n <= 0:
        return
    if Q > n:  # the first Q - n queries see no entry at all: leave them at 0
        q = q[..., Q - n :, :]
        out = out[..., Q - n :, :]
        Q = n
    # GQA group and queries folded into M: the kv row is read once for the whole group
    s = torch.matmul(q.reshape(*lead, G * Q, D), k.transpose(-1, -2))  # [..., G*Q, n]
    if softcap:
        capped(s, softcap)
    if Q > 1:
        # query i sees the first n - (Q - 1 - i) entries: only the last Q - 1 columns
        # can be masked.
        c0 = n - Q + 1
        i = torch.arange(Q, device=s.device).unsqueeze(-1)
        j = torch.arange(c0, n, device=s.device).unsqueeze(0)
        s.view(*lead, G, Q, n)[..., c0:].masked_fill_(j >= c0 + i, float("-inf"))
    if sink is None:
        p = torch.softmax(s, dim=-1)
    else:
        p = sink_softmax(s.view(*lead, G, Q, n), sink).view(*lead, G * Q, n)
    out.copy_(torch.matmul(p, v).view(*lead, G, Q, D))


def uniform_layout(offs: list[int], lens: list[int], R: int) -> bool:
    """Every row has the same length and rows sit at a regular stride (the batched no-copy path)."""
    if R < 2 or lens[0] <= 0:
        return False
    stride = offs[1] - offs[0]
    return (stride >= lens[0] and all(n == lens[0] for n in lens)
            and all(offs[r] == offs[0] + r * stride for r in range(R)))


def chunk_aligned(k_flat: Tensor, row_offsets: Tensor, offs: list[int] | None = None, chunk: int = CHUNK) -> bool:
    """Whether the layout suits :func:`ragged_attention_chunked`: contiguous storage of a whole number of
    chunks, rows in ascending order, each starting on a chunk boundary."""
    if not (k_flat.is_contiguous() and k_flat.shape[0] % chunk == 0 and k_flat.shape[0] > 0):
        return False
    offs = row_offsets.tolist() if offs is None else offs
    return all(o % chunk == 0 for o in offs) and all(a <= b for a, b in zip(offs, offs[1:]))


def ragged_attention_chunked(q: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                             scale: float, chunk: int = CHUNK, *, softcap: float | None = None,
                             sinks: Tensor | None = None) -> Tensor:
    """Loop-free ragged attention (split-K over fixed chunks, as the Triton kernel does).

    The flat buffers are viewed, without a copy, as ``[N / chunk, chunk, D]``; a chunk belongs to
    the row whose span starts at or before it (rows start on chunk boundaries, in ascending order;
    see :func:`chunk_aligned`). One ``bmm`` scores every chunk against its row's query group, a
    length mask hides the row's free slots, per-row maxima and sums combine the chunks
    (``scatter_reduce``/``index_add``), and one more ``bmm`` reads the values. No host sync and no
    Python loop over rows: the cost is the same for 3 rows or 300. Same contract as
    :func:`ragged_attention_ref` (bottom-right causal queries, 0 for a query that sees nothing,
    ``softcap`` and ``sinks``).
    """
    B, H_q, Q, D = q.shape
    R = row_offsets.shape[0]
    N = k_flat.shape[0]
    n_chunks = N // chunk
    GQ = (H_q // (R // B)) * Q
    dev = q.device
    low_precision = q.dtype != torch.float32
    kc, vc = k_flat.view(n_chunks, chunk, D), v_flat.view(n_chunks, chunk, D)
    if low_precision:
        kc, vc = kc.float(), vc.float()
    offs = row_offsets.to(torch.int64)
    starts = torch.arange(0, N, chunk, device=dev)
    row = torch.searchsorted(offs, starts, right=True) - 1  # [n_chunks] owning row
    row = row.clamp_min(0)
    # entries of its row that query i sees, counted from this chunk's start
    seen = row_lengths.to(torch.int64)[row] - (starts - offs[row])  # [n_chunks]
    ahead = torch.arange(Q - 1, -1, -1, device=dev).repeat(GQ // Q)  # [GQ]: Q - 1 - i
    limit = seen[:, None] - ahead[None, :]  # [n_chunks, GQ]
    qs = q.float().mul(scale) if low_precision or scale != 1.0 else q
    qr = qs.reshape(R, GQ, D)
    s = torch.bmm(qr.index_select(0, row), kc.transpose(1, 2))  # [n_chunks, GQ, chunk]
    if softcap:
        capped(s, softcap)
    hidden = torch.arange(chunk, device=dev)[None, None, :] >= limit[:, :, None]
    s.masked_fill_(hidden, float("-inf"))
    m = torch.full((R, GQ), float("-inf"), device=dev).scatter_reduce_(0, row[:, None].expand(-1, GQ), s.amax(-1),
                                                                         "amax")
    sink = None
    if sinks is not None:  # [R, GQ]: query head h * G + g of row b * H_kv + h, for each of its Q queries
        sink = sinks.float().view(1, R // B, GQ // Q, 1).expand(B, -1, -1, Q).reshape(R, GQ)
        m = torch.maximum(m, sink)
    m = m.clamp_min(torch.finfo(torch.float32).min)  # rows that see nothing: exp(-inf - finite) = 0
    p = torch.exp(s - m.index_select(0, row)[:, :, None])
    denom = torch.zeros(R, GQ, device=dev).index_add_(0, row, p.sum(-1))
    if sink is not None:
        denom += torch.exp(sink - m)
    out = torch.zeros(R, GQ, D, device=dev).index_add_(0, row, torch.bmm(p, vc))
    out = out / denom.clamp_min(torch.finfo(torch.float32).tiny)[:, :, None]
    return out.view(B, H_q, Q, D).to(q.dtype)


def ragged_attention_ref(q: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                         scale: float, *, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Reference ragged (Ada-KV) attention: ``softmax(scale * q k^T) v`` per kv row.

    ``q [B, H_q, Q, D]``; query heads ``h*G .. h*G+G-1`` share kv row ``b*H_kv + h``.
    Query ``i`` sees the first ``row_lengths[r] - (Q - 1 - i)`` entries of its row; a query
    that sees nothing outputs exactly 0. fp32 accumulation, output in ``q.dtype``.
    ``softcap`` (None / 0: off): logits ``l`` become ``softcap * tanh(l / softcap)`` (Gemma 2);
    ``sinks [H_q]``: one more logit per query head in each softmax's denominator, with no value
    (GPT-OSS). Inputs are not validated (see :func:`~.ops.ragged_attention`).
    """
    B, H_q, Q, D = q.shape
    R = row_offsets.shape[0]
    H_kv = R // B
    G = H_q // H_kv
    offs = row_offsets.tolist()
    lens = row_lengths.tolist()
    uniform = uniform_layout(offs, lens, R)
    if (LOOP_FREE and R >= 4 and sum(lens) < LOOP_FREE_BELOW * R and not uniform
            and chunk_aligned(k_flat, row_offsets, offs)):
        # many short rows of different lengths: every (batch, kv head) row in one pass, no loop per row
        return ragged_attention_chunked(q, k_flat, v_flat, row_offsets, row_lengths, scale, softcap=softcap,
                                        sinks=sinks)
    cap = float(softcap or 0.0)
    sink = None if sinks is None else sinks.float().view(H_kv, G, 1, 1)  # per query head, grouped by kv head
    low_precision = q.dtype != torch.float32
    qs = q.float() * scale if low_precision or scale != 1.0 else q
    if low_precision:
        out32 = torch.zeros(B, H_q, Q, D, dtype=torch.float32, device=q.device)
    else:
        out32 = torch.zeros_like(q, memory_format=torch.contiguous_format)
    qg = qs.view(B, H_kv, G, Q, D) if qs.is_contiguous() else qs.reshape(B, H_kv, G, Q, D)
    og = out32.view(B, H_kv, G, Q, D)

    if uniform and k_flat.is_contiguous() and v_flat.is_contiguous():
        # Every row has the same length and a regular stride: one batched no-copy view.
        n0, stride = lens[0], offs[1] - offs[0]

        def view(x: Tensor) -> Tensor:
            v_ = x.as_strided(
                (B, H_kv, n0, D),
                (H_kv * stride * D, stride * D, D, 1),
                x.storage_offset() + offs[0] * D,
            )
            return v_.float() if low_precision else v_

        _attend(qg, view(k_flat), view(v_flat), n0, og, cap, sink)
    else:
        for r in range(R):
            n = lens[r]
            if n <= 0:
                continue
            b, h = divmod(r, H_kv)
            o = offs[r]
            k = k_flat[o : o + n]
            v = v_flat[o : o + n]
            if low_precision:
                k, v = k.float(), v.float()
            if Q == 1:
                # hot decode path: [G, D] @ [D, n] -> softmax -> @ [n, D], written in place
                s = torch.mm(qg[b, h, :, 0], k.t())
                if cap:
                    capped(s, cap)
                p = torch.softmax(s, dim=-1) if sink is None else sink_softmax(s, sink[h, :, 0])
                o_view = og[b, h, :, 0]
                torch.mm(p, v, out=o_view)
            else:
                _attend(qg[b, h], k, v, n, og[b, h], cap, None if sink is None else sink[h])
    return out32 if not low_precision else out32.to(q.dtype)


def compact_ref(keys: Tensor, values: Tensor, keep: Tensor, row_offsets: Tensor, k_flat: Tensor,
                v_flat: Tensor) -> None:
    """Reference compaction: row ``r``'s kept tokens (ascending position) go to
    ``k_flat[row_offsets[r] + j]``, ``j = 0 .. count - 1``. One vectorised scatter."""
    B, H, L, D = keys.shape
    b, h, pos = keep.nonzero(as_tuple=True)
    if b.numel() == 0:
        return
    rank = torch.cumsum(keep, dim=-1, dtype=torch.int64)[b, h, pos] - 1
    dst = row_offsets.to(torch.int64)[b * H + h] + rank
    k_flat.index_copy_(0, dst, keys[b, h, pos])
    v_flat.index_copy_(0, dst, values[b, h, pos])


def append_ref(k_new: Tensor, v_new: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor,
               row_lengths: Tensor) -> None:
    """Append ``Q`` new tokens per row at ``row_offsets + row_lengths`` (in place), then
    ``row_lengths += Q``. Pure device-side index ops: no host sync, CUDA-graph friendly."""
    B, H, Q, D = k_new.shape
    R = B * H
    start = row_offsets.to(torch.int64) + row_lengths.to(torch.int64)  # [R]
    dst = (start.unsqueeze(1) + torch.arange(Q, device=start.device)).reshape(-1)
    k_flat.index_copy_(0, dst, k_new.reshape(R * Q, D))
    v_flat.index_copy_(0, dst, v_new.reshape(R * Q, D))
    row_lengths.add_(Q)
