"""Base class and name registries for every configurable component.

Each component (scorer, layer schedule, head allocator, evictor) is a frozen pydantic
model with a ``name`` discriminator. Registries map that name to the class, so a whole
pipeline round-trips through JSON/YAML and users can plug in their own classes by name.

A name is registered once: a second registration (by another module, or a class of the same
name defined twice) is refused unless the caller passes ``override=True``. Old names of a
component stay loadable as ``aliases``: they resolve to the canonical class, and dumped configs
carry the canonical name.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Iterable, Iterator, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValidationError):
    """A refused configuration, as pydantic's ``ValidationError`` (``except ValidationError`` and
    ``except ValueError`` both catch it, ``errors()`` lists every error), printed as one line: the
    model, where, the first error's message and how many more there are."""

    def __str__(self) -> str:
        return describe_validation_error(self)


def describe_validation_error(err: ValidationError) -> str:
    """One line for a ``ValidationError``: ``Model: field.path: message (and N more errors)``."""
    errors = err.errors()
    if not errors:
        return err.title
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{err.title}: {where + ': ' if where else ''}{' '.join(message.split())}{more}"


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Re-raise a pydantic ``ValidationError`` as :class:`ConfigError` (same errors, one-line message)."""
    try:
        yield
    except ConfigError:
        raise
    except ValidationError as err:
        raise ConfigError.from_exception_data(err.title, err.errors()) from None  # type: ignore[arg-type]


class OneLineErrors(BaseModel):
    """A pydantic model whose construction and ``model_validate*`` raise :class:`ConfigError`."""

    def __init__(self, /, **data: Any) -> None:
        with one_line_errors():
            super().__init__(**data)

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:
        with one_line_errors():
            return super().model_validate(obj, *args, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: Any, *args: Any, **kwargs: Any) -> Any:
        with one_line_errors():
            return super().model_validate_json(json_data, *args, **kwargs)


class Component(OneLineErrors):
    """A frozen, validated config object; subclasses set ``name`` as a ``Literal`` default."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: ClassVar[str] = "component"
    #: made for one model (e.g. calibrated on it) and refused by ``check_model`` for any other
    model_specific: ClassVar[bool] = False

    def check_model(self, config: Any) -> None:
        """Raise ``ValueError`` when this component cannot serve a model with this ``config``
        (called once when a press meets a model, never per forward). Most components serve any."""


C = TypeVar("C", bound=type[Component])


class Registry:
    """Name -> class table for one kind of component (``scorer``, ``allocator``, ...).

    ``decorator`` is the public decorator's name, used in error messages (default
    ``register_<kind>`` with spaces turned into underscores).
    """

    def __init__(self, kind: str, base: type[Component], decorator: str | None = None):
        self.kind = kind
        self.base = base
        self.decorator = decorator or "register_" + kind.replace(" ", "_")
        self._classes: dict[str, type[Component]] = {}
        self._aliases: dict[str, str] = {}  # old name -> canonical name

    def register(self, name: str, aliases: Iterable[str] = (), override: bool = False) -> Callable[[C], C]:
        """Class decorator: make ``cls`` usable by ``name`` (and by each old name in ``aliases``).

        Registering a name (or alias) that is already taken raises ``ValueError`` unless
        ``override=True``: another module must never silently replace a component.
        """
        aliases = tuple(aliases)

        def decorator(cls: C) -> C:
            call = f"{self.decorator}({name!r})"
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{call} expects a subclass of {self.base.__name__}, got {cls!r}")
            if not name or not isinstance(name, str):
                raise ValueError(f"{self.decorator} needs a non-empty string name, got {name!r}")
            klass: type[Component] = cls
            field = klass.model_fields.get("name")
            if field is None or field.default != name:
                raise TypeError(
                    f"{cls.__name__} must declare `name: Literal[{name!r}] = {name!r}` to be registered as {name!r}"
                )
            for alias in aliases:
                if not alias or not isinstance(alias, str) or alias == name:
                    raise ValueError(f"{call}: bad alias {alias!r}")
            if not override:
                for taken in (name, *aliases):
                    owner = self._owner(taken)
                    if owner is not None:
                        raise ValueError(
                            f"a {self.kind} named {taken!r} is already registered ({owner.__module__}."
                            f"{owner.__qualname__}); pass {self.decorator}({taken!r}, override=True) to replace it"
                        )
            self._aliases.pop(name, None)
            self._classes[name] = cls
            for alias in aliases:
                self._classes.pop(alias, None)
                self._aliases[alias] = name
            return cls

        return decorator

    def decorator_function(self) -> Callable[..., Callable[[C], C]]:
        """The public decorator named :attr:`decorator`, ``register_<kind>(name, override=False)``:
        :meth:`register` without aliases."""
        def register(name: str, override: bool = False) -> Callable[[C], C]:
            return self.register(name, override=override)

        register.__name__ = register.__qualname__ = self.decorator
        register.__doc__ = f"Decorator making a user's ``{self.base.__name__}`` subclass usable by ``name`` in configs."
        return register

    def _owner(self, name: str) -> type[Component] | None:
        if name in self._classes:
            return self._classes[name]
        if name in self._aliases:
            return self._classes.get(self._aliases[name])
        return None

    def unregister(self, name: str) -> None:
        """Remove ``name`` and the aliases pointing to it (tests and plugins cleaning up)."""
        self._classes.pop(name, None)
        self._aliases.pop(name, None)
        for alias in [a for a, target in self._aliases.items() if target == name]:
            del self._aliases[alias]

    def names(self) -> list[str]:
        """Canonical names, sorted (aliases are not listed)."""
        return sorted(self._classes)

    def aliases(self) -> dict[str, str]:
        """Old name -> canonical name."""
        return dict(self._aliases)

    def canonical(self, name: str) -> str:
        """The canonical name of ``name`` (itself, or the name an alias points to)."""
        if not isinstance(name, str):
            raise ValueError(f"a {self.kind} name must be a string, got {name!r}")
        name = self._aliases.get(name, name)
        if name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; registered {self.kind}s: {', '.join(self.names())}")
        return name

    def get(self, name: str) -> type[Component]:
        return self._classes[self.canonical(name)]

    def classes(self) -> dict[str, type[Component]]:
        """Canonical name -> class, sorted by name."""
        return {name: self._classes[name] for name in self.names()}

    def build(self, value: Any) -> Component:
        """Turn a name, a dict with ``name`` or an instance into a validated component."""
        if isinstance(value, self.base):
            return value
        if isinstance(value, str):
            return self.get(value)()
        if isinstance(value, dict):
            if "name" not in value:
                raise ValueError(f"a {self.kind} config needs a 'name' field; registered: {', '.join(self.names())}")
            name = self.canonical(value["name"])
            return self._classes[name].model_validate({**value, "name": name})
        raise TypeError(f"cannot build a {self.kind} from {type(value).__name__}: {value!r}")
