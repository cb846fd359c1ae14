"""Compiled decode steps for press caches: where ``torch.compile`` enters, and when.

Inside ``with press(model, compile=...)`` (and :func:`kvpress_ada.generate`) the model's forward is an
instance-level :class:`DecodeForward`: single-token decode steps over a compressed
:class:`~.ragged_cache.RaggedCache` whose handler only attends go to one shared
``torch.compile(model.forward, fullgraph=True)``; everything else (prefill, compression, decode
compactions and the steps whose queries they read, other caches) runs eagerly. Before each compiled
call the cache reserves room for the token (:meth:`RaggedCache.reserve`) and the inputs are made
shape-stable. When (``compile=None``): on CUDA (``mode="reduce-overhead"``), not on CPU unless asked;
``$KVPRESS_ADA_COMPILE`` (``0``/``1``) overrides the default, an explicit argument wins over it.
"""

from __future__ import annotations

import os
from typing import Any, Callable
from weakref import WeakKeyDictionary

import torch

from .attention import RUN_KWARG, Handler
from .hf import input_shape
from .ragged_cache import RaggedCache

ENV_VAR = "KVPRESS_ADA_COMPILE"
BACKEND = "inductor"
"""``torch.compile`` backend of the compiled step (tests use ``"aot_eager"`` to skip code generation)."""

_COMPILED: WeakKeyDictionary[torch.nn.Module, dict[str, Callable]] = WeakKeyDictionary()


def compile_enabled(compile: bool | None, device: torch.device | str) -> bool:
    """Whether decode steps are compiled: ``compile`` if given, else ``$KVPRESS_ADA_COMPILE``
    (``0/false/off`` or ``1/true/on``), else on for CUDA and off elsewhere."""
    if compile is not None:
        return bool(compile)
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env in ("0", "false", "off", "no"):
        return False
    if env in ("1", "true", "on", "yes"):
        return True
    if env not in ("", "auto"):
        raise ValueError(f"${ENV_VAR}={env!r}: expected 0/1, on/off, true/false or auto")
    return torch.device(device).type == "cuda"


def default_mode(device: torch.device | str) -> str | None:
    """``"reduce-overhead"`` (CUDA graphs) on CUDA, inductor's default elsewhere."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


def compiled_forward(model: Any, mode: str | None = None) -> Callable:
    """The model's shared ``torch.compile(model.forward, fullgraph=True, mode=mode)``."""
    per_model = _COMPILED.setdefault(model, {})
    key = f"{BACKEND}:{mode or 'default'}"
    if key not in per_model:
        forward = type(model).forward.__get__(model)
        per_model[key] = torch.compile(forward, fullgraph=True, mode=mode, backend=BACKEND)
    return per_model[key]


class DecodeForward:
    """``model.forward`` while a press block with compiled decoding is active: decode steps over a
    compressed ragged cache go to the compiled forward, every other call to the eager one."""

    def __init__(self, model: Any, cache_key: str, mode: str | None):
        self.eager = type(model).forward.__get__(model)
        self.compiled = compiled_forward(model, mode)
        self.cache_key = cache_key
        self.calls = 0  # compiled steps run (for tests and benchmarks)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get(self.cache_key)
        if not isinstance(cache, RaggedCache) or not cache.compressed or args or kwargs.get("input_ids") is None:
            return self.eager(*args, **kwargs)
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            return self.eager(*args, **kwargs)
        run: Handler | None = kwargs.get(RUN_KWARG)
        if run is not None and not run.traceable:  # a decode compaction (or its window): eager
            return self.eager(*args, **kwargs)
        (B, q), device = input_shape(args, kwargs)
        if q != 1:
            return self.eager(*args, **kwargs)
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = torch.full((B, 1), cache.get_seq_length(), dtype=torch.long, device=device)
        mask = kwargs.get("attention_mask")
        if mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            kwargs["attention_mask"] = None  # ragged attention reads the rows' lengths, not the mask
        cache.reserve(q)
        self.calls += 1
        return self.compiled(**kwargs)


def install(model: Any, cache_key: str, mode: str | None) -> DecodeForward:
    """Route ``model``'s forward through a :class:`DecodeForward` (an instance attribute; the class's
    forward is untouched) until :func:`uninstall`."""
    current = model.__dict__.get("forward")
    if isinstance(current, DecodeForward):
        return current
    step = DecodeForward(model, cache_key, mode)
    model.forward = step
    return step


def uninstall(model: Any) -> None:
    if isinstance(model.__dict__.get("forward"), DecodeForward):
        del model.forward
