"""The fused CPU kernels of sparse reads (``sparse_cpu_kernel.c``), built on first use: Quest page bounds, the pages
a reader selects, attention over the selected pages of a full-precision ragged cache and the appends of page
summaries (Quest, Tang et al., ICML 2024).

:func:`page_bounds_cpu` computes what :func:`~.sparse.page_bounds` computes, reading each page's 16-bit summaries
where they lie (no gathered ``[R, W, D]`` copies); :func:`sparse_attention_cpu` computes what
:func:`~.sparse.sparse_attention_ref` computes, reading each selected page's keys and values where they lie (no
gather into ``[R, M * P, D]``, no padding to the longest row's list, no host sync), for decode-shaped calls (at most
:data:`~..quantized.cpu_kernel.MAX_QUERIES` queries per row). Same pages, same causal rule, soft-cap and sinks,
float32 arithmetic: equal to float rounding. :func:`select_pages_cpu` selects what
:class:`~kvpress_ada.readers.TopPages` selects (uniform or Ada read budgets) from the bounds in one call per layer;
:func:`append_summaries_cpu` folds appended keys into their pages' summaries as :func:`~.sparse.append_summaries` does
(bit for bit).

Built, cached and switched as :mod:`..quantized.cpu_kernel` is (the system C compiler, ``$KVPRESS_ADA_CACHE``,
``$KVPRESS_ADA_CPU_KERNEL=0`` or a :func:`~..quantized.cpu_kernel.use_cpu_kernel` block turns it off); where it does
not build, one warning says why and the torch code serves every call (each function returns ``None``).
"""

from __future__ import annotations

import ctypes
import functools
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

from ..quantized.cpu_kernel import MAX_QUERIES, build_kernel, kernel_wanted

__all__ = ["sparse_cpu_kernel", "page_bounds_cpu", "sparse_attention_cpu", "top_k_cpu", "select_pages_cpu",
           "append_summaries_cpu"]

_SOURCE = Path(__file__).with_name("sparse_cpu_kernel.c")
_LOADED_AT = time.time()  # this module's bindings (ctypes argument types) are those of its source as of now
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build_kernel(_SOURCE, "sparse_cpu", loaded_at=_LOADED_AT)))
    except Exception as error:  # noqa: BLE001 - any failure leaves the torch code in charge
        warnings.warn(f"kvpress_ada: the fused CPU kernel of sparse reads is unavailable ({error}); the torch "
                      "reference runs instead", RuntimeWarning, stacklevel=2)
        return None
    lib.kvs_page_bounds.restype = ctypes.c_int
    lib.kvs_page_bounds.argtypes = [_P, _P, _P, _I, _P, _I, _I, _I, _I, _F, _P]
    lib.kvs_sparse_attention.restype = ctypes.c_int
    lib.kvs_sparse_attention.argtypes = [_P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _P]
    for name, real in (("kvs_top_k_f32", _F), ("kvs_top_k_f64", ctypes.c_double)):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_P, _P, _I, _I, real, _I, _P]
    lib.kvs_select_pages.restype = ctypes.c_int
    lib.kvs_select_pages.argtypes = [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I, _I, ctypes.c_double,
                                     ctypes.c_double, _F, _P]
    lib.kvs_append_summaries.restype = ctypes.c_int
    lib.kvs_append_summaries.argtypes = [_P, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I]
    return lib


def sparse_cpu_kernel() -> bool:
    """Whether the fused CPU kernels of sparse reads are enabled and built (builds them on the first call)."""
    return kernel_wanted() and _library() is not None


def _served(*tensors: Tensor) -> ctypes.CDLL | None:
    """The library, when it serves plain CPU tensors (not fakes; callers check first that nothing is being traced)
    and is enabled and built."""
    if not all(type(t) is Tensor and t.device.type == "cpu" for t in tensors) or not kernel_wanted():
        return None
    return _library()


def page_bounds_cpu(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, scale: float,
                    softcap: float | None = None) -> Tensor | None:
    """What :func:`~.sparse.page_bounds` returns (``[B, H_kv, G * Q, W]`` float32), by the fused kernel; ``None``
    when it does not serve the call (not CPU tensors, a dtype it does not read, or the kernel unavailable)."""
    if torch.compiler.is_compiling() or kmin.dtype not in _DTYPES or kmax.dtype != kmin.dtype \
            or q.dtype not in _DTYPES:
        return None
    lib = _served(q, kmin, kmax, table)
    if lib is None:
        return None
    B, H_q, Q, D = q.shape
    R, W = table.shape
    GQ = (H_q // (R // B)) * Q
    qs = (q.float() * scale).reshape(R, GQ, D).contiguous()
    kmin, kmax, table = kmin.contiguous(), kmax.contiguous(), table.to(torch.int64).contiguous()
    out = torch.empty(R, GQ, W, dtype=torch.float32)
    if lib.kvs_page_bounds(qs.data_ptr(), kmin.data_ptr(), kmax.data_ptr(), _DTYPES[kmin.dtype], table.data_ptr(),
                           R, W, GQ, D, float(softcap or 0.0), out.data_ptr()):
        raise MemoryError("page bounds (CPU kernel): out of memory for the query buffer")
    return out.view(B, R // B, GQ, W)


def sparse_attention_cpu(q: Tensor, k_flat: Tensor, v_flat: Tensor, row_lengths: Tensor, table: Tensor,
                         selected: Tensor, page_size: int, scale: float, softcap: float = 0.0,
                         sinks: Tensor | None = None) -> Tensor | None:
    """What :func:`~.sparse.sparse_attention_ref` returns for these (validated) arguments, by the fused kernel;
    ``None`` when it does not serve the call (not CPU tensors, more than ``MAX_QUERIES`` queries per row, a dtype
    it does not read, or the kernel unavailable): the caller then runs the reference."""
    if torch.compiler.is_compiling() or q.shape[2] > MAX_QUERIES or k_flat.dtype not in _DTYPES \
            or v_flat.dtype != k_flat.dtype or q.dtype not in _DTYPES:
        return None
    lib = _served(q, k_flat, v_flat, row_lengths, table, selected, *(() if sinks is None else (sinks,)))
    if lib is None:
        return None
    B, H_q, Q, D = q.shape
    R, W = table.shape
    H_kv = R // B
    G = H_q // H_kv
    qs = (q.float() * scale).contiguous()
    k_flat, v_flat = k_flat.contiguous(), v_flat.contiguous()
    table, lens = table.to(torch.int64).contiguous(), row_lengths.to(torch.int64).contiguous()
    chosen = selected.contiguous()
    sink = None if sinks is None else sinks.float().contiguous()
    out = torch.empty(B, H_q, Q, D, dtype=torch.float32)
    if lib.kvs_sparse_attention(qs.data_ptr(), k_flat.data_ptr(), v_flat.data_ptr(), _DTYPES[k_flat.dtype],
                                table.data_ptr(), chosen.data_ptr(), lens.data_ptr(), R, W, H_kv, G, Q, int(page_size),
                                D, float(softcap or 0.0), None if sink is None else sink.data_ptr(), out.data_ptr()):
        raise MemoryError("sparse attention (CPU kernel): out of memory for the score buffer")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def top_k_cpu(scores: Tensor, k: Tensor, recent_first: bool, rtol: float) -> Tensor | None:
    """What :func:`kvpress_ada.ranking.top_k` returns (its bool mask, the same entries: every step is a comparison,
    ``|kth| * rtol`` and ``kth + tol`` in the scores' dtype, as the torch code computes them), by a quickselect per
    row; ``None`` when it does not serve the call (not float32 / float64 CPU tensors, a NaN score, or the kernel
    unavailable)."""
    if torch.compiler.is_compiling() or scores.dtype not in (torch.float32, torch.float64) \
            or k.shape != scores.shape[:-1]:
        return None
    lib = _served(scores, k)
    if lib is None:
        return None
    n = scores.shape[-1]
    x = scores.detach().contiguous()
    counts = k.detach().to(torch.int64).contiguous()
    out = torch.empty(scores.shape, dtype=torch.bool)
    fn = lib.kvs_top_k_f32 if scores.dtype == torch.float32 else lib.kvs_top_k_f64
    status = fn(x.data_ptr(), counts.data_ptr(), counts.numel(), n, rtol, int(recent_first), out.data_ptr())
    if status == 2:
        raise MemoryError("top-k (CPU kernel): out of memory for the row buffer")
    return None if status else out


def select_pages_cpu(q: Tensor, kmin: Tensor, kmax: Tensor, table: Tensor, lengths: Tensor, scale: float,
                     softcap: float | None, page_size: int, per_head: int, alpha: float | None,
                     rtol: float, fraction: float | None = None) -> Tensor | None:
    """``[B, H_kv, W]`` bool: the pages :class:`~kvpress_ada.readers.TopPages` reads (``per_head`` pages per kv head
    on average, or with ``fraction`` the more of that and ``ceil(fraction *`` the batch row's heads' mean pages
    held``)``, split uniformly (``alpha`` None) or by Ada-KV with ``alpha``; ties within ``rtol``) for ``q [B, H_q,
    1, D]`` over rows of ``lengths [B * H_kv]`` entries, from the summaries' bounds (:func:`page_bounds_cpu`), by the
    fused kernel; ``None`` when it does not serve the call (as :func:`page_bounds_cpu`; a NaN score: the torch code
    decides)."""
    if torch.compiler.is_compiling() or kmin.dtype not in _DTYPES or kmax.dtype != kmin.dtype \
            or q.dtype not in _DTYPES:
        return None
    lib = _served(q, kmin, kmax, table, lengths)
    if lib is None:
        return None
    B, H_q, Q, D = q.shape
    R, W = table.shape
    H = R // B
    GQ = (H_q // H) * Q
    qs = (q.float() * scale).reshape(R, GQ, D).contiguous()
    kmin, kmax, table = kmin.contiguous(), kmax.contiguous(), table.to(torch.int64).contiguous()
    lens = lengths.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(B, H, W, dtype=torch.bool)
    status = lib.kvs_select_pages(qs.data_ptr(), kmin.data_ptr(), kmax.data_ptr(), _DTYPES[kmin.dtype],
                                  table.data_ptr(), lens.data_ptr(), R, H, W, GQ, D, float(softcap or 0.0),
                                  int(page_size), int(per_head), float(fraction or 0.0),
                                  -1.0 if alpha is None else float(alpha), rtol,
                                  out.data_ptr())
    if status == 2:
        raise MemoryError("page selection (CPU kernel): out of memory for its buffers")
    return None if status else out


def append_summaries_cpu(k_new: Tensor, kmin: Tensor, kmax: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                         page_size: int) -> bool:
    """Fold ``k_new [B, H_kv, Q, D]`` (just appended) into the summaries in place as
    :func:`~.sparse.append_summaries` does (the same bits), by the fused kernel; ``False`` (nothing written) when it
    does not serve the call: not CPU tensors, a pair of dtypes other than float32 keys into float16 summaries or
    16-bit keys into summaries of their dtype, offsets not int32, or the kernel unavailable."""
    if torch.compiler.is_compiling() or kmin.dtype != kmax.dtype or not kmin.is_contiguous() \
            or not kmax.is_contiguous() or row_offsets.dtype != torch.int32 or row_lengths.dtype != torch.int32:
        return False
    pair = (_DTYPES.get(k_new.dtype), _DTYPES.get(kmin.dtype))
    if pair not in ((0, 1), (1, 1), (2, 2)):
        return False
    lib = _served(k_new, kmin, kmax, row_offsets, row_lengths)
    if lib is None:
        return False
    B, H, Q, D = k_new.shape
    keys = k_new.contiguous()
    offs, lens = row_offsets.contiguous(), row_lengths.contiguous()
    return not lib.kvs_append_summaries(keys.data_ptr(), pair[0], kmin.data_ptr(), kmax.data_ptr(), pair[1],
                                        offs.data_ptr(), lens.data_ptr(), B * H, Q, D, int(page_size), kmin.shape[0])
