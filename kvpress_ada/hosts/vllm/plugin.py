"""The ``vllm.general_plugins`` entry point: registers the attention backend override and the press's KV cache
spec (with its block manager) in every vLLM process.

Inert by itself: :class:`~.backend.PressAttentionImpl` behaves exactly as vLLM's CPU backend unless the
engine was configured with a press (``additional_config["kvpress_ada"]``, see :func:`~.engine_kwargs`).
"""

from __future__ import annotations


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "kvpress_ada.hosts.vllm.backend.PressAttentionBackend")
    from .scheduler import register_spec

    register_spec()  # used only by an engine whose worker reports the press's spec
