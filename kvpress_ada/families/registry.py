"""The families kvpress_ada serves, by ``config.model_type``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

from .base import Family, setting

F = TypeVar("F", bound=type[Family])

_FAMILIES: dict[str, type[Family]] = {}


def register_family(*model_types: str, override: bool = False) -> Callable[[F], F]:
    """Class decorator: serve models whose ``config.model_type`` is one of ``model_types`` with this adapter.
    A model type is registered once unless ``override=True``."""
    if not model_types or not all(isinstance(t, str) and t for t in model_types):
        raise ValueError(f"register_family needs one or more non-empty model_type strings, got {model_types!r}")

    def decorator(cls: F) -> F:
        if not (isinstance(cls, type) and issubclass(cls, Family)):
            raise TypeError(f"register_family{model_types!r} expects a subclass of Family, got {cls!r}")
        if not override:
            for taken in model_types:
                if taken in _FAMILIES:
                    raise ValueError(f"model_type {taken!r} is already served by {_FAMILIES[taken].__qualname__}; "
                                     f"pass register_family({taken!r}, override=True) to replace it")
        for model_type in model_types:
            _FAMILIES[model_type] = cls
        return cls

    return decorator


def unregister_family(model_type: str) -> None:
    """Stop serving ``model_type`` (tests and plugins cleaning up)."""
    _FAMILIES.pop(model_type, None)


def supported_model_types() -> tuple[str, ...]:
    """Every registered ``model_type``, sorted."""
    return tuple(sorted(_FAMILIES))


def family_for(config: Any) -> Family:
    """The adapter of the family of ``config`` (a transformers config or a ``config.json`` mapping); a one-line
    ``ValueError`` naming its ``model_type`` and the supported ones when no family serves it."""
    model_type = setting(config, "model_type")
    cls = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if cls is None:
        raise ValueError(f"unsupported model type {model_type!r}: kvpress_ada supports "
                         f"{', '.join(supported_model_types())} (kvpress_ada.families.register_family adds a family)")
    return cls(config)


def family_of(model: Any) -> Family:
    """The adapter of ``model``'s family (``family_for(model.config)``)."""
    return family_for(getattr(model, "config", None))


class ModelTypes(Sequence[str]):
    """A live, read-only view of :func:`supported_model_types` (what ``SUPPORTED_MODEL_TYPES`` was as a tuple)."""

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return supported_model_types()[index]

    def __len__(self) -> int:
        return len(_FAMILIES)

    def __iter__(self) -> Iterator[str]:
        return iter(supported_model_types())

    def __contains__(self, model_type: object) -> bool:
        return model_type in _FAMILIES

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(supported_model_types())


SUPPORTED_MODEL_TYPES = ModelTypes()
