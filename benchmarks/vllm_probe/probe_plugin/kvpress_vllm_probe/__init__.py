"""A vLLM general plugin that overrides the CPU attention backend with a logging subclass.

``register`` is the ``vllm.general_plugins`` entry point: it runs in every vLLM process (main, engine core,
worker) and only records an override in vLLM's backend registry. The override is inert unless the engine is
started with ``additional_config={"kvpress_probe": {"log": PATH}}``: then every process that builds the
attention impl appends JSON lines (one per layer and step) to PATH. It also registers a custom KV cache spec and
manager (spec.py), used only by an engine whose ``worker_cls`` reports that spec. Nothing is patched at import.
"""

import os


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    with open(os.environ.get("KVPRESS_PROBE_PLUGIN_LOG", os.devnull), "a") as f:
        f.write(f"register pid={os.getpid()}\n")
    register_backend(AttentionBackendEnum.CPU_ATTN, "kvpress_vllm_probe.backend.LoggingCPUBackend")
    from .spec import register_spec

    register_spec()  # HeadPagedSpec -> PagedManager; used only when a worker reports HeadPagedSpec (spec.py)
