"""``torch.library`` custom ops for the ragged (Ada-KV) cache, with backend dispatch.

Each op is a ``torch.library.custom_op`` with a ``register_fake``, so a decode step that
calls it compiles with ``torch.compile(fullgraph=True)`` and no graph break; the op body
is opaque to the compiler and picks the implementation at run time:

* ``"auto"`` (default): Triton when the tensors are on CUDA and triton is importable,
  the torch reference otherwise (the CPU production path);
* ``"triton"``: always Triton (on CPU tensors this needs ``TRITON_INTERPRET=1``);
* ``"torch"``: always the torch reference.

Choose with :func:`use_backend` (a setter that also works as a context manager) or the
``KVPRESS_ADA_KERNELS`` environment variable; ``use_backend`` wins over the variable.
The choice, the supported head dims and the ``TRITON_INTERPRET`` rule live in
:mod:`..support` (re-exported here); ``triton_kernel`` is imported only when a Triton op
runs.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from ..support import (
    BACKENDS,
    ENV_VAR,
    SUPPORTED_HEAD_DIMS,
    check_logit_extras,
    get_backend,
    resolve_backend,
    triton_available,
    triton_module,
    use_backend,
)
from . import reference

__all__ = [
    "ragged_attention",
    "compact",
    "append",
    "use_backend",
    "get_backend",
    "resolve_backend",
    "triton_available",
    "BACKENDS",
    "ENV_VAR",
    "SUPPORTED_HEAD_DIMS",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)

def _triton() -> ModuleType:
    return triton_module("ragged.triton_kernel")


# ----------------------------------------------------------------------------- validation


def _tensor(name: str, x, ndim: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")


def _same_device(ref_name: str, ref: Tensor, **others: Tensor) -> None:
    for name, t in others.items():
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _check_cache(k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor | None) -> None:
    _tensor("k_flat", k_flat, 2)
    _tensor("v_flat", v_flat, 2)
    _tensor("row_offsets", row_offsets, 1)
    if k_flat.shape != v_flat.shape:
        raise ValueError(f"k_flat {tuple(k_flat.shape)} and v_flat {tuple(v_flat.shape)} differ in shape")
    if k_flat.dtype != v_flat.dtype:
        raise ValueError(f"k_flat is {k_flat.dtype} but v_flat is {v_flat.dtype}")
    if k_flat.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"cache dtype {k_flat.dtype} is not supported; expected one of {_FLOAT_DTYPES}")
    if row_offsets.dtype not in _INDEX_DTYPES:
        raise TypeError(f"row_offsets must be int32 (or int64), got {row_offsets.dtype}")
    if k_flat.stride(-1) != 1 or v_flat.stride(-1) != 1:
        raise ValueError(
            f"k_flat/v_flat need a unit stride on the head dim, got strides {k_flat.stride()} / {v_flat.stride()}"
        )
    _same_device("k_flat", k_flat, v_flat=v_flat, row_offsets=row_offsets)
    if row_lengths is not None:
        _tensor("row_lengths", row_lengths, 1)
        if row_lengths.dtype not in _INDEX_DTYPES:
            raise TypeError(f"row_lengths must be int32 (or int64), got {row_lengths.dtype}")
        if row_lengths.shape != row_offsets.shape:
            raise ValueError(
                f"row_lengths {tuple(row_lengths.shape)} and row_offsets {tuple(row_offsets.shape)} differ in shape"
            )
        _same_device("k_flat", k_flat, row_lengths=row_lengths)


def _check_rows(name: str, x: Tensor, k_flat: Tensor, row_offsets: Tensor) -> tuple[int, int]:
    """x: [B, H_x, *, D]; returns (B, H_kv) after checking it fits the cache."""
    B, H_x, _, D = x.shape
    R = row_offsets.shape[0]
    if x.device != k_flat.device:
        raise ValueError(f"{name} is on {x.device} but the cache (k_flat) is on {k_flat.device}")
    if x.dtype != k_flat.dtype:
        raise ValueError(f"{name} is {x.dtype} but the cache (k_flat) is {k_flat.dtype}")
    if D != k_flat.shape[1]:
        raise ValueError(f"head_dim mismatch: {name} has head_dim={D}, the cache has {k_flat.shape[1]}")
    if B == 0 or R % B != 0:
        raise ValueError(f"number of cache rows R={R} is not a multiple of the batch size B={B} of {name}")
    return B, R // B


def _validate_attention(q, k_flat, v_flat, row_offsets, row_lengths, scale, softcap=None, sinks=None) -> float:
    """Raise on bad arguments; return the soft-cap as a float (0.0: off)."""
    _tensor("q", q, 4)
    _check_cache(k_flat, v_flat, row_offsets, row_lengths)
    B, H_kv = _check_rows("q", q, k_flat, row_offsets)
    H_q = q.shape[1]
    if H_kv == 0 or H_q % H_kv != 0:
        raise ValueError(
            f"query heads H_q={H_q} must be a multiple of the kv heads H_kv={H_kv} "
            f"(= {row_offsets.shape[0]} cache rows / batch {B})"
        )
    return check_logit_extras(softcap, sinks, H_q, q.device)


def _check_new(k_name: str, k: Tensor, v_name: str, v: Tensor, k_flat: Tensor, row_offsets: Tensor) -> None:
    """Keys and values ``[B, H_kv, *, D]`` to write into the cache: same shape, one kv head per cache row."""
    if k.shape != v.shape:
        raise ValueError(f"{k_name} {tuple(k.shape)} and {v_name} {tuple(v.shape)} differ in shape")
    B, H = _check_rows(k_name, k, k_flat, row_offsets)
    _check_rows(v_name, v, k_flat, row_offsets)
    if H != k.shape[1]:
        raise ValueError(
            f"{k_name} has {k.shape[1]} kv heads but the cache has {row_offsets.shape[0]} rows for batch {B}"
        )


def _validate_compact(keys, values, keep, row_offsets, k_flat, v_flat) -> None:
    _tensor("keys", keys, 4)
    _tensor("values", values, 4)
    _tensor("keep", keep, 3)
    _check_cache(k_flat, v_flat, row_offsets, None)
    if keep.dtype != torch.bool:
        raise TypeError(f"keep must be a bool mask, got {keep.dtype}")
    if tuple(keep.shape) != tuple(keys.shape[:3]):
        raise ValueError(f"keep {tuple(keep.shape)} must have shape [B, H_kv, L] = {tuple(keys.shape[:3])}")
    _check_new("keys", keys, "values", values, k_flat, row_offsets)
    _same_device("keys", keys, keep=keep)


def _validate_append(k_new, v_new, k_flat, v_flat, row_offsets, row_lengths) -> None:
    _tensor("k_new", k_new, 4)
    _tensor("v_new", v_new, 4)
    _check_cache(k_flat, v_flat, row_offsets, row_lengths)
    _check_new("k_new", k_new, "v_new", v_new, k_flat, row_offsets)


# ----------------------------------------------------------------------------- custom ops
# Each op's body is its dispatch function, which the public wrappers below also call directly in plain eager
# mode; the ops themselves do not validate (their fake kernels do).


def _ragged_attention_impl(q: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                           scale: float, split_size: int = 0, softcap: float = 0.0,
                           sinks: Tensor | None = None) -> Tensor:
    """Backend dispatch of :func:`ragged_attention` (no validation; ``softcap`` 0.0: off)."""
    if q.numel() == 0:
        return torch.zeros_like(q)
    if resolve_backend(q.device, q.shape[-1]) == "triton":
        return _triton().ragged_attention_triton(
            q, k_flat, v_flat, row_offsets, row_lengths, scale, split_size=split_size, softcap=softcap, sinks=sinks
        )
    return reference.ragged_attention_ref(q, k_flat, v_flat, row_offsets, row_lengths, scale, softcap=softcap,
                                          sinks=sinks)


_ragged_attention_op = torch.library.custom_op("kvpress_ada::ragged_attention", _ragged_attention_impl,
                                               mutates_args=())


@_ragged_attention_op.register_fake
def _(q, k_flat, v_flat, row_offsets, row_lengths, scale, split_size=0, softcap=0.0, sinks=None):
    _validate_attention(q, k_flat, v_flat, row_offsets, row_lengths, scale, softcap, sinks)
    return torch.empty_like(q)


def _compact_impl(keys: Tensor, values: Tensor, keep: Tensor, row_offsets: Tensor, k_flat: Tensor,
                  v_flat: Tensor) -> None:
    """Backend dispatch of :func:`compact` (no validation)."""
    if keys.numel() == 0:
        return
    if resolve_backend(keys.device) == "triton":
        _triton().compact_triton(keys, values, keep, row_offsets, k_flat, v_flat)
    else:
        reference.compact_ref(keys, values, keep, row_offsets, k_flat, v_flat)


_compact_op = torch.library.custom_op("kvpress_ada::compact", _compact_impl, mutates_args=("k_flat", "v_flat"))


@_compact_op.register_fake
def _(keys, values, keep, row_offsets, k_flat, v_flat):
    _validate_compact(keys, values, keep, row_offsets, k_flat, v_flat)


def _append_impl(k_new: Tensor, v_new: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor,
                 row_lengths: Tensor) -> None:
    """:func:`append` without validation: torch index ops on every backend."""
    if k_new.numel():
        reference.append_ref(k_new, v_new, k_flat, v_flat, row_offsets, row_lengths)


_append_op = torch.library.custom_op("kvpress_ada::append", _append_impl,
                                     mutates_args=("k_flat", "v_flat", "row_lengths"))


@_append_op.register_fake
def _(k_new, v_new, k_flat, v_flat, row_offsets, row_lengths):
    _validate_append(k_new, v_new, k_flat, v_flat, row_offsets, row_lengths)


# ----------------------------------------------------------------------------- public API
# Thin wrappers: validate (cheap shape/dtype/device checks; traced away under
# torch.compile) with clear errors, then call the op. ``torch.ops.kvpress_ada.*`` are the
# raw ops: their fake kernels validate too, their eager kernels do not. In plain eager mode
# on plain tensors the wrappers call the implementation directly, skipping the custom-op
# dispatch (per layer and step); under torch.compile / export (or with tensor
# subclasses such as FakeTensor) they go through the op.


def _direct(*tensors: Tensor) -> bool:
    return not torch.compiler.is_compiling() and all(type(t) is Tensor for t in tensors)


def ragged_attention(q: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor, scale: float,
                     split_size: int = 0, *, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Ragged (Ada-KV) attention over a per-(batch, kv head) variable-length cache.

    ``q [B, H_q, Q, D]``; ``k_flat, v_flat [N_cap, D]``; ``row_offsets, row_lengths``
    int32 ``[B * H_kv]``. Query heads ``h*G .. h*G+G-1`` share kv row ``b*H_kv + h``.
    Query ``i`` sees the first ``row_lengths[r] - (Q - 1 - i)`` entries of its row
    (bottom-right causal); a query that sees nothing outputs 0. Returns
    ``softmax(scale * q k^T) v`` as ``[B, H_q, Q, D]`` in ``q.dtype`` (fp32 accumulation).
    Triton path: FlashDecoding split-K with ``split_size`` tokens per program (0 = auto).

    ``softcap`` (Gemma 2; None or 0: off): each logit ``l = scale * q . k`` becomes
    ``softcap * tanh(l / softcap)``. ``sinks`` (GPT-OSS): a float tensor ``[H_q]``, one logit per
    query head that joins every softmax denominator of that head and carries no value:
    ``out = sum_j exp(l_j - m) v_j / (exp(sinks[h] - m) + sum_j exp(l_j - m))``. A query that sees
    nothing outputs 0 with or without sinks.
    """
    cap = _validate_attention(q, k_flat, v_flat, row_offsets, row_lengths, scale, softcap, sinks)
    if _direct(q, k_flat, v_flat, row_offsets, row_lengths) and (sinks is None or type(sinks) is Tensor):
        return _ragged_attention_impl(q, k_flat, v_flat, row_offsets, row_lengths, float(scale), int(split_size), cap,
                                      sinks)
    return _ragged_attention_op(q, k_flat, v_flat, row_offsets, row_lengths, float(scale), int(split_size), cap,
                                sinks)


def compact(keys: Tensor, values: Tensor, keep: Tensor, row_offsets: Tensor, k_flat: Tensor, v_flat: Tensor) -> None:
    """Compact kept tokens into the ragged cache (in place).

    ``keys, values [B, H_kv, L, D]`` (strided views are fine), ``keep`` bool
    ``[B, H_kv, L]``: row ``r = b*H_kv + h``'s kept tokens, in ascending position order,
    go to ``k_flat[row_offsets[r] + j]``, ``j = 0 .. keep[b, h].sum() - 1``. The caller
    guarantees the capacity and sets ``row_lengths`` to the counts.
    """
    _validate_compact(keys, values, keep, row_offsets, k_flat, v_flat)
    if _direct(keys, values, keep, row_offsets, k_flat, v_flat):
        return _compact_impl(keys, values, keep, row_offsets, k_flat, v_flat)
    _compact_op(keys, values, keep, row_offsets, k_flat, v_flat)


def append(
    k_new: Tensor, v_new: Tensor, k_flat: Tensor, v_flat: Tensor, row_offsets: Tensor, row_lengths: Tensor
) -> None:
    """Append ``Q`` tokens per row in place: ``k_new [B, H_kv, Q, D]`` goes to
    ``k_flat[row_offsets[r] + row_lengths[r] + i]``, then ``row_lengths += Q``.
    Device-side index ops on every backend (no host sync). Caller guarantees capacity."""
    _validate_append(k_new, v_new, k_flat, v_flat, row_offsets, row_lengths)
    if _direct(k_new, v_new, k_flat, v_flat, row_offsets, row_lengths):
        return _append_impl(k_new, v_new, k_flat, v_flat, row_offsets, row_lengths)
    _append_op(k_new, v_new, k_flat, v_flat, row_offsets, row_lengths)
