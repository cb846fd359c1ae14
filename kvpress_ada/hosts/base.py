"""The contract between a press (:class:`~kvpress_ada.Pipeline`, pure policy) and a host, and the
registry the policy finds hosts in.

A host attaches a press to something that runs a model: it routes the model's attention, builds the
storage the press's kept entries go to (its layer classes, chosen by the press's evictor and
``storage``), checks what the model can serve, and calls :meth:`Pipeline.keep
<kvpress_ada.Pipeline.keep>` whenever entries are evicted. ``press(model)`` asks the first registered
host that serves ``model``. This module imports nothing of the policy or of any host: hosts import the
policy and register here, so no import circle forms.
"""

from __future__ import annotations

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


def host_names() -> list[str]:
    return list(_HOSTS)


def host_for(model: Any) -> Host:
    """The first registered host that serves ``model``; a one-line ``ValueError`` when none does."""
    for host in _HOSTS.values():
        if host.serves(model):
            return host
    raise ValueError(f"no kvpress_ada host runs a {type(model).__name__}: registered hosts "
                     f"({', '.join(_HOSTS) or 'none'}) serve Hugging Face transformers models "
                     "(torch.nn.Module with a config); other engines have their own entry points")
