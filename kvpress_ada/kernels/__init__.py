"""Kernels for the ragged per-(batch, kv head) KV cache of Ada-KV.

Layout of one layer: ``k_flat, v_flat [N_cap, D]`` (contiguous), row ``r = b * H_kv + h``
occupies ``k_flat[row_offsets[r] : row_offsets[r] + row_lengths[r]]`` (``row_offsets``,
``row_lengths``: int32 ``[B * H_kv]`` on the cache's device; rows must not overlap).

Ops (``torch.library`` custom ops in ``kernels.ragged.ops``, compile with ``fullgraph=True``):

* :func:`ragged_attention` - FlashDecoding-style split-K attention over variable-length rows;
* :func:`compact` - gather each row's kept tokens into the ragged layout;
* :func:`append` - in-place append of new tokens, ``row_lengths += Q``;
* :func:`quantized_attention`, :func:`quantized_append`, :func:`quantized_compact` - the same over
  rows of records of a :class:`RecordLayout` (int8 / int4 / e4m3) with each row's side tensors (anchor, key
  centre) (:mod:`.quantized.scheme`: the scheme, :func:`quantize`, :func:`dequantize`).

Every attention op (ragged, quantized, and ``paged.ops.paged_attention``) also takes two keyword-only logit
terms, off by default: ``softcap`` (Gemma 2: ``softcap * tanh(l / softcap)`` of each logit) and ``sinks``
(GPT-OSS: a float ``[H_q]`` tensor, one logit per query head in each softmax denominator, carrying no value).

Modules: one package per op family (``ragged``, ``paged``, ``quantized``, ``model_pass``), each named the same
way: ``ops`` (the custom ops, their validation and dispatch), ``reference`` (torch implementations; the
record scheme ``quantized.scheme``), ``cpu_kernel`` (a fused CPU kernel), ``triton_kernel`` (Triton; imports
triton); ``support`` (what the kernels support and which backend runs them: supported head dims,
``$TRITON_INTERPRET`` read as Triton reads it, triton availability, backend choice) and ``aot_check`` (GPU
codegen check without a GPU). ``ops`` and ``triton_kernel`` both depend on ``support``; only ``ops`` imports
``triton_kernel``, lazily, when a Triton op runs, so triton stays optional.

Backend: Triton on CUDA, torch reference (``kernels.ragged.reference``) on CPU; override with
:func:`use_backend` (``"triton" | "torch" | "auto"``) or ``$KVPRESS_ADA_KERNELS``. Triton on
CPU tensors needs ``TRITON_INTERPRET=1`` set before a ``triton_kernel`` module is imported.
"""

from .quantized.ops import quantized_append, quantized_append_side, quantized_attention, quantized_compact
from .quantized.scheme import RecordLayout, dequantize, quantize, record_width
from .ragged.ops import append, compact, ragged_attention
from .ragged.reference import append_ref, compact_ref, ragged_attention_ref
from .support import (
    BACKENDS,
    ENV_VAR,
    SUPPORTED_HEAD_DIMS,
    check_head_dim,
    get_backend,
    resolve_backend,
    triton_available,
    triton_interpret,
    use_backend,
)

__all__ = [
    "ragged_attention",
    "compact",
    "append",
    "RecordLayout",
    "quantize",
    "dequantize",
    "record_width",
    "quantized_attention",
    "quantized_append",
    "quantized_append_side",
    "quantized_compact",
    "use_backend",
    "get_backend",
    "resolve_backend",
    "triton_available",
    "triton_interpret",
    "check_head_dim",
    "ragged_attention_ref",
    "compact_ref",
    "append_ref",
    "BACKENDS",
    "ENV_VAR",
    "SUPPORTED_HEAD_DIMS",
]
