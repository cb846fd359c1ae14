"""Files a component reads by a ``path`` value: a file path, or ``builtin:NAME`` for one shipped with the
package (calibrations, score surrogates). Loaders cache on :func:`version` so a file is read once per
version, never per forward."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

BUILTIN_PREFIX = "builtin:"


def resolve(path: str, folder: Path, suffix: str) -> Path:
    """The file ``path`` names: ``builtin:NAME`` is ``folder / (NAME + suffix)``, anything else a file path."""
    if path.startswith(BUILTIN_PREFIX):
        return folder / (path[len(BUILTIN_PREFIX):] + suffix)
    return Path(path).expanduser()


def version(path: str, file: Path, what: str, make: str, error: type[Exception]) -> tuple[str, int, int]:
    """``(file, mtime_ns, size)`` of the existing ``file`` (a loader's cache key), or ``error`` in one line
    naming the ``what`` file and, for a user's file, the command that ``make``s one."""
    try:
        stat = file.stat()
    except OSError:
        hint = "" if path.startswith(BUILTIN_PREFIX) else f"; make one with `{make}`"
        raise error(f"{what} file {path!r} not found ({file}){hint}") from None
    if file.is_dir():
        raise error(f"{what} path {path!r} is a directory ({file}); pass the {what} file itself")
    return str(file), stat.st_mtime_ns, stat.st_size


def shipped_for(folder: Path, suffix: str, fingerprint: str, fingerprint_of: Callable[[str], str]) -> list[str]:
    """``builtin:NAME`` of every file shipped in ``folder`` made for the model with ``fingerprint``
    (``fingerprint_of(path)`` reads a file's; unreadable files are skipped): what an error offers instead."""
    found = []
    for file in sorted(folder.glob("*" + suffix)):
        path = BUILTIN_PREFIX + file.name[: -len(suffix)]
        try:
            if fingerprint_of(path) == fingerprint:
                found.append(path)
        except Exception:  # noqa: BLE001 - a hint, never a second error
            continue
    return found
