"""Base class and name registries for every configurable component.

Each component (scorer, layer schedule, head allocator, evictor) is a frozen pydantic
model with a ``name`` discriminator. Registries map that name to the class, so a whole
pipeline round-trips through JSON/YAML and users can plug in their own classes by name.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class Component(BaseModel):
    """A frozen, validated config object; subclasses set ``name`` as a ``Literal`` default."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: ClassVar[str] = "component"


class Registry:
    """Name -> class table for one kind of component (``scorer``, ``allocator``, ...)."""

    def __init__(self, kind: str, base: type[Component]):
        self.kind = kind
        self.base = base
        self._classes: dict[str, type[Component]] = {}

    def register(self, name: str):
        """Class decorator: make ``cls`` usable by ``name`` in configs and presets."""

        def decorator(cls: type[Component]) -> type[Component]:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"register_{self.kind}({name!r}) expects a subclass of {self.base.__name__}, got {cls!r}")
            if not name or not isinstance(name, str):
                raise ValueError(f"register_{self.kind} needs a non-empty string name, got {name!r}")
            field = cls.model_fields.get("name")
            if field is None or field.default != name:
                raise TypeError(
                    f"{cls.__name__} must declare `name: Literal[{name!r}] = {name!r}` to be registered as {name!r}"
                )
            previous = self._classes.get(name)
            if previous is not None and previous.__qualname__ != cls.__qualname__:
                raise ValueError(f"a {self.kind} named {name!r} is already registered ({previous.__qualname__})")
            self._classes[name] = cls
            return cls

        return decorator

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type[Component]:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; registered {self.kind}s: {', '.join(self.names())}") from None

    def build(self, value: Any) -> Component:
        """Turn a name, a dict with ``name`` or an instance into a validated component."""
        if isinstance(value, self.base):
            return value
        if isinstance(value, str):
            return self.get(value)()
        if isinstance(value, dict):
            if "name" not in value:
                raise ValueError(f"a {self.kind} config needs a 'name' field; registered: {', '.join(self.names())}")
            return self.get(value["name"]).model_validate(value)
        raise TypeError(f"cannot build a {self.kind} from {type(value).__name__}: {value!r}")
