"""Quantized entries of the ragged cache: the record layout, quantize / dequantize, and the torch
reference of ragged attention over quantized rows (the CPU path).

Scheme: asymmetric integers per token, in groups of ``group`` channels of the head dimension. A group
``x[0..group)`` is stored as ``zero = min(x)`` and ``scale = (max(x) - zero) / (2^bits - 1)`` (rounded
*up* to the entries' dtype, so the top of the range stays covered) and integers
``q = round((x - zero) / scale)`` in ``[0, 2^bits - 1]``; it reads back as ``q * scale + zero``.
``zero`` is exact (it is one of the entries, already in their dtype), so every element is within
``scale / 2`` of its original (plus float32 rounding of the arithmetic, and the rounding of the result
when it is read back in a 16-bit dtype); a constant group (``scale = 0``) reads back exactly.

Record: each token of a key (or value) row is one ``uint8`` row of :func:`record_width` bytes, the
integers followed by that token's scales and zero points (as llama.cpp's ``Q4_1`` block keeps its
``d`` and ``m`` beside its nibbles)::

    [ integers: head_dim * bits / 8 bytes | scales: head_dim / group x dtype | zeros: head_dim / group x dtype ]

int8: one byte per channel; int4: two channels per byte, channel ``j`` in the low nibble of byte
``j`` and channel ``j + head_dim / 2`` in its high nibble (unpacking is two whole-half operations).
A token is quantized on its own, so a ragged row appends in place and every row-level operation of
the full-precision cache (compaction, append, re-layout, gather) moves records as plain bytes.
Free slots are zero bytes: they read back as 0, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import ragged_attention_ref

__all__ = [
    "BITS",
    "record_width",
    "check_record",
    "quantize",
    "dequantize",
    "record_scales",
    "quantized_append_ref",
    "quantized_compact_ref",
    "quantized_attention_ref",
]

BITS = (4, 8)
"""Integer widths a record can hold."""
_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def record_width(head_dim: int, bits: int, group: int, dtype: torch.dtype) -> int:
    """Bytes of one token's record: ``head_dim * bits / 8 + 2 * (head_dim / group) * itemsize(dtype)``."""
    check_record(head_dim, bits, group, dtype)
    return head_dim * bits // 8 + 2 * (head_dim // group) * dtype.itemsize


def check_record(head_dim: int, bits: int, group: int, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` when no record holds ``head_dim`` channels of ``dtype`` as ``bits``-bit integers in
    groups of ``group``."""
    if bits not in BITS:
        raise ValueError(f"bits={bits}: records hold {' or '.join(map(str, BITS))}-bit integers")
    if group <= 0 or group % 2 or head_dim % group:
        raise ValueError(f"group={group} must be even and divide head_dim={head_dim}")
    if dtype not in _SCALE_DTYPES:
        raise ValueError(f"records quantize float32, float16 or bfloat16 entries, not {dtype}")


def _round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` (float32, >= 0) in ``dtype``, rounded up: the stored value is never below ``x``."""
    stored = x.to(dtype)
    if dtype == torch.float32:
        return stored
    low = stored.float() < x
    bumped = (stored.view(torch.int16) + 1).view(dtype)  # the next representable value above (x >= 0)
    return torch.where(low, bumped, stored)


def _int_bytes(head_dim: int, bits: int) -> int:
    return head_dim * bits // 8


def quantize(x: Tensor, bits: int, group: int) -> Tensor:
    """Records ``uint8 [..., record_width]`` of ``x [..., D]`` (float32/float16/bfloat16; scales and zero
    points in ``x.dtype``). See the module docstring for the scheme and its bound."""
    *lead, D = x.shape
    check_record(D, bits, group, x.dtype)
    levels = (1 << bits) - 1
    xf = x.float().reshape(*lead, D // group, group)
    zero, top = torch.aminmax(xf, dim=-1)  # zero is exact in x.dtype: it is one of the entries
    scale = _round_up((top - zero) / levels, x.dtype)
    sf = scale.float()
    q = (xf - zero[..., None]).div_(torch.where(sf > 0, sf, 1.0)[..., None]).round_().clamp_(0, levels)
    q = q.to(torch.uint8).reshape(*lead, D)
    if bits == 4:
        q = q[..., : D // 2] | (q[..., D // 2:] << 4)
    scales = scale.contiguous().view(torch.uint8)
    zeros = zero.to(x.dtype).contiguous().view(torch.uint8)
    return torch.cat([q, scales, zeros], dim=-1)


def record_scales(records: Tensor, head_dim: int, bits: int, group: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(integers uint8 [..., D * bits / 8], scales [..., D / group], zeros [..., D / group])`` of ``records``
    (scales and zeros in ``dtype``; views when ``records`` is contiguous)."""
    n_int = _int_bytes(head_dim, bits)
    n_scale = head_dim // group * dtype.itemsize
    if records.shape[-1] != n_int + 2 * n_scale:
        raise ValueError(f"records of width {records.shape[-1]} do not hold head_dim={head_dim} at {bits} bits in "
                         f"groups of {group} ({dtype}): expected width {n_int + 2 * n_scale}")
    if records.dtype != torch.uint8:
        raise TypeError(f"records are uint8, got {records.dtype}")

    def floats(lo: int, hi: int) -> Tensor:
        part = records[..., lo:hi]
        return part.view(dtype) if part.stride(-1) == 1 and records.is_contiguous() else part.contiguous().view(dtype)

    return records[..., :n_int], floats(n_int, n_int + n_scale), floats(n_int + n_scale, n_int + 2 * n_scale)


def dequantize(records: Tensor, head_dim: int, bits: int, group: int, dtype: torch.dtype,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """``[..., head_dim]`` entries of ``records`` (made by :func:`quantize` from entries of ``dtype``), computed
    in float32 and returned in ``out_dtype`` (default ``dtype``)."""
    ints, scale, zero = record_scales(records, head_dim, bits, group, dtype)
    *lead, _ = records.shape
    n_groups = head_dim // group
    # (scales and zeros made contiguous first: broadcasting a strided view is several times slower on CPU)
    scale, zero = scale.float().contiguous(), zero.float().contiguous()
    half = head_dim // 2
    if bits == 8:
        q = ints.reshape(*lead, n_groups, group)
    elif half % group and group != head_dim:  # a group straddles the two halves (e.g. head dim 96, groups of 32)
        q = torch.cat((ints & 15, ints >> 4), dim=-1).view(*lead, n_groups, group)
    else:  # both nibbles masked (no shift): a high nibble reads as 16 q, so its scale is scale / 16
        per_half = max(n_groups // 2, 1)  # groups in each half (a group of head_dim spans both)
        q = torch.cat((ints & 15, ints & 240), dim=-1).view(*lead, 2, per_half, half // per_half)
        scale = scale.view(*lead, -1, per_half).expand(*lead, 2, per_half).clone()
        scale[..., 1, :] *= 1 / 16
        zero = zero.view(*lead, -1, per_half).expand(*lead, 2, per_half)
    # convert, then scale and shift in place (on CPU faster than a mixed uint8 * float product or addcmul)
    out = q.float().mul_(scale[..., None]).add_(zero[..., None]).reshape(*lead, head_dim)
    target = dtype if out_dtype is None else out_dtype
    return out if target == torch.float32 else out.to(target)


def quantized_append_ref(k_new: Tensor, v_new: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor,
                         row_lengths: Tensor, bits: int, group: int) -> None:
    """Quantize ``k_new, v_new [B, H_kv, Q, D]`` and append their records at ``row_offsets + row_lengths``
    (in place), then ``row_lengths += Q``. Device-side index ops only (no host sync)."""
    B, H, Q, _ = k_new.shape
    start = row_offsets.to(torch.int64) + row_lengths.to(torch.int64)
    dst = (start.unsqueeze(1) + torch.arange(Q, device=start.device)).reshape(-1)
    records = quantize(torch.stack((k_new, v_new)), bits, group).view(2, B * H * Q, -1)  # one pass for both
    k_rec.index_copy_(0, dst, records[0])
    v_rec.index_copy_(0, dst, records[1])
    row_lengths.add_(Q)


def quantized_compact_ref(keys: Tensor, values: Tensor, keep: Tensor, row_offsets: Tensor, k_rec: Tensor,
                          v_rec: Tensor, bits: int, group: int) -> None:
    """Quantize the kept entries of ``keys, values [B, H_kv, L, D]`` (``keep`` bool ``[B, H_kv, L]``) into
    row ``b * H_kv + h`` of the records, in ascending position order from ``row_offsets``; only kept
    entries are quantized. The caller sets ``row_lengths`` to the counts."""
    H = keys.shape[1]
    b, h, pos = keep.nonzero(as_tuple=True)
    if b.numel() == 0:
        return
    rank = torch.cumsum(keep, dim=-1, dtype=torch.int64)[b, h, pos] - 1
    dst = row_offsets.to(torch.int64)[b * H + h] + rank
    k_rec.index_copy_(0, dst, quantize(keys[b, h, pos], bits, group))
    v_rec.index_copy_(0, dst, quantize(values[b, h, pos], bits, group))


def quantized_attention_ref(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                            scale: float, bits: int, group: int) -> Tensor:
    """Ragged attention (contract of :func:`~.reference.ragged_attention_ref`) over quantized records made
    from entries of ``q.dtype``. The CPU path: the layer's records are dequantized to float32 in one
    vectorised pass (transient, one layer at a time) and attended by the full-precision reference, whose
    row-layout paths (batched, per row, loop-free split-K) apply unchanged."""
    D, N = q.shape[-1], k_rec.shape[0]
    kv = dequantize(torch.cat((k_rec, v_rec)), D, bits, group, q.dtype, torch.float32)  # one pass for both
    out = ragged_attention_ref(q.float(), kv[:N], kv[N:], row_offsets, row_lengths, scale)
    return out if q.dtype == torch.float32 else out.to(q.dtype)
