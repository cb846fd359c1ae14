"""Offline head-importance calibration: per-(layer, kv head) budget shares measured once per model.

Head importance is largely a property of the model rather than of the input (DuoAttention, Xiao et
al. 2024; HeadKV, Fu et al. 2024; KVzip's head-level variant, Kim et al. 2025). ``kvpress-ada
calibrate`` (:func:`kvpress_ada.harness.calibrate.calibrate`) runs an expensive scorer (KVzip's
context reconstruction) on calibration samples and records which share of the model's kept entries
falls in each (layer, kv head); the ``Calibrated`` allocator and ``CalibratedLayer`` schedule
(:mod:`kvpress_ada.allocators.calibrated`) then split any pipeline's budget by those shares, so a
one-pass scorer (StreamingLLM, SnapKV, KNorm, ...) gets KVzip-informed budgets at no extra cost.

A calibration may also carry a *keep curve* (LU-KV, :mod:`kvpress_ada.harness.lukv`): ``keep[r][layer][kv_head]``,
the fraction of the context each (layer, kv head) keeps at each of its ``ratios``; the calibrated components then
read the budgets of the pipeline's own ratio off that curve (interpolated between its ratios) instead of one set of
shares for every ratio.

A calibration file records the model it was measured on (an architecture fingerprint), the scorer
and the data; it is refused for any other model. Calibration samples come from the task suite with
seeds ``>= CALIBRATION_SEED`` (10,000); evaluation uses seed 0, so calibration never sees an
evaluation sample.

``path`` values: a file path, or ``builtin:NAME`` for ``kvpress_ada/calibration/NAME.json`` shipped
with the package (``builtin:smollm2_135m_kvzip``: the default model, KVzip).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .. import packaged

FORMAT = "kvpress_ada.calibration/1"
CALIBRATION_SEED = 10_000  # calibration seeds start here; evaluation uses seed 0 (disjoint samples)
BUILTIN_PREFIX = packaged.BUILTIN_PREFIX
SHIPPED = "builtin:smollm2_135m_kvzip"  # the default model (SmolLM2-135M-Instruct), scorer KVzip
_HERE = Path(__file__).resolve().parent

# the config fields that make a model's attention geometry and weights shape (its identity here)
_IDENTITY_KEYS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta",
                  "tie_word_embeddings")


class CalibrationError(ValueError):
    """A calibration file that is missing, malformed, or made for another model."""


class ModelIdentity(BaseModel):
    """Who a calibration belongs to: a display ``name`` and an architecture ``fingerprint``
    (sha256 of :data:`_IDENTITY_KEYS` of the config; the name is informative, never compared)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    model_type: str
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    fingerprint: str
    config: dict[str, Any]

    def describe(self) -> str:
        return (f"{self.name!r} ({self.model_type}, {self.num_layers} layers x {self.num_kv_heads} kv heads, "
                f"head_dim {self.head_dim}, fingerprint {self.fingerprint})")


def model_identity(config: Any, name: str | None = None) -> ModelIdentity:
    """The :class:`ModelIdentity` of a transformers ``config``."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rope = getattr(config, "rope_parameters", None) or {}
    values = {key: getattr(config, key, None) for key in _IDENTITY_KEYS}
    values.update(head_dim=head_dim, rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", None)),
                  num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads))
    values = json.loads(json.dumps(values, default=str))
    fingerprint = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]
    path = str(getattr(config, "name_or_path", "") or "")
    name = name or (Path(path).name if path else "") or str(values["model_type"])
    return ModelIdentity(name=name, model_type=str(values["model_type"]), num_layers=int(config.num_hidden_layers),
                         num_kv_heads=values["num_key_value_heads"], head_dim=head_dim, fingerprint=fingerprint,
                         config=values)


class MeasuredMeta(BaseModel):
    """What a file measured on a model from text (Q-filters, query statistics) records besides its tensors: its
    format, the model it was made for, the text it came from, and the library, time and command that made it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: str
    model: ModelIdentity
    data: dict[str, Any] = Field(description="the text the queries came from")
    library_version: str
    created: str
    seconds: float | None = None
    command: list[str] | None = None


class Calibration(BaseModel):
    """A calibration file: ``shares[layer][kv_head]`` (non-negative, summing to 1 over the model)
    plus where they came from. ``spread``: the standard deviation of each share over the
    calibration samples (how input-dependent that head's importance is). ``keep`` (optional, a keep
    curve): ``keep[r][layer][kv_head]`` in ``[0, 1]``, the fraction of the context that (layer, kv head)
    keeps at compression ratio ``ratios[r]`` (``ratios`` then increasing)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: str = FORMAT
    model: ModelIdentity
    scorer: dict[str, Any]
    reference: dict[str, Any] = Field(description="the pipeline whose allocation was measured (layers, allocator)")
    ratios: list[float]
    tasks: list[str]
    n: int = Field(ge=1, description="calibration samples in all")
    seeds: dict[str, Any]
    context: int
    question_aware: bool = False
    library_version: str
    created: str
    seconds: float | None = None
    command: list[str] | None = None
    shares: list[list[float]]
    spread: list[list[float]] | None = None
    keep: list[list[list[float]]] | None = None

    @model_validator(mode="after")
    def _check(self) -> "Calibration":
        if self.format != FORMAT:
            raise ValueError(f"format {self.format!r} is not {FORMAT!r}")
        rows = self.shares
        if len(rows) != self.model.num_layers or any(len(r) != self.model.num_kv_heads for r in rows):
            raise ValueError(f"shares must be {self.model.num_layers} layers x {self.model.num_kv_heads} kv heads")
        flat = [x for r in rows for x in r]
        if any(not x >= 0.0 for x in flat) or abs(sum(flat) - 1.0) > 1e-6:
            raise ValueError("shares must be non-negative numbers summing to 1")
        if self.keep is not None:
            n, H = self.model.num_layers, self.model.num_kv_heads
            if len(self.keep) != len(self.ratios) or any(len(t) != n or any(len(r) != H for r in t)
                                                         for t in self.keep):
                raise ValueError(f"keep must be {len(self.ratios)} ratios x {n} layers x {H} kv heads")
            if any(not 0.0 <= x <= 1.0 for t in self.keep for r in t for x in r):
                raise ValueError("keep fractions must lie in [0, 1]")
            if any(b <= a for a, b in zip(self.ratios, self.ratios[1:])):
                raise ValueError(f"the ratios of a keep curve must increase, got {self.ratios}")
        return self

    def check_model(self, config: Any, source: str = "this calibration") -> None:
        """Refuse a model whose fingerprint differs from the one this calibration was made on."""
        packaged.refuse_other_model(self.model, model_identity(config), _HERE, ".json", _budget_fingerprint,
                                    CalibrationError, source, "was made for model {made}, not for {other}",
                                    " (Calibrated(path=...) / CalibratedLayer(path=...))",
                                    "run `kvpress-ada calibrate --model <that model> --out heads.json` and use "
                                    "Calibrated(path='heads.json') / CalibratedLayer(path='heads.json')")

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=1) + "\n")


def _budget_fingerprint(path: str) -> str:
    """The model fingerprint of the budget calibration at ``path`` ("" for DuoAttention's head patterns, which
    share the file format but are no budget shares: never offered to ``Calibrated``)."""
    found = load(path)
    return "" if found.scorer.get("name") == "duo_attention" else found.model.fingerprint


def resolve(path: str) -> Path:
    """The file a ``path`` value names (``builtin:NAME`` is a file shipped in this package)."""
    return packaged.resolve(path, _HERE, ".json")


def load(path: str) -> Calibration:
    """The calibration at ``path`` (cached: read once per file version, never per forward)."""
    return _load(*packaged.version(path, resolve(path), "calibration", "kvpress-ada calibrate --out FILE",
                                   CalibrationError), path)


def shares_tensor(path: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n_layers, n_kv_heads]`` float64 shares of the calibration at ``path`` on ``device`` (cached)."""
    load(path)  # errors first, and the stat below then names an existing file
    file = resolve(path)
    stat = file.stat()
    return _tensor(str(file), stat.st_mtime_ns, stat.st_size, path, str(device))


def keep_curve(path: str, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(ratios [R], keep [R, n_layers, n_kv_heads])`` float64 of the calibration at ``path`` on ``device``
    (cached), or ``None`` when it has no keep curve."""
    cal = load(path)
    if cal.keep is None:
        return None
    file = resolve(path)
    stat = file.stat()
    return _curve(str(file), stat.st_mtime_ns, stat.st_size, path, str(device))


@functools.lru_cache(maxsize=32)
def _curve(file: str, mtime_ns: int, size: int, label: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    cal = _load(file, mtime_ns, size, label)
    return (torch.tensor(cal.ratios, dtype=torch.float64, device=device),
            torch.tensor(cal.keep, dtype=torch.float64, device=device))


@functools.lru_cache(maxsize=32)
def _tensor(file: str, mtime_ns: int, size: int, label: str, device: str) -> torch.Tensor:
    return torch.tensor(_load(file, mtime_ns, size, label).shares, dtype=torch.float64, device=device)


@functools.lru_cache(maxsize=32)
def _load(file: str, mtime_ns: int, size: int, label: str) -> Calibration:
    try:
        return Calibration.model_validate_json(Path(file).read_text())
    except (OSError, ValueError) as err:  # ValidationError is a ValueError
        if isinstance(err, ValidationError):
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "top level"
            why = f"{where}: {first['msg']}"
        else:
            why = str(err)
        raise CalibrationError(f"calibration file {label!r} is not a kvpress-ada calibration ({why})") from None


__all__ = ["CALIBRATION_SEED", "SHIPPED", "Calibration", "CalibrationError", "ModelIdentity", "keep_curve", "load",
           "model_identity", "resolve", "shares_tensor"]
