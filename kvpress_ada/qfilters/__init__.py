"""Q-filters (Godey et al., 2025, arXiv 2503.02812): one direction per (layer, kv head), the principal direction
of the head's post-RoPE queries, measured once per model.

``kvpress-ada qfilters`` (:func:`kvpress_ada.harness.qfilters.make_qfilters`) prefills offline text (the
documentation text ``distill`` also reads: docstrings of the Python standard library), takes the first right
singular vector of a sample of each query head's queries, points it away from where most queries lie (the
paper's sign: a key's score is ``-(filter . key)``) and averages it over the kv head's query group. A file records
the model it was made on (:func:`kvpress_ada.calibration.model_identity`) and is refused for any other.

``path`` values: a file path, or ``builtin:NAME`` for ``kvpress_ada/qfilters/NAME.safetensors`` shipped with the
package (``builtin:smollm2_135m``: the default model; ``builtin:qwen2_5_coder_0_5b``: ``qwen2.5-coder-0.5b``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from .. import packaged
from ..calibration import MeasuredMeta, model_identity

FORMAT = "kvpress_ada.qfilters/1"
METADATA_KEY = "kvpress_ada.qfilters"
SUFFIX = ".safetensors"
SHIPPED = "builtin:smollm2_135m"  # the default model (SmolLM2-135M-Instruct)
MAKE = "kvpress-ada qfilters --model <that model> --out qfilters.safetensors"
_HERE = Path(__file__).resolve().parent


class QFiltersError(ValueError):
    """A Q-filters file that is missing, malformed, or made for another model."""


class QFiltersMeta(MeasuredMeta):
    """What a Q-filters file records besides its filters."""

    format: str = FORMAT
    data: dict[str, Any] = Field(description="the text the queries came from: texts, tokens, seed, samples per head")


class QFilters:
    """``filters [layers, kv heads, D]`` float32 and their :class:`QFiltersMeta`."""

    def __init__(self, filters: torch.Tensor, meta: QFiltersMeta):
        expected = (meta.model.num_layers, meta.model.num_kv_heads, meta.model.head_dim)
        if tuple(filters.shape) != expected:
            raise QFiltersError(f"Q-filters of shape {tuple(filters.shape)} for a model with (layers, kv heads, "
                                f"head dim) = {expected}")
        self.filters = filters.float().contiguous()
        self.meta = meta
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        """The filters on ``device`` (copied once per device)."""
        found = self._on_device.get(device)
        if found is None:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in any mode later
                found = self.filters.to(device)
            self._on_device[device] = found
        return found

    def check_model(self, config: Any, source: str = "these Q-filters") -> None:
        """Refuse, in one line naming the command that makes filters, a model other than the one they were made on."""
        packaged.refuse_other_model(self.meta.model, model_identity(config), _HERE, SUFFIX,
                                    lambda p: load(p).meta.model.fingerprint, QFiltersError,
                                    source, "were made for model {made}, not for {other}", " (QFilter(path=...))",
                                    f"make them with `{MAKE}` and use QFilter(path='qfilters.safetensors')")

    def __repr__(self) -> str:
        return f"QFilters(model {self.meta.model.describe()}, {tuple(self.filters.shape)})"


def resolve(path: str) -> Path:
    """The file a ``path`` value names (``builtin:NAME`` is a file shipped in this package)."""
    return packaged.resolve(path, _HERE, SUFFIX)


def load(path: str) -> QFilters:
    """The Q-filters at ``path`` (cached: read once per file version)."""
    return _load(*packaged.version(path, resolve(path), "Q-filters", MAKE.replace("<that model>", "NAME"),
                                   QFiltersError), path)


@functools.lru_cache(maxsize=16)
def _load(file: str, mtime_ns: int, size: int, label: str) -> QFilters:
    try:
        header, tensors = packaged.read_tensors(file, METADATA_KEY)
        packaged.expect_keys(tensors, {"filters"})
        return QFilters(tensors["filters"], QFiltersMeta.model_validate_json(header))
    except Exception as err:  # noqa: BLE001 - safetensors, JSON, pydantic and shape errors all mean one thing
        raise QFiltersError(f"Q-filters file {label!r} is not a kvpress-ada Q-filters file "
                            f"({packaged.why_unreadable(err)})") from None


def save(qfilters: QFilters, path: str | os.PathLike) -> None:
    """Write ``qfilters`` to ``path`` (through a temporary file: never half a file)."""
    packaged.write_tensors(path, {"filters": qfilters.filters}, METADATA_KEY, qfilters.meta.model_dump_json())


__all__ = ["FORMAT", "SHIPPED", "QFilters", "QFiltersError", "QFiltersMeta", "load", "resolve", "save"]
