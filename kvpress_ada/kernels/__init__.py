"""Kernels for the ragged per-(batch, kv head) KV cache of Ada-KV.

Layout of one layer: ``k_flat, v_flat [N_cap, D]`` (contiguous), row ``r = b * H_kv + h``
occupies ``k_flat[row_offsets[r] : row_offsets[r] + row_lengths[r]]`` (``row_offsets``,
``row_lengths``: int32 ``[B * H_kv]`` on the cache's device; rows must not overlap).

Ops (``torch.library`` custom ops, compile with ``fullgraph=True``):

* :func:`ragged_attention` - FlashDecoding-style split-K attention over variable-length rows;
* :func:`compact` - gather each row's kept tokens into the ragged layout;
* :func:`append` - in-place append of new tokens, ``row_lengths += Q``.

Backend: Triton on CUDA, torch reference (``kernels.reference``) on CPU; override with
:func:`use_backend` (``"triton" | "torch" | "auto"``) or ``$KVPRESS_ADA_KERNELS``.
triton is imported lazily and is optional.
"""

from .ops import (
    BACKENDS,
    ENV_VAR,
    SUPPORTED_HEAD_DIMS,
    append,
    compact,
    get_backend,
    ragged_attention,
    resolve_backend,
    triton_available,
    use_backend,
)
from .reference import append_ref, compact_ref, ragged_attention_ref

__all__ = [
    "ragged_attention",
    "compact",
    "append",
    "use_backend",
    "get_backend",
    "resolve_backend",
    "triton_available",
    "ragged_attention_ref",
    "compact_ref",
    "append_ref",
    "BACKENDS",
    "ENV_VAR",
    "SUPPORTED_HEAD_DIMS",
]
