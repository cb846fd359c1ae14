"""Query statistics (:mod:`kvpress_ada.scorers.expected_attention_stats`: Expected Attention with calibrated
statistics): the mean and covariance of each (layer, query head)'s pre-RoPE queries over offline text, measured
once per model.

``kvpress-ada query-stats`` (:func:`kvpress_ada.harness.query_stats.make_query_stats`) prefills documentation text
(the docstrings ``distill`` and ``qfilters`` also read), un-rotates every query to its pre-RoPE form, leaves out each
text's first ``sinks`` positions (their queries are outliers, as kvpress leaves them out) and accumulates the mean and
the unbiased covariance. NVIDIA kvpress's ``ExpectedAttentionStatsPress`` downloads such statistics per model from the
Hugging Face Hub (computed on BookSum); here they are computed by the library, shipped for the default model
(``builtin:smollm2_135m``) and ``qwen2.5-coder-0.5b`` (``builtin:qwen2_5_coder_0_5b``), and refused, in one line naming
that command (and the shipped file, where one fits), for any other model.

A file holds ``mean [layers, H_q, D]`` (float32) and the covariance's upper triangle ``cov_upper [layers, H_q,
D (D + 1) / 2]`` (float16 where its values fit, else float32: half the bytes of the full matrix, a quarter in float16),
with the model it was made on (:func:`kvpress_ada.calibration.model_identity`).
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

FORMAT = "kvpress_ada.query_stats/1"
METADATA_KEY = "kvpress_ada.query_stats"
SUFFIX = ".safetensors"
SHIPPED = "builtin:smollm2_135m"  # the default model (SmolLM2-135M-Instruct)
MAKE = "kvpress-ada query-stats --model <that model> --out query_stats.safetensors"
_HERE = Path(__file__).resolve().parent
_FLOAT16_MAX = 6.0e4


class QueryStatsError(ValueError):
    """A query-statistics file that is missing, malformed, or made for another model."""


class QueryStatsMeta(MeasuredMeta):
    """What a query-statistics file records besides its tensors."""

    format: str = FORMAT
    data: dict[str, Any] = Field(description="the text the queries came from: texts, tokens, seed, sinks left out")


class QueryStats:
    """``mean [layers, H_q, D]`` and ``cov [layers, H_q, D, D]`` (float32) and their :class:`QueryStatsMeta`."""

    def __init__(self, mean: torch.Tensor, cov: torch.Tensor, meta: QueryStatsMeta):
        n = meta.model.num_layers
        if mean.dim() != 3 or mean.shape[0] != n or mean.shape[2] != meta.model.head_dim:
            raise QueryStatsError(f"query means of shape {tuple(mean.shape)} for a model with {n} layers and head "
                                  f"dimension {meta.model.head_dim}")
        if tuple(cov.shape) != (*mean.shape, mean.shape[-1]):
            raise QueryStatsError(f"query covariances of shape {tuple(cov.shape)} for means of shape "
                                  f"{tuple(mean.shape)}")
        self.mean = mean.float().contiguous()
        self.cov = cov.float().contiguous()
        self.meta = meta
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def n_query_heads(self) -> int:
        return self.mean.shape[1]

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, cov)`` on ``device`` (copied once per device)."""
        found = self._on_device.get(device)
        if found is None:
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable in any mode later
                found = (self.mean.to(device), self.cov.to(device))
            self._on_device[device] = found
        return found

    def check_model(self, config: Any, source: str = "these query statistics") -> None:
        """Refuse, in one line naming the command that makes them, a model other than the one they were made on."""
        packaged.refuse_other_model(self.meta.model, model_identity(config), _HERE, SUFFIX,
                                    lambda p: load(p).meta.model.fingerprint, QueryStatsError,
                                    source, "were measured on model {made}, not on {other}",
                                    " (ExpectedAttentionStats(path=...))",
                                    f"make them with `{MAKE}` and use "
                                    "ExpectedAttentionStats(path='query_stats.safetensors')")

    def __repr__(self) -> str:
        return f"QueryStats(model {self.meta.model.describe()}, {tuple(self.mean.shape)})"


def _upper(cov: torch.Tensor) -> torch.Tensor:
    D = cov.shape[-1]
    rows, cols = torch.triu_indices(D, D)
    return cov[..., rows, cols]


def _full(upper: torch.Tensor, D: int) -> torch.Tensor:
    rows, cols = torch.triu_indices(D, D)
    cov = upper.new_zeros(*upper.shape[:-1], D, D)
    cov[..., rows, cols] = upper
    cov[..., cols, rows] = upper
    return cov


def resolve(path: str) -> Path:
    """The file a ``path`` value names (``builtin:NAME`` is a file shipped in this package)."""
    return packaged.resolve(path, _HERE, SUFFIX)


def load(path: str) -> QueryStats:
    """The query statistics at ``path`` (cached: read once per file version)."""
    return _load(*packaged.version(path, resolve(path), "query statistics", MAKE.replace("<that model>", "NAME"),
                                   QueryStatsError), path)


@functools.lru_cache(maxsize=16)
def _load(file: str, mtime_ns: int, size: int, label: str) -> QueryStats:
    try:
        header, tensors = packaged.read_tensors(file, METADATA_KEY)
        packaged.expect_keys(tensors, {"mean", "cov_upper"})
        mean = tensors["mean"].float()
        cov = _full(tensors["cov_upper"].float(), mean.shape[-1])
        return QueryStats(mean, cov, QueryStatsMeta.model_validate_json(header))
    except Exception as err:  # noqa: BLE001 - safetensors, JSON, pydantic and shape errors all mean one thing
        raise QueryStatsError(f"query statistics file {label!r} is not a kvpress-ada query statistics file "
                              f"({packaged.why_unreadable(err)})") from None


def save(stats: QueryStats, path: str | os.PathLike) -> None:
    """Write ``stats`` to ``path`` (through a temporary file: never half a file); the covariance's upper triangle in
    float16 where every value fits, else float32."""
    upper = _upper(stats.cov)
    if bool(upper.abs().max() < _FLOAT16_MAX) and bool(torch.isfinite(upper).all()):
        upper = upper.half()
    packaged.write_tensors(path, {"mean": stats.mean, "cov_upper": upper}, METADATA_KEY, stats.meta.model_dump_json())


__all__ = ["FORMAT", "SHIPPED", "QueryStats", "QueryStatsError", "QueryStatsMeta", "load", "resolve", "save"]
