"""The vLLM host: a press applied inside vLLM 0.32 (CPU), with pages owned per (layer, kv head).

Switched on by configuration, never by import: :func:`engine_kwargs` checks the press and the engine
settings in the caller's process (one-line refusals) and returns the ``vllm.LLM`` / engine arguments that
turn the host on (``additional_config["kvpress_ada"]``, the worker class, no prefix caching). The plugin
(:mod:`.plugin`, entry point ``vllm.general_plugins``) only registers the attention backend override; the
backend (:mod:`.backend`) and worker (:mod:`.worker`) act only when that configuration is present.
Design and vLLM's seams: ``docs/vllm_host.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the policy is imported when a function needs it: `kvpress-ada serve`'s checks and the server
    from ...pipeline import Pipeline  # module (.server) import this package without torch

CONFIG_KEY = "kvpress_ada"
WORKER = "kvpress_ada.hosts.vllm.worker.PressWorker"
SCHEDULER = "kvpress_ada.hosts.vllm.scheduler.PressScheduler"
BLOCK_SIZE = 32  # entries per page (vLLM's CPU kernel takes multiples of 32)
#: engine settings the host cannot serve, with what to use instead
_REFUSED = {
    "enable_prefix_caching": "prefix caching shares blocks by position, which eviction breaks: "
                             "use enable_prefix_caching=False",
    "speculative_config": "speculative decoding is not supported with a press",
    "kv_transfer_config": "KV transfer is not supported with a press",
}


def press_from(press: Pipeline | str | dict, ratio: float | None = None,
               prefill_chunk: int | None = None) -> Pipeline:
    """A press from a :class:`Pipeline`, a preset name (with ``ratio``) or a Pipeline dict (a parsed YAML/JSON);
    with ``prefill_chunk`` it evicts after every chunk of that many tokens of a long prompt (the transformers host's
    chunks, whatever vLLM's: :mod:`kvpress_ada.serving.requests`)."""
    from ...pipeline import Pipeline
    from ...presets import preset

    if isinstance(press, Pipeline):
        made = press if ratio is None else press.replace(compression_ratio=ratio)
    elif isinstance(press, dict):
        made = Pipeline.model_validate(press if ratio is None else {**press, "compression_ratio": ratio})
    else:
        made = preset(press, compression_ratio=ratio)
    return made if prefill_chunk is None else made.replace(prefill_chunk=prefill_chunk)


def engine_kwargs(press: Pipeline | str | dict, model: str, ratio: float | None = None,
                  **engine: Any) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` (or engine) arguments serving ``model`` with ``press``. Raises a one-line
    ``ValueError`` for a press, model or engine setting the host cannot serve, before any engine starts."""
    from ...families import family_for
    from ...serving.requests import check_servable, reading_pages_of

    pipeline = press_from(press, ratio)
    check_servable(pipeline)
    if pipeline.prefill_chunk is not None and type(pipeline.layers).needs_all_layers and \
            engine.get("enable_chunked_prefill") is False:
        raise ValueError(f"prefill_chunk={pipeline.prefill_chunk} with layers={type(pipeline.layers).__name__} and "
                         "enable_chunked_prefill=False: that schedule evicts every layer at the end of a step, so "
                         "vLLM's steps of a prompt must end at the press's chunks: serve with enable_chunked_prefill "
                         "(vLLM's default)")
    # vLLM's CPU kernel reads whole blocks: a reader reads pages of the engine's block size
    pipeline = reading_pages_of(pipeline, int(engine.get("block_size") or BLOCK_SIZE))
    for key, reason in _REFUSED.items():
        if engine.get(key):
            raise ValueError(f"{key}={engine[key]!r}: {reason}")
    for key, ours in (("worker_cls", WORKER), ("scheduler_cls", SCHEDULER)):
        if engine.get(key) not in (None, ours):
            raise ValueError(f"{key}={engine[key]!r}: a press runs with its own ({ours})")
    if engine.get("tensor_parallel_size", 1) != 1 or engine.get("pipeline_parallel_size", 1) != 1:
        raise ValueError("a press runs on one worker: use tensor_parallel_size=1 and pipeline_parallel_size=1")
    config = Path(model) / "config.json"
    if config.is_file():
        family = family_for(json.loads(config.read_text()))  # a one-line refusal of an unsupported family
        refusal = family.refuses("vllm")
        if refusal is not None:
            raise ValueError(f"model type {family.model_type!r} cannot be served by the vLLM host: {refusal}")
        from transformers import AutoConfig

        pipeline.check_config(AutoConfig.from_pretrained(model))  # a surrogate or calibration made for another model
    extra = dict(engine.pop("additional_config", None) or {})
    extra[CONFIG_KEY] = {"press": pipeline.model_dump(mode="json")}
    return {"model": model, "block_size": BLOCK_SIZE, **engine, "enable_prefix_caching": False, "worker_cls": WORKER,
            "scheduler_cls": SCHEDULER, "additional_config": extra}


def press_of(additional_config: dict | None) -> Pipeline | None:
    """The press an engine was configured with (``None``: the host is off)."""
    from ...pipeline import Pipeline

    entry = (additional_config or {}).get(CONFIG_KEY)
    return None if entry is None else Pipeline.model_validate(entry["press"])


def serving_of(llm: Any) -> Any:
    """The :class:`~kvpress_ada.serving.requests.PagedServing` of an in-process ``vllm.LLM`` serving a press (its
    worker's; ``None`` before its first step or without a press): for tests and inspection."""
    return llm.collective_rpc(_serving)[0]


def _serving(worker: Any) -> Any:
    host = getattr(worker, "host", None)
    return None if host is None else host.serving


def server_args(kwargs: dict[str, Any]) -> list[str]:
    """:func:`engine_kwargs` as command-line options of vLLM's OpenAI-compatible server (``--block-size 32``,
    ``--no-enable-prefix-caching``, ``--additional-config JSON``, ...); ``model`` becomes ``--model``."""
    args: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif value is not None:
            args += [flag, str(value)]
    return args
