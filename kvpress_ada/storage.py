"""How a press stores the entries it keeps: a storage kind (full precision by default, int8, int4, fp8, or one
registered with :func:`register_storage`).

Selection never depends on the storage: scorers read full-precision keys and values, and entries are stored
as the kind says when they are kept (decode tokens when they are appended). A kind is an extension point: it
declares its record layout (:attr:`Storage.layout`, a :class:`~kvpress_ada.kernels.quantized.scheme.RecordLayout`:
encoding, bits, group size, residual, bytes per record; ``None`` for entries in the model's own dtype) and its
:attr:`Storage.structure`, which names the layer classes that hold its entries in each host's table (the
transformers host's ``register_ragged_layer``, the serving layer's ``register_page_pool``; a structure a host
has no class for is refused in one line). Hosts and kernels ask the kind; none branches on a kind's name, and
the policy imports no host. A :class:`RecordStorage` subclass that declares a ``layout`` whose encoding the
kernels read is served by both hosts in every mode with no other change.

Record kinds share one machinery (``docs/design.md``, "Scheme"; :mod:`kvpress_ada.kernels.quantized.scheme`): one
record per token, each ragged row (batch, kv head) keeps its first entry (usually the attention sink) in full
precision, and its newest ``residual`` entries too (KIVI's residual: a ring beside their records, which those
entries read from until ``residual`` newer ones arrive), so a ragged row appends in place and records stay one
per token.

* ``int8`` / ``int4``: asymmetric integers in groups of ``group_size`` channels with one scale and one zero
  point per group (in float16 for a float32 model, ``half_scales``: an int4 record of head dim 64 is 40 bytes,
  not 48); keys are centred by their row's mean key and rotated by a fixed random-sign Hadamard matrix before
  they are quantized. Default residual 4: the ring costs ``2 * residual * head_dim`` floats per row whatever
  the row keeps, so 32 entries (KIVI's choice, once the default) were 38% of what int4 at r = 0.75 holds at 1k
  tokens on the default model (8.4% of the fp32 full cache; now 4.8%), for a teacher-forced KL from the full
  cache of 0.052 against 0.060 without a ring (4 entries: 0.060; ``benchmarks/README.md``, "Bytes at short
  contexts"). At long contexts a larger ring costs little: ``Int4(residual=32)``.
* ``fp8``: float8 e4m3 (the KV format serving engines deploy) with one float32 scale per token per kv head
  (``group_size=None``, the default) or per group of channels; keys and values stored as they are, residual 0 by
  default. Measured on tiny models (``benchmarks/fp8_scheme_choice.py``: KL of teacher-forced next-token
  distributions vs full precision, context and decode stored): centring, rotation and the anchor change e4m3's
  KL by under 10% either way (its error is relative to each element, so an offset or an outlier channel costs it
  little, unlike a uniform integer step), groups of 32 lower it by 3-23%, a residual of 32 by 15-20%; e4m3 sits
  between int8 and int4 (about 30x int8's KL, an eighth to a tenth of int4's).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator

from .components import Component, Registry
from .kernels.quantized.scheme import RecordLayout

#: dtypes of the model's keys and values a record storage serves
QUANTIZABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Storage(Component):
    """What kept entries are stored as, and the layer classes that hold them on each host (module docstring).
    This base keeps entries in the model's own dtype; :class:`RecordStorage` keeps records of a layout."""

    kind: ClassVar[str] = "storage"
    #: how the kept entries are laid out, which names the layer classes a host holds them in (its tables:
    #: ``register_ragged_layer`` in the transformers host, ``register_page_pool`` in the serving layer);
    #: ``"native"``: entries in the model's dtype
    structure: ClassVar[str] = "native"

    @property
    def layout(self) -> RecordLayout | None:
        """The record layout of a kind stored as records (what its layers are built from and what the kernels
        read); ``None``: entries in the model's own dtype."""
        return None

    @property
    def quantized(self) -> bool:
        """Whether kept entries are stored other than in the model's dtype (a policy answer: ``Pipeline``
        refuses a masking evictor with such a kind, and ratio 0 still stores every entry as it says)."""
        return self.layout is not None

    @property
    def label(self) -> str:
        """The registered name (what ``storage=`` and ``--storage`` take)."""
        return str(getattr(self, "name", type(self).__name__))

    # ------------------------------------------------------------------ checks
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


def storage_names() -> list[str]:
    """The registered storage kinds (what ``storage=`` and the command line's ``--storage`` take)."""
    return STORAGES.names()


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


class RecordStorage(Storage):
    """A kind stored as one record per token of :attr:`layout` (declared by a subclass), with each row's
    anchor and newest ``residual`` entries in full precision, held by the hosts' record layers
    (:class:`~kvpress_ada.hosts.transformers.quantized_cache.QuantizedRaggedLayer`,
    :class:`~kvpress_ada.serving.record_pages.QuantizedPagePool`)."""

    structure: ClassVar[str] = "records"
    residual: int = Field(4, description="each row's newest entries kept in full precision (0: none)")
    max_residual: ClassVar[int] = 1024

    @field_validator("residual")
    @classmethod
    def _supported_residual(cls, value: int) -> int:
        if not 0 <= value <= cls.max_residual:
            raise ValueError(f"residual={value} must be between 0 (off) and {cls.max_residual} entries per row")
        return value

    @property
    def layout(self) -> RecordLayout:
        raise NotImplementedError(f"storage {self.label!r} is stored as records but declares no layout")

    def check_geometry(self, head_dim: int, dtype: torch.dtype) -> None:
        name, group = type(self).__name__, self.layout.group
        if group and head_dim % group:
            raise ValueError(f"{name}(group_size={group}) needs a head dimension divisible by it; this model's is "
                             f"{head_dim}: use a group size dividing {head_dim}")
        if dtype not in QUANTIZABLE_DTYPES:
            raise ValueError(f"{name} quantizes float32, float16 or bfloat16 keys and values, not {dtype}")


class _Grouped(RecordStorage):
    """Integers in groups of ``group_size`` channels with a scale and zero point per group (keys centred and
    rotated first; each row's first entry and its newest ``residual`` entries in full precision, 0 to 1024,
    default 32, 0: off)."""

    group_size: int = Field(32, description="channels of the head dimension sharing one scale and zero point")
    half_scales: bool = Field(True, description="a float32 model's scales and zero points in float16 (a 16-bit "
                                                "model's are in its dtype either way); False: float32")
    allowed_group_sizes: ClassVar[tuple[int, ...]] = (16, 32, 64, 128)
    bits: ClassVar[int] = 8

    @field_validator("group_size")
    @classmethod
    def _supported_group_size(cls, value: int) -> int:
        if value not in cls.allowed_group_sizes:
            raise ValueError(f"group_size={value} is not supported: use one of "
                             f"{', '.join(map(str, cls.allowed_group_sizes))}")
        return value

    @property
    def layout(self) -> RecordLayout:
        return RecordLayout("int", type(self).bits, self.group_size, self.residual,
                            scale_bits=16 if self.half_scales else 0)


@register_storage("int8")
class Int8(_Grouped):
    """8-bit integers, per token in groups of ``group_size`` channels."""

    name: Literal["int8"] = "int8"
    bits: ClassVar[int] = 8


@register_storage("int4")
class Int4(_Grouped):
    """4-bit integers (two per byte), per token in groups of ``group_size`` channels."""

    name: Literal["int4"] = "int4"
    bits: ClassVar[int] = 4


@register_storage("fp8")
class Fp8(RecordStorage):
    """float8 e4m3 with one float32 scale per token per kv head (``group_size=None``) or per group of
    ``group_size`` channels; keys and values stored as they are (module docstring), each row's first entry and
    its newest ``residual`` entries (default 0) in full precision."""

    name: Literal["fp8"] = "fp8"
    group_size: int | None = Field(None, description="channels sharing one scale (None: the whole head dimension)")
    residual: int = Field(0, description="each row's newest entries kept in full precision (0: none)")
    allowed_group_sizes: ClassVar[tuple[int, ...]] = (16, 32, 64, 128)

    @field_validator("group_size")
    @classmethod
    def _supported_group_size(cls, value: int | None) -> int | None:
        if value is not None and value not in cls.allowed_group_sizes:
            raise ValueError(f"group_size={value} is not supported: use None (one scale per head) or one of "
                             f"{', '.join(map(str, cls.allowed_group_sizes))}")
        return value

    @property
    def layout(self) -> RecordLayout:
        return RecordLayout("e4m3", 8, self.group_size or 0, self.residual, rotate_keys=False)
