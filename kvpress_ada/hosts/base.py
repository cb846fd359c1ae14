"""The contract between a press (:class:`~kvpress_ada.Pipeline`, pure policy) and a host, and the
registry the policy finds hosts in.

A host attaches a press to something that runs a model: it routes the model's attention, builds the
storage the press's kept entries go to (its layer classes, chosen by the press's evictor and
``storage``), checks what the model can serve, and calls :meth:`Pipeline.keep
<kvpress_ada.Pipeline.keep>` whenever entries are evicted. ``press(model)`` asks the first registered
host that serves ``model``. This module imports nothing of the policy or of any host: hosts import the
policy and register here, so no import circle forms. The built-in hosts (:data:`BUILTIN_HOSTS`) are
imported, and so register, the first time a model is looked up, never when the package is imported.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Host(Protocol):
    """What ``press(model, **options)`` needs of a host."""

    #: a short name, shown when no host serves a model
    name: str

    def serves(self, model: Any) -> bool:
        """Whether ``model`` is a kind of model this host runs (its checks then refuse what it cannot serve)."""

    def apply(self, press: Any, model: Any, **options: Any) -> AbstractContextManager[Any]:
        """A context manager applying ``press`` to ``model`` inside the ``with`` block."""


_HOSTS: dict[str, Host] = {}

#: name -> module of each built-in host, imported (it registers itself there) on the first lookup; looked
#: through first, in this order, then the hosts registered by others
BUILTIN_HOSTS: dict[str, str] = {"transformers": "kvpress_ada.hosts.transformers"}


def register_host(host: Host, override: bool = False) -> Host:
    """Make ``host`` one of the hosts ``press(model)`` looks through (in registration order). A name
    is registered once unless ``override=True``."""
    if not isinstance(host, Host):
        raise TypeError(f"register_host expects an object with name, serves() and apply(), got {host!r}")
    if host.name in _HOSTS and not override:
        raise ValueError(f"a host named {host.name!r} is already registered; pass override=True to replace it")
    _HOSTS[host.name] = host
    return host


def unregister_host(name: str) -> None:
    """Remove the host registered as ``name`` (tests and plugins cleaning up)."""
    _HOSTS.pop(name, None)


def _hosts() -> list[Host]:
    """Every host in lookup order: the built-in ones (imported now if they are not yet), then the others."""
    for name, module in BUILTIN_HOSTS.items():
        if name not in _HOSTS:
            importlib.import_module(module)  # registers the host, once: a later import is a no-op
    builtin = [_HOSTS[name] for name in BUILTIN_HOSTS if name in _HOSTS]
    return builtin + [host for name, host in _HOSTS.items() if name not in BUILTIN_HOSTS]


def host_names() -> list[str]:
    """The names of every host, in the order ``press(model)`` looks through them."""
    return [host.name for host in _hosts()]


def host_for(model: Any) -> Host:
    """The first host that serves ``model``; a one-line ``ValueError`` when none does."""
    hosts = _hosts()
    for host in hosts:
        if host.serves(model):
            return host
    raise ValueError(f"no kvpress_ada host runs a {type(model).__name__}: registered hosts "
                     f"({', '.join(h.name for h in hosts) or 'none'}) serve Hugging Face transformers models "
                     "(torch.nn.Module with a config); other engines have their own entry points")
