"""The fused CPU kernel of ragged attention over quantized records (``cpu_kernel.c``), built on first use.

:func:`quantized_attention_cpu` computes what :func:`~.quantized.quantized_attention_ref` computes (same
records, anchor and residual slots, bottom-right causal rule, float32 arithmetic) without materialising
the layer's dequantized keys and values: each entry is dequantized as it is read, so a decode step reads
the records' bytes once. It serves decode-shaped calls (at most :data:`MAX_QUERIES` queries per row);
longer ones (a prefill chunk) are matrix products the torch reference does better.
:func:`sparse_quantized_attention_cpu` computes what :func:`~..ragged.sparse.sparse_quantized_attention_ref`
computes (Quest reads: only the selected pages' entries, Tang et al., ICML 2024) the same way, each selected page's
records read and dequantized where they lie (no gather of the pages, no dequantized copy, no host sync).

The C source is compiled once per machine with the system C compiler (``$CC``, else ``cc``; flags
``-O3 -march=native``) into ``$KVPRESS_ADA_CACHE`` (default ``~/.cache/kvpress_ada``) under a name
hashing the source, the flags, the compiler and the CPU, and loaded with ``ctypes``. Where no compiler
is found or the build fails, one warning says why and the torch reference serves every call;
``KVPRESS_ADA_CPU_KERNEL=0`` (read at each call) or a :func:`use_cpu_kernel` block turns the kernel off
(measurements, tests of the reference path).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from .scheme import RecordLayout, centre_logits, key_rotation, residual_of, side_operands

__all__ = ["MAX_QUERIES", "ENV_VAR", "cpu_kernel", "use_cpu_kernel", "quantized_attention_cpu",
           "sparse_quantized_attention_cpu", "build_kernel", "kernel_wanted", "INCLUDE"]

MAX_QUERIES = 4
"""Most queries per head (``Q``) the fused kernel takes; longer calls (prefill chunks) go to the torch reference."""
ENV_VAR = "KVPRESS_ADA_CPU_KERNEL"
_SOURCE = Path(__file__).with_name("cpu_kernel.c")
INCLUDE = Path(__file__).parent.parent / "include"
"""The headers the fused CPU kernels share (``kvpress_half.h``, ``kvpress_pages.h``), on the compiler's include path;
shipped as package data beside the sources."""
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c11", "-shared", "-fPIC")
_LOADED_AT = time.time()  # this module's bindings (ctypes argument types) are those of its sources as of now
_SCALE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_P = ctypes.c_void_p
_I = ctypes.c_int64


def _cpu_signature() -> str:
    """The CPU model and feature flags (``/proc/cpuinfo``), so that a cache shared by machines of other CPUs
    never loads code built for another instruction set."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))


def _cache_dir() -> Path:
    root = os.environ.get("KVPRESS_ADA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvpress_ada")
    return Path(root)


def _build() -> Path:
    """Compile the kernel (or find it built) and return the shared library's path; raises on failure."""
    return build_kernel(_SOURCE, "quantized_cpu", loaded_at=_LOADED_AT)


def _headers(include: Path) -> list[bytes]:
    """Each header of ``include`` (sorted by name) as its name and content: what a source including them depends on."""
    return [h.name.encode() + b"\0" + h.read_bytes() for h in sorted(include.glob("*.h"))]


def build_kernel(path: Path, stem: str, include: Path | None = None, loaded_at: float | None = None) -> Path:
    """Compile the C source ``path`` with the system compiler (or find it built) into the cache directory as
    ``<stem>-<hash of source, shared headers, flags, compiler, CPU>.so`` and return the shared library's path;
    raises on failure. The headers are those of ``include`` (default :data:`INCLUDE`), on the include path. This
    kernel's build and any other fused CPU kernel's (:mod:`..ragged.sparse_cpu_kernel`). ``loaded_at``: when the
    caller's bindings were imported; a source or header modified since raises (a process must not call a library
    built from sources newer than its own argument types: a long run beside an edit of the tree)."""
    include = INCLUDE if include is None else include
    if loaded_at is not None:
        newer = [f.name for f in (path, *sorted(include.glob("*.h"))) if f.stat().st_mtime > loaded_at]
        if newer:
            raise RuntimeError(f"{', '.join(newer)} changed after this process imported its bindings; restart it to "
                               "use the edited kernel")
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    source = path.read_bytes()
    key = hashlib.sha256(b"\0".join([source, *_headers(include), " ".join(_FLAGS).encode(), version.encode(),
                                     _cpu_signature().encode(), platform.machine().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"{stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, f"-I{include}", str(path), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{compiler} failed: {last}")
        os.replace(tmp, target)  # atomic: concurrent builds each write their own file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_enabled: list[bool] = []  # use_cpu_kernel's stack of overrides


@contextlib.contextmanager
def use_cpu_kernel(enabled: bool) -> Iterator[None]:
    """Within the block, serve decode-shaped CPU calls by the fused kernel (``True``, if it builds) or by the
    torch reference (``False``), whatever ``$KVPRESS_ADA_CPU_KERNEL`` says; process-wide (measurements, tests)."""
    _enabled.append(bool(enabled))
    try:
        yield
    finally:
        _enabled.pop()


def kernel_wanted() -> bool:
    """Whether the fused CPU kernels are wanted (``$KVPRESS_ADA_CPU_KERNEL``, overridden by :func:`use_cpu_kernel`
    blocks); whether they are built is another matter."""
    if _enabled:
        return _enabled[-1]
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as error:  # noqa: BLE001 - any failure leaves the torch reference in charge
        warnings.warn(f"kvpress_ada: the fused CPU kernel of quantized attention is unavailable ({error}); "
                      "the torch reference runs instead", RuntimeWarning, stacklevel=2)
        return None
    fn = lib.kvq_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_float,
                   _P, _P, _P]
    fn = lib.kvq_sparse_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_P, _P, _P, _I, _P, _P, _I, _I, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float,
                   ctypes.c_float, _P, _P, _P]
    return lib


def cpu_kernel() -> bool:
    """Whether the fused CPU kernel is enabled and built (builds it on the first call)."""
    return kernel_wanted() and _library() is not None


_ENCODINGS = {"int": 0, "e4m3": 1}


def quantized_attention_cpu(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_offsets: Tensor, row_lengths: Tensor,
                            side: Tensor, scale: float, layout: RecordLayout, *, softcap: float = 0.0,
                            sinks: Tensor | None = None) -> Tensor | None:
    """What :func:`~.quantized.quantized_attention_ref` returns for these (validated) arguments, by the
    fused kernel; ``None`` when it does not serve the call (not CPU tensors, more than :data:`MAX_QUERIES`
    queries per row, an encoding it does not know, or the kernel unavailable): the caller then runs the reference.
    ``softcap`` (0: off) and ``sinks [H_q]`` (None: off): the logit terms of the reference."""
    B, H_q, Q, D = q.shape
    rows = row_offsets.shape[0]
    if q.device.type != "cpu" or Q > MAX_QUERIES or q.dtype not in _SCALE_DTYPES or not kernel_wanted() \
            or layout.encoding not in _ENCODINGS:
        return None
    lib = _library()
    if lib is None:
        return None
    H_kv = rows // B
    R = key_rotation(layout, D, q.device)
    q_rot = (q.float() if R is None else q.float() @ R).contiguous()
    operands = side_operands(side, layout).contiguous()
    offs = row_offsets.to(torch.int64).contiguous()
    lens = row_lengths.to(torch.int64).contiguous()
    k_rec, v_rec = k_rec.contiguous(), v_rec.contiguous()
    out = torch.empty(B, H_q, Q, D, dtype=torch.float32)
    # soft-capping and sinks need the logits q . k: the kernel adds each query's q . c to its logits over y
    bias = centre_logits(q, side) if softcap or sinks is not None else None
    sink = None if sinks is None else sinks.float().contiguous()
    status = lib.kvq_attention(q_rot.data_ptr(), k_rec.data_ptr(), v_rec.data_ptr(), k_rec.shape[1], offs.data_ptr(),
                               lens.data_ptr(), operands.data_ptr(), residual_of(side), B, H_kv, H_q // H_kv, Q, D,
                               _ENCODINGS[layout.encoding], layout.bits, layout.group_size(D),
                               _SCALE_DTYPES[layout.scale_dtype(q.dtype)], float(scale), float(softcap or 0.0),
                               None if bias is None else bias.data_ptr(), None if sink is None else sink.data_ptr(),
                               out.data_ptr())
    if status:
        raise MemoryError("quantized attention (CPU kernel): out of memory for the score buffer")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def sparse_quantized_attention_cpu(q: Tensor, k_rec: Tensor, v_rec: Tensor, row_lengths: Tensor, side: Tensor,
                                   table: Tensor, selected: Tensor, page_size: int, scale: float, layout: RecordLayout,
                                   softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor | None:
    """What :func:`~..ragged.sparse.sparse_quantized_attention_ref` returns for these (validated) arguments, by the
    fused kernel; ``None`` when it does not serve the call (traced, not plain CPU tensors, more than
    :data:`MAX_QUERIES` queries per row, an encoding it does not know, or the kernel unavailable): the caller then
    runs the reference. Raises ``ValueError`` when ``table`` lists a selected page past the records' pages."""
    extra = () if sinks is None else (sinks,)
    B, H_q, Q, D = q.shape
    if torch.compiler.is_compiling() or Q > MAX_QUERIES or q.dtype not in _SCALE_DTYPES \
            or layout.encoding not in _ENCODINGS or not kernel_wanted() or not all(
                type(t) is Tensor and t.device.type == "cpu"
                for t in (q, k_rec, v_rec, row_lengths, side, table, selected, *extra)):
        return None
    lib = _library()
    if lib is None:
        return None
    rows, W = table.shape
    H_kv = rows // B
    R = key_rotation(layout, D, q.device)
    q_rot = (q.float() if R is None else q.float() @ R).contiguous()
    operands = side_operands(side, layout).contiguous()
    lens = row_lengths.to(torch.int64).contiguous()
    pages, chosen = table.to(torch.int64).contiguous(), selected.contiguous()
    k_rec, v_rec = k_rec.contiguous(), v_rec.contiguous()
    out = torch.empty(B, H_q, Q, D, dtype=torch.float32)
    bias = centre_logits(q, side) if softcap or sinks is not None else None  # as quantized_attention_cpu's
    sink = None if sinks is None else sinks.float().contiguous()
    status = lib.kvq_sparse_attention(q_rot.data_ptr(), k_rec.data_ptr(), v_rec.data_ptr(), k_rec.shape[1],
                                      pages.data_ptr(), chosen.data_ptr(), W, int(page_size),
                                      k_rec.shape[0] // int(page_size), lens.data_ptr(), operands.data_ptr(),
                                      residual_of(side), B, H_kv, H_q // H_kv, Q, D, _ENCODINGS[layout.encoding],
                                      layout.bits, layout.group_size(D), _SCALE_DTYPES[layout.scale_dtype(q.dtype)],
                                      float(scale), float(softcap or 0.0), None if bias is None else bias.data_ptr(),
                                      None if sink is None else sink.data_ptr(), out.data_ptr())
    if status == 3:
        raise ValueError(f"table lists a selected page past the {k_rec.shape[0] // int(page_size)} pages of the "
                         "records")
    if status:
        raise MemoryError("sparse quantized attention (CPU kernel): out of memory for the score buffer")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
