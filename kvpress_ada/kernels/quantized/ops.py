"""``torch.library`` custom ops over quantized records (layout and scheme: :mod:`.quantized`).

Like the full-precision ops of :mod:`..ragged.ops`: each op has a ``register_fake``, so a decode step that
calls it compiles with ``fullgraph=True`` and no graph break, and its body picks the backend at run
time (:func:`~kvpress_ada.kernels.support.resolve_backend`: Triton on CUDA; on CPU the fused kernel of
:mod:`.cpu_kernel` for decode-shaped calls, the torch reference otherwise). The public
wrappers validate shapes and dtypes with one-line errors; in plain eager mode on plain tensors they
call the implementation directly (no custom-op dispatch per layer and step).

* :func:`quantized_attention` - ragged attention that dequantizes the rows it reads;
* :func:`quantized_append` - quantize new tokens and append their records in place;
* :func:`quantized_append_side` - a deferred append: new tokens into the rows' residual rings only;
* :func:`quantized_compact` - fix each row's side tensors and quantize its kept entries into the ragged layout.

Every op takes the records' :class:`~.quantized.RecordLayout` (a storage kind's ``layout``; a custom op
receives its fields as plain arguments) and the layer's ``side [3 + 2R, rows, D]`` (each row's anchor key,
anchor value, key centre and its newest ``R`` entries' keys and values, in the entries' dtype:
:mod:`.quantized`); compaction writes it,
an append writes the anchor of a row that was empty and its newest tokens into the residual, attention
reads it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..support import check_logit_extras, resolve_backend, triton_module
from .cpu_kernel import quantized_attention_cpu
from .scheme import (
    RecordLayout,
    append_side,
    check_side,
    quantized_append_ref,
    quantized_attention_ref,
    quantized_compact_ref,
    record_width,
    residual_of,
)

__all__ = ["quantized_attention", "quantized_append", "quantized_append_side", "quantized_compact"]


# ----------------------------------------------------------------------------- validation


def _check_records(k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor | None, side: Tensor,
                   head_dim: int, layout: RecordLayout, dtype: torch.dtype) -> None:
    if not isinstance(layout, RecordLayout):
        raise TypeError(f"layout must be a RecordLayout (a storage kind's layout), got {layout!r}")
    width = record_width(head_dim, layout, dtype)
    for name, rec in (("k_rec", k_rec), ("v_rec", v_rec)):
        if rec.dim() != 2 or rec.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8 [N, width], got {rec.dtype} {tuple(rec.shape)}")
        if rec.shape[1] != width:
            raise ValueError(f"{name} rows are {rec.shape[1]} bytes; {layout.label} of head_dim={head_dim} "
                             f"({dtype}) are {width}")
        if not rec.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if rec.device != row_offsets.device:
            raise ValueError(f"{name} is on {rec.device} but row_offsets is on {row_offsets.device}")
    if k_rec.shape != v_rec.shape:
        raise ValueError(f"k_rec {tuple(k_rec.shape)} and v_rec {tuple(v_rec.shape)} differ in shape")
    for name, index in (("row_offsets", row_offsets), ("row_lengths", row_lengths)):
        if index is not None and (index.dim() != 1 or index.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{name} must be int32 (or int64) [R], got {index.dtype} {tuple(index.shape)}")
    if row_lengths is not None and row_lengths.shape != row_offsets.shape:
        raise ValueError(f"row_lengths {tuple(row_lengths.shape)} and row_offsets {tuple(row_offsets.shape)} differ")
    check_side(side, row_offsets.shape[0], head_dim, dtype, row_offsets.device)


def _rows(name: str, x: Tensor, row_offsets: Tensor, same_heads: bool) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} must be [B, H, Q, D], got shape {tuple(x.shape)}")
    B, H = x.shape[:2]
    R = row_offsets.shape[0]
    if B == 0 or R % B or (same_heads and H != R // B) or (not same_heads and (R // B == 0 or H % (R // B))):
        raise ValueError(f"{name} of shape {tuple(x.shape)} does not fit {R} cache rows")
    if x.device != row_offsets.device:
        raise ValueError(f"{name} is on {x.device} but the cache is on {row_offsets.device}")


def _same_entries(k_new: Tensor, v_new: Tensor) -> None:
    if k_new.shape != v_new.shape or k_new.dtype != v_new.dtype:
        raise ValueError(f"k_new {k_new.dtype} {tuple(k_new.shape)} and v_new {v_new.dtype} {tuple(v_new.shape)} "
                         "differ")


# ----------------------------------------------------------------------------- custom ops


def op_fields(layout: RecordLayout) -> tuple[str, int, int, bool, int]:
    """What a custom op receives of ``layout`` (its record fields; the residual is read from ``side``)."""
    return (str(layout.encoding), int(layout.bits), int(layout.group), bool(layout.rotate_keys),
            int(layout.scale_bits))


def op_layout(encoding: str, bits: int, group: int, rotate_keys: bool, scale_bits: int) -> RecordLayout:
    """The :class:`RecordLayout` of a custom op's record fields (:func:`op_fields`; residual 0: read from ``side``)."""
    return RecordLayout(encoding, bits, group, 0, rotate_keys, scale_bits)



@torch.library.custom_op("kvpress_ada::quantized_attention", mutates_args=())
def _quantized_attention_op(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                            side: Tensor, scale: float, encoding: str, bits: int, group: int, rotate_keys: bool,
                            scale_bits: int, split_size: int = 0, softcap: float = 0.0,
                            sinks: Tensor | None = None) -> Tensor:
    """Raw op behind :func:`quantized_attention` (no validation): backend dispatch."""
    return _attention_impl(q, k_rec, v_rec, row_offsets, row_lengths, side, scale,
                           op_layout(encoding, bits, group, rotate_keys, scale_bits), split_size, softcap, sinks)


def _attention_impl(q, k_rec, v_rec, row_offsets, row_lengths, side, scale, layout, split_size, softcap=0.0,
                    sinks=None):
    if q.numel() == 0:
        return torch.zeros_like(q)
    if resolve_backend(q.device, q.shape[-1]) == "triton":
        kernel = triton_module("quantized.triton_kernel").quantized_attention_triton
        return kernel(q, k_rec, v_rec, row_offsets, row_lengths, side, scale, layout, split_size=split_size,
                      softcap=softcap, sinks=sinks)
    out = quantized_attention_cpu(q, k_rec, v_rec, row_offsets, row_lengths, side, scale, layout, softcap=softcap,
                                  sinks=sinks)
    return quantized_attention_ref(q, k_rec, v_rec, row_offsets, row_lengths, side, scale, layout, softcap=softcap,
                                   sinks=sinks) if out is None else out


@_quantized_attention_op.register_fake
def _(q, k_rec, v_rec, row_offsets, row_lengths, side, scale, encoding, bits, group, rotate_keys, scale_bits,
      split_size=0, softcap=0.0, sinks=None):
    check_logit_extras(softcap, sinks, q.shape[1], q.device)
    return torch.empty_like(q)


@torch.library.custom_op("kvpress_ada::quantized_append", mutates_args=("k_rec", "v_rec", "row_lengths", "side"))
def _quantized_append_op(k_new: Tensor, v_new: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor,
                         row_lengths: Tensor, side: Tensor, encoding: str, bits: int, group: int,
                         rotate_keys: bool, scale_bits: int) -> None:
    """Raw op behind :func:`quantized_append` (no validation); torch ops on every backend."""
    if k_new.numel():
        quantized_append_ref(k_new, v_new, k_rec, v_rec, row_offsets, row_lengths, side,
                             op_layout(encoding, bits, group, rotate_keys, scale_bits))


@_quantized_append_op.register_fake
def _(k_new, v_new, k_rec, v_rec, row_offsets, row_lengths, side, encoding, bits, group, rotate_keys, scale_bits):
    return None


@torch.library.custom_op("kvpress_ada::quantized_append_side", mutates_args=("row_lengths", "side"))
def _quantized_append_side_op(k_new: Tensor, v_new: Tensor, row_lengths: Tensor, side: Tensor) -> None:
    """Raw op behind :func:`quantized_append_side` (no validation); torch ops on every backend."""
    if k_new.numel():
        append_side(k_new, v_new, row_lengths, side)


@_quantized_append_side_op.register_fake
def _(k_new, v_new, row_lengths, side):
    return None


@torch.library.custom_op("kvpress_ada::quantized_compact", mutates_args=("k_rec", "v_rec", "side"))
def _quantized_compact_op(keys: Tensor, values: Tensor, keep: Tensor, row_offsets: Tensor, k_rec: Tensor,
                          v_rec: Tensor, side: Tensor, encoding: str, bits: int, group: int,
                          rotate_keys: bool, scale_bits: int) -> None:
    """Raw op behind :func:`quantized_compact` (no validation); torch ops on every backend."""
    if keys.numel():
        quantized_compact_ref(keys, values, keep, row_offsets, k_rec, v_rec, side,
                              op_layout(encoding, bits, group, rotate_keys, scale_bits))


@_quantized_compact_op.register_fake
def _(keys, values, keep, row_offsets, k_rec, v_rec, side, encoding, bits, group, rotate_keys, scale_bits):
    return None


# ----------------------------------------------------------------------------- public API


def _direct(*tensors: Tensor) -> bool:
    return not torch.compiler.is_compiling() and all(type(t) is Tensor for t in tensors)


def quantized_attention(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                        side: Tensor, scale: float, layout: RecordLayout, split_size: int = 0, *,
                        softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Ragged attention (contract of :func:`~.ops.ragged_attention`: ``q [B, H_q, Q, D]``, bottom-right
    causal, 0 for a query that sees nothing, output in ``q.dtype``) over rows of quantized records
    ``k_rec, v_rec uint8 [N_cap, width]`` of ``layout`` made from entries of ``q.dtype``, with the rows' ``side``
    tensors,
    dequantized as they are read (each non-empty row's first slot reads as its anchor). Triton path: the
    split-K kernel of the full-precision cache, dequantizing each K/V tile in registers; CPU: the fused C
    kernel (:mod:`.cpu_kernel`) for up to 4 queries per head, the torch reference for longer calls.

    ``softcap`` (Gemma 2; None or 0: off) and ``sinks`` (GPT-OSS: a float tensor ``[H_q]``): the logit terms of
    :func:`~..ragged.ops.ragged_attention`, over the logits ``q . k`` of the read-back keys (each row's key
    centre included)."""
    _check_records(k_rec, v_rec, row_offsets, row_lengths, side, q.shape[-1], layout, q.dtype)
    _rows("q", q, row_offsets, same_heads=False)
    cap = check_logit_extras(softcap, sinks, q.shape[1], q.device)
    args = (q, k_rec, v_rec, row_offsets, row_lengths, side, float(scale))
    if _direct(q, k_rec, v_rec, row_offsets, row_lengths, side) and (sinks is None or type(sinks) is Tensor):
        return _attention_impl(*args, layout.records(), int(split_size), cap, sinks)
    return _quantized_attention_op(*args, *op_fields(layout), int(split_size), cap, sinks)


def quantized_append(k_new: Tensor, v_new: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor,
                     row_lengths: Tensor, side: Tensor, layout: RecordLayout) -> None:
    """Quantize ``k_new, v_new [B, H_kv, Q, D]`` (keys centred by their row's centre) and write their records at
    ``row_offsets[r] + row_lengths[r] + i``; a row empty so far takes its first new token as its anchor
    (``side``); then ``row_lengths += Q`` (in place, no host sync). The caller guarantees the capacity."""
    _check_records(k_rec, v_rec, row_offsets, row_lengths, side, k_new.shape[-1], layout, k_new.dtype)
    _rows("k_new", k_new, row_offsets, same_heads=True)
    _same_entries(k_new, v_new)
    if _direct(k_new, v_new, k_rec, v_rec, row_offsets, row_lengths, side):
        if k_new.numel():
            quantized_append_ref(k_new, v_new, k_rec, v_rec, row_offsets, row_lengths, side, layout)
        return
    _quantized_append_op(k_new, v_new, k_rec, v_rec, row_offsets, row_lengths, side, *op_fields(layout))


def quantized_append_side(k_new: Tensor, v_new: Tensor, row_lengths: Tensor, side: Tensor) -> None:
    """A deferred append of ``k_new, v_new [B, H_kv, Q, D]`` (``Q`` at most the ring's ``R``): each row's newest
    ``Q`` tokens go into its residual ring of ``side``, a row empty so far takes its first new token as its
    anchor, and ``row_lengths += Q``; no record is written (:func:`~.quantized.record_newest` writes them
    before they leave the ring). What a compiled decode step appends (:func:`~.quantized.append_side`)."""
    _rows("k_new", k_new, row_lengths, same_heads=True)
    _same_entries(k_new, v_new)
    B, H, Q, D = k_new.shape
    check_side(side, B * H, D, k_new.dtype, k_new.device)
    R = residual_of(side)
    if not 0 < Q <= R:
        raise ValueError(f"a deferred append of {Q} tokens needs a residual ring of at least {Q}, got {R}")
    if _direct(k_new, v_new, row_lengths, side):
        append_side(k_new, v_new, row_lengths, side)
        return
    _quantized_append_side_op(k_new, v_new, row_lengths, side)


def quantized_compact(keys: Tensor, values: Tensor, keep: Tensor, row_offsets: Tensor, k_rec: Tensor,
                      v_rec: Tensor, side: Tensor, layout: RecordLayout) -> None:
    """Write row ``b * H_kv + h``'s side tensors (anchor: its first kept entry; key centre: the mean of its
    other kept keys) into ``side``, then quantize its kept entries (``keep`` bool ``[B, H_kv, L]`` over
    ``keys, values [B, H_kv, L, D]``) into ``k_rec[row_offsets[r] + j]``, ascending positions. The caller
    guarantees the capacity and sets ``row_lengths`` to the counts."""
    _check_records(k_rec, v_rec, row_offsets, None, side, keys.shape[-1], layout, keys.dtype)
    _rows("keys", keys, row_offsets, same_heads=True)
    if keep.dtype != torch.bool or tuple(keep.shape) != tuple(keys.shape[:3]) or keys.shape != values.shape:
        raise ValueError(f"keep must be a bool [B, H_kv, L] mask over keys and values of one shape, got keep "
                         f"{keep.dtype} {tuple(keep.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    if _direct(keys, values, keep, row_offsets, k_rec, v_rec, side):
        if keys.numel():
            quantized_compact_ref(keys, values, keep, row_offsets, k_rec, v_rec, side, layout)
        return
    _quantized_compact_op(keys, values, keep, row_offsets, k_rec, v_rec, side, *op_fields(layout))
