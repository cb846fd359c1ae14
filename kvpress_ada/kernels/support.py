"""What the kernels support and which backend runs them, in one place.

This module imports neither triton nor the other kernel modules: :mod:`.ops` (the custom
ops and their dispatch) and each family's ``triton_kernel`` (the Triton kernels) both import from
it, so neither needs the other at import time (``ops`` imports ``triton_kernel`` lazily,
only when a Triton op runs).

* :data:`SUPPORTED_HEAD_DIMS`, :func:`check_head_dim`: head dims of the Triton ragged
  attention kernel (the torch reference takes any);
* :func:`parse_triton_interpret`, :func:`triton_interpret`: ``$TRITON_INTERPRET`` read the
  way Triton reads it;
* :func:`triton_available`: whether triton is installed (without importing it);
* :func:`use_backend`, :func:`get_backend`, :func:`resolve_backend`: the backend choice
  (``"auto" | "triton" | "torch"``; ``use_backend`` > ``$KVPRESS_ADA_KERNELS`` > ``"auto"``);
* :func:`check_logit_extras`: the two optional logit terms every attention op takes, logit soft-capping
  (Gemma 2) and learned attention sinks (GPT-OSS).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
import warnings
from types import ModuleType

import torch
from torch import Tensor

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "INTERPRET_ENV_VAR",
    "SUPPORTED_HEAD_DIMS",
    "check_head_dim",
    "check_logit_extras",
    "get_backend",
    "parse_triton_interpret",
    "resolve_backend",
    "triton_available",
    "triton_interpret",
    "triton_module",
    "use_backend",
]

SUPPORTED_HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 128, 256)
"""Head dims the Triton ragged attention kernel supports (the torch path takes any)."""

BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
ENV_VAR = "KVPRESS_ADA_KERNELS"
INTERPRET_ENV_VAR = "TRITON_INTERPRET"

# Triton (3.9: ``triton.knobs.runtime.interpret`` -> ``knobs.env_bool`` -> the C++
# ``getenv_bool`` of ``triton._C.libtriton``) calls a set variable true when its value,
# lower-cased byte by byte (ASCII ``tolower``, no stripping), is one of these; any other
# set value is false, and an unset variable takes the default (false).
_TRUTHY = frozenset({"1", "y", "yes", "on", "true"})


def check_head_dim(head_dim: int) -> None:
    """Raise ``ValueError`` unless the Triton ragged attention kernel supports ``head_dim``."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim={head_dim} is not supported by the Triton ragged attention kernel; "
            f"supported head dims: {SUPPORTED_HEAD_DIMS} (use the torch backend otherwise)"
        )


def check_logit_extras(softcap: float | None, sinks: Tensor | None, query_heads: int,
                       device: torch.device) -> float:
    """Validate the optional logit terms of an attention op and return the soft-cap as a float (0.0: off).

    ``softcap`` (Gemma 2): logits ``l = scale * q . k`` become ``softcap * tanh(l / softcap)`` before the
    softmax; ``None`` or ``0`` turn it off, anything else must be a finite positive number. ``sinks``
    (GPT-OSS): one logit per query head, a floating tensor ``[H_q]`` on the queries' device, that joins each
    softmax's denominator and contributes no value. Raises a one-line ``ValueError`` otherwise."""
    if softcap is None:
        cap = 0.0
    elif isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap={softcap!r} must be a positive number (None or 0: no soft-capping)")
    else:
        cap = float(softcap)
        if not (math.isfinite(cap) and cap >= 0.0):
            raise ValueError(f"softcap={softcap!r} must be a finite positive number (None or 0: no soft-capping)")
    if sinks is not None:
        if not isinstance(sinks, Tensor):
            raise ValueError(f"sinks must be a float tensor [H_q={query_heads}], got {type(sinks).__name__}")
        if sinks.dim() != 1 or sinks.shape[0] != query_heads or not sinks.dtype.is_floating_point:
            raise ValueError(f"sinks must be a float tensor [H_q={query_heads}] (one logit per query head), "
                             f"got {sinks.dtype} {tuple(sinks.shape)}")
        if sinks.device != device:
            raise ValueError(f"sinks is on {sinks.device} but the queries are on {device}")
    return cap


def parse_triton_interpret(value: str | None) -> bool:
    """Whether a ``$TRITON_INTERPRET`` value turns Triton's interpreter on, as Triton decides.

    ``None`` (unset) is false; otherwise true exactly when the value is ``1``, ``y``, ``yes``,
    ``on`` or ``true`` in any ASCII case, with no surrounding whitespace (``" 1"``, ``"2"``
    and ``"0"`` are false).
    """
    if value is None or not value.isascii():  # C tolower leaves non-ASCII bytes alone
        return False
    return value.lower() in _TRUTHY


def triton_interpret() -> bool:
    """Whether ``$TRITON_INTERPRET`` is on now (Triton then runs kernels on CPU tensors).

    Triton decides when ``@triton.jit`` decorates a kernel (``InterpretedFunction`` or a
    compiled ``JITFunction``), i.e. when ``kvpress_ada.kernels.ragged.triton_kernel`` is imported:
    set the variable before that import; this function reads it as it is now."""
    return parse_triton_interpret(os.environ.get(INTERPRET_ENV_VAR))


def triton_available() -> bool:
    """Whether triton is installed (does not import it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["triton"] is None
        return False


# ----------------------------------------------------------------------------- backend

_global_backend: list[str | None] = [None]
_warned: set[int] = set()  # head dims already warned about (one warning each per process)


def _check_backend(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    return name.lower()


class use_backend:
    """Select the kernel backend: ``"triton"``, ``"torch"`` or ``"auto"``.

    ``use_backend("torch")`` sets it for the process; ``with use_backend("torch"): ...``
    sets it for the block and restores the previous choice afterwards. ``None`` clears
    the choice (falls back to ``$KVPRESS_ADA_KERNELS``, then ``"auto"``).
    """

    def __init__(self, name: str | None):
        self._prev = _global_backend[0]
        _global_backend[0] = None if name is None else _check_backend(name)

    def __enter__(self) -> use_backend:
        return self

    def __exit__(self, *exc: object) -> None:
        _global_backend[0] = self._prev


def get_backend() -> str:
    """The configured backend name (``use_backend`` > ``$KVPRESS_ADA_KERNELS`` > auto)."""
    if _global_backend[0] is not None:
        return _global_backend[0]
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return _check_backend(env)
    return "auto"


def resolve_backend(device: torch.device, head_dim: int | None = None) -> str:
    """``"triton"`` or ``"torch"``: what an op on tensors of ``device`` will run.

    ``"auto"``: Triton on CUDA when triton is installed, the torch reference otherwise (the
    CPU production path); an attention ``head_dim`` outside :data:`SUPPORTED_HEAD_DIMS`
    falls back to the torch reference with one warning per head dim and process.
    ``"triton"`` on a CPU device needs ``$TRITON_INTERPRET`` on (else ``RuntimeError``);
    an unsupported ``head_dim`` then raises in the kernel (:func:`check_head_dim`).
    """
    name = get_backend()
    if name == "auto":
        if device.type != "cuda" or not triton_available():
            return "torch"
        if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
            if head_dim not in _warned:
                _warned.add(head_dim)
                warnings.warn(
                    f"head_dim={head_dim} is not supported by the Triton ragged attention "
                    f"kernel (supported: {SUPPORTED_HEAD_DIMS}); using the slower torch "
                    "reference on CUDA",
                    stacklevel=2,
                )
            return "torch"
        return "triton"
    if name == "triton" and device.type != "cuda" and not triton_interpret():
        raise RuntimeError(
            f"the 'triton' kernel backend got tensors on {device}; Triton runs CPU "
            f"tensors only in interpreter mode (set {INTERPRET_ENV_VAR}=1 before importing "
            "kvpress_ada) or use_backend('torch')"
        )
    return name


def triton_module(name: str) -> ModuleType:
    """The kernel module ``kvpress_ada.kernels.<name>`` (it imports triton), imported when a Triton op first runs:
    triton stays an optional dependency."""
    if not triton_available():
        raise RuntimeError("the 'triton' kernel backend was requested but triton is not installed "
                           "(pip install triton, or use_backend('torch'))")
    return importlib.import_module(f"{__package__}.{name}")
