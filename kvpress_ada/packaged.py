"""Files a component reads by a ``path`` value: a file path, or ``builtin:NAME`` for one shipped with the
package (calibrations, score surrogates). Loaders cache on :func:`version` so a file is read once per
version, never per forward."""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path
from typing import Any, Callable

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


def read_tensors(file: str, metadata_key: str) -> tuple[str, dict]:
    """The header string stored under ``metadata_key`` and every tensor of the safetensors ``file``
    (``ValueError`` when the header has no such entry)."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        header = (f.metadata() or {}).get(metadata_key)
        if header is None:
            raise ValueError(f"no {metadata_key!r} metadata in its header")
        return header, {key: f.get_tensor(key) for key in f.keys()}


def expect_keys(tensors: dict, expected: set[str]) -> None:
    """``ValueError`` naming the tensors found when they are not exactly ``expected``."""
    if set(tensors) != expected:
        raise ValueError(f"tensors {sorted(tensors)}, expected {sorted(expected)}")


def why_unreadable(err: Exception) -> str:
    """One line saying why a file did not load: a pydantic error's first location and message, or the error's
    own text (safetensors, JSON and shape errors)."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(p) for p in first['loc']) or 'top level'}: {first['msg']}"
    return " ".join(str(err).split()) or type(err).__name__


def write_tensors(path: str | PathLike, tensors: dict, metadata_key: str, header: str) -> None:
    """Write ``tensors`` with ``header`` under ``metadata_key`` to ``path`` through a temporary file (never half a
    file)."""
    from safetensors.torch import save_file

    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={metadata_key: header})
    os.replace(tmp, target)


def refuse_other_model(made: Any, other: Any, folder: Path, suffix: str, fingerprint_of: Callable[[str], str],
                       error: type[Exception], source: str, said: str, use: str, make: str) -> None:
    """Raise ``error`` in one line when ``other`` (the model in use, a ``ModelIdentity``) is not ``made`` (the one a
    file was made on): ``source`` and ``said`` (e.g. ``"were made for model {made}, not for {other}"``), then the
    files shipped in ``folder`` for ``other`` and how to use them (``use``), or how to ``make`` one."""
    if other.fingerprint == made.fingerprint:
        return
    shipped = shipped_for(folder, suffix, other.fingerprint, fingerprint_of)
    fix = f"this package ships {' and '.join(shipped)} for it{use}" if shipped else make
    raise error(f"{source} {said.format(made=made.describe(), other=other.describe())}; {fix}")
