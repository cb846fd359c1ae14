"""The ``vllm.general_plugins`` entry point: registers the attention backend override in every vLLM process.

Inert by itself: :class:`~.backend.PressAttentionImpl` behaves exactly as vLLM's CPU backend unless the
engine was configured with a press (``additional_config["kvpress_ada"]``, see :func:`~.engine_kwargs`).
"""

from __future__ import annotations


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "kvpress_ada.hosts.vllm.backend.PressAttentionBackend")
