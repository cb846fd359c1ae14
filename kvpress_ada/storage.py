"""How a press stores the entries it keeps: full precision (default), int8 or int4.

Selection never depends on the storage: scorers read full-precision keys and values, and entries are
quantized when they are kept (decode tokens when they are appended). A host picks the layer class
that holds a press's entries from its evictor and this component (the layer class *is* the storage
kind, as in transformers' ``cache_utils``). Scheme (``docs/design.md``, ``kernels/quantized.py``): one
record per token, asymmetric integers in groups of ``group_size`` channels of the head dimension with one
scale and one zero point per group; keys are centred by their row's mean key and rotated by a fixed
random-sign Hadamard matrix before they are quantized, values are quantized as they are, and each ragged
row (batch, kv head) keeps its first entry (usually the attention sink) in full precision, and its newest
``residual`` entries too (KIVI's residual: a ring beside their records, which those entries read from
until ``residual`` newer ones arrive; it cuts the KL divergence from full precision through the cache about
five-fold for int4, at ``2 * residual * head_dim`` floats per row). A token is quantized on its own (given
its row's fixed centre), so a ragged row appends in place and records stay one per token.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, cast

import torch
from pydantic import Field, field_validator

from .components import Component, Registry

#: dtypes of the model's keys and values a quantized storage serves
QUANTIZABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Storage(Component):
    """What kept entries are stored as. ``bits``: bits per stored element (``None``: the model's own dtype)."""

    kind: ClassVar[str] = "storage"
    bits: ClassVar[int | None] = None

    @property
    def quantized(self) -> bool:
        return type(self).bits is not None

    @property
    def label(self) -> str:
        """The registered name (what ``storage=`` and ``--storage`` take)."""
        return str(getattr(self, "name", type(self).__name__))

    def record_scheme(self) -> tuple[int, int, int] | None:
        """``(bits, group_size, residual)`` of the records a quantized storage keeps (what a host's quantized
        layer or page pool is built from); ``None`` in full precision."""
        if not self.quantized:
            return None
        raise NotImplementedError(f"storage {self.label!r} is quantized but names no record scheme")

    def check_geometry(self, head_dim: int, dtype: torch.dtype) -> None:
        """Raise a one-line ``ValueError`` when this storage cannot hold entries of ``head_dim`` channels of
        ``dtype`` (called by a host when the press meets a model)."""

    def check_model(self, config: Any) -> None:
        head_dim = model_head_dim(config)
        if head_dim is not None:
            self.check_geometry(head_dim, torch.float32)


STORAGES = Registry("storage", Storage)


def register_storage(name: str, override: bool = False):
    return STORAGES.register(name, override=override)


def model_head_dim(config: Any) -> int | None:
    """The head dimension of a model ``config`` (``head_dim``, else ``hidden_size // num_attention_heads``)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        head_dim = text.hidden_size // text.num_attention_heads
    return None if head_dim is None else int(head_dim)


@register_storage("full")
class FullPrecision(Storage):
    """Entries stored in the model's own dtype (the default)."""

    name: Literal["full"] = "full"


class _Grouped(Storage):
    """Integers in groups of ``group_size`` channels with a scale and zero point per group (keys centred and
    rotated first; each row's first entry and its newest ``residual`` entries in full precision, 0 to 1024,
    default 32, 0: off)."""

    group_size: int = Field(32, description="channels of the head dimension sharing one scale and zero point")
    residual: int = Field(32, description="each row's newest entries kept in full precision (0: none)")
    allowed_group_sizes: ClassVar[tuple[int, ...]] = (16, 32, 64, 128)
    max_residual: ClassVar[int] = 1024

    @field_validator("residual")
    @classmethod
    def _supported_residual(cls, value: int) -> int:
        if not 0 <= value <= cls.max_residual:
            raise ValueError(f"residual={value} must be between 0 (off) and {cls.max_residual} entries per row")
        return value

    @field_validator("group_size")
    @classmethod
    def _supported_group_size(cls, value: int) -> int:
        if value not in cls.allowed_group_sizes:
            raise ValueError(f"group_size={value} is not supported: use one of "
                             f"{', '.join(map(str, cls.allowed_group_sizes))}")
        return value

    def record_scheme(self) -> tuple[int, int, int] | None:
        return cast(int, type(self).bits), self.group_size, self.residual

    def check_geometry(self, head_dim: int, dtype: torch.dtype) -> None:
        name = type(self).__name__
        if head_dim % self.group_size:
            raise ValueError(f"{name}(group_size={self.group_size}) needs a head dimension divisible by it; this "
                             f"model's is {head_dim}: use a group size dividing {head_dim}")
        if dtype not in QUANTIZABLE_DTYPES:
            raise ValueError(f"{name} quantizes float32, float16 or bfloat16 keys and values, not {dtype}")


@register_storage("int8")
class Int8(_Grouped):
    """8-bit integers, per token in groups of ``group_size`` channels."""

    name: Literal["int8"] = "int8"
    bits: ClassVar[int | None] = 8


@register_storage("int4")
class Int4(_Grouped):
    """4-bit integers (two per byte), per token in groups of ``group_size`` channels."""

    name: Literal["int4"] = "int4"
    bits: ClassVar[int | None] = 4
