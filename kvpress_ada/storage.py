"""How a press stores the entries it keeps: a storage kind (full precision by default, int8, int4, fp8, or one
registered with :func:`register_storage`).

Selection never depends on the storage: scorers read full-precision keys and values, and entries are stored
as the kind says when they are kept (decode tokens when they are appended). A kind is an extension point: it
declares its record layout (:attr:`Storage.layout`, a :class:`~kvpress_ada.kernels.quantized.RecordLayout`:
encoding, bits, group size, residual, bytes per record; ``None`` for entries in the model's own dtype) and the
layer classes that hold its entries on each host (:meth:`Storage.ragged_layer` / :meth:`Storage.ragged_cache`
for the transformers host, :meth:`Storage.page_pool` for the engine-neutral serving layer and the vLLM host).
Hosts and kernels ask the kind; none branches on a kind's name. A :class:`RecordStorage` subclass that
declares a ``layout`` whose encoding the kernels read is served by both hosts in every mode with no other
change; a kind with another structure overrides the layer methods. The host classes are imported when a
method is first called (the policy imports no host at import time).

Record kinds share one machinery (``docs/design.md``, "Scheme"; :mod:`kvpress_ada.kernels.quantized`): one
record per token, each ragged row (batch, kv head) keeps its first entry (usually the attention sink) in full
precision, and its newest ``residual`` entries too (KIVI's residual: a ring beside their records, which those
entries read from until ``residual`` newer ones arrive), so a ragged row appends in place and records stay one
per token.

* ``int8`` / ``int4``: asymmetric integers in groups of ``group_size`` channels with one scale and one zero
  point per group; keys are centred by their row's mean key and rotated by a fixed random-sign Hadamard matrix
  before they are quantized (default residual 32: it cuts the KL divergence from full precision through the
  cache about five-fold for int4, at ``2 * residual * head_dim`` floats per row).
* ``fp8``: float8 e4m3 (the KV format serving engines deploy) with one float32 scale per token per kv head
  (``group_size=None``, the default) or per group of channels; keys and values stored as they are, residual 0 by
  default. Measured on tiny models (``benchmarks/fp8_scheme_choice.py``: KL of teacher-forced next-token
  distributions vs full precision, context and decode stored): centring, rotation and the anchor change e4m3's
  KL by under 10% either way (its error is relative to each element, so an offset or an outlier channel costs it
  little, unlike a uniform integer step), groups of 32 lower it by 3-23%, a residual of 32 by 15-20%; e4m3 sits
  between int8 and int4 (about 30x int8's KL, an eighth to a tenth of int4's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator

from .components import Component, Registry
from .kernels.quantized import RecordLayout

if TYPE_CHECKING:
    from .hosts.paging import PagePool
    from .hosts.transformers.ragged_cache import RaggedCache, RaggedLayer

#: dtypes of the model's keys and values a record storage serves
QUANTIZABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Storage(Component):
    """What kept entries are stored as, and the layer classes that hold them on each host (module docstring).
    This base keeps entries in the model's own dtype; :class:`RecordStorage` keeps records of a layout."""

    kind: ClassVar[str] = "storage"

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

    # ------------------------------------------------------------------ the layer classes that hold it
    def ragged_layer(self, decode_reserve: int = 8) -> RaggedLayer:
        """An empty layer of the transformers host's ragged cache holding this kind's entries."""
        from .hosts.transformers.ragged_cache import RaggedLayer

        return RaggedLayer(decode_reserve)

    def ragged_cache(self, config: Any = None, num_layers: int | None = None, decode_reserve: int = 8) -> RaggedCache:
        """An empty ragged cache (transformers host) whose layers are :meth:`ragged_layer`'s."""
        from .hosts.transformers.ragged_cache import RaggedCache

        return RaggedCache(config=config, num_layers=num_layers, decode_reserve=decode_reserve, storage=self)

    def page_pool(self, pages: torch.Tensor, native: Any = None) -> PagePool:
        """The pool of one layer's pages holding this kind's entries over ``pages [P, 2, S, D]`` (each page's
        keys then its values, in the model's dtype: e.g. an engine's KV tensor): ``native(pages)`` when the host
        gives its own pool for entries in the model's dtype (vLLM's layout and kernels), else a plain
        :class:`~kvpress_ada.hosts.paging.PagePool` over the same memory."""
        from .hosts.paging import PagePool

        return native(pages) if native is not None else PagePool(pages[:, 0], pages[:, 1])

    def pool_reserve(self, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Pages per (request, kv head) row a first eviction may take beyond the pages it frees (a scheduler
        keeps them spare until then)."""
        return 0

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
    :class:`~kvpress_ada.hosts.quantized_paging.QuantizedPagePool`)."""

    residual: int = Field(32, description="each row's newest entries kept in full precision (0: none)")
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

    def ragged_layer(self, decode_reserve: int = 8) -> RaggedLayer:
        from .hosts.transformers.quantized_cache import QuantizedRaggedLayer

        return QuantizedRaggedLayer(self.layout, decode_reserve)

    def ragged_cache(self, config: Any = None, num_layers: int | None = None, decode_reserve: int = 8) -> RaggedCache:
        from .hosts.transformers.quantized_cache import QuantizedRaggedCache

        return QuantizedRaggedCache(self, config=config, num_layers=num_layers, decode_reserve=decode_reserve)

    def page_pool(self, pages: torch.Tensor, native: Any = None) -> PagePool:
        """Records over the bytes of ``pages [P, 2, S, D]`` (each page's bytes whole: ``native`` is not used)."""
        from .hosts.quantized_paging import QuantizedPagePool

        P, _, S, D = pages.shape
        raw = torch.as_strided(pages, (P, 2 * S * D), (pages.stride(0), 1)).view(torch.uint8)
        return QuantizedPagePool(raw, S, D, pages.dtype, self.layout)

    def pool_reserve(self, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        from .hosts.quantized_paging import QuantizedPagePool

        return QuantizedPagePool.reserve_pages(page_size, head_dim, dtype, self.layout)

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
        return RecordLayout("int", type(self).bits, self.group_size, self.residual)


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
