"""Model-family adapters: each family's adapter reaches the modules and tensors the model itself holds, declares
what its attention computes (sliding-window layers among it), the registry refuses an unknown family in one line,
and a family a user registers is served by ``with press(model)``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ARCHITECTURES, HYBRID, WINDOW, build_model, build_tokenizer, left_padded_batch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from kvpress_ada import preset, use_tokenizer
from kvpress_ada.families import (
    SUPPORTED_MODEL_TYPES,
    Family,
    Gemma2Family,
    Gemma3Family,
    GptOssFamily,
    GraniteFamily,
    LlamaFamily,
    MistralFamily,
    MixtralFamily,
    Olmo2Family,
    Phi3Family,
    Qwen2Family,
    Qwen3Family,
    Qwen3MoeFamily,
    SmolLM3Family,
    family_for,
    family_of,
    register_family,
    supported_model_types,
    unregister_family,
)
from kvpress_ada.hosts.transformers import hf
from kvpress_ada.hosts.transformers.attention import attention_modules, output_weight, rope_inv_freq
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.hosts.transformers.rotary import config_rope_inv_freq
from kvpress_ada.runtime import compressed_layers, held_windows, window_limit
from kvpress_ada.storage import Int8

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = {"llama": LlamaFamily, "mistral": MistralFamily, "qwen2": Qwen2Family, "qwen3": Qwen3Family,
            "gemma2": Gemma2Family, "gemma3_text": Gemma3Family, "gpt_oss": GptOssFamily, "granite": GraniteFamily,
            "mixtral": MixtralFamily, "olmo2": Olmo2Family, "phi3": Phi3Family, "qwen3_moe": Qwen3MoeFamily,
            "smollm3": SmolLM3Family}
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)


#: what each family's tiny model holds beyond Llama's: a fused projection, query/key norms, the layers that slide
#: (the tiny hybrids: 0 and 2), a soft-cap, sinks, layers without RoPE
FUSED_QKV = {"phi3"}
QK_NORMS = {"qwen3", "qwen3_moe", "gemma3_text", "olmo2"}
SINKS = {"gpt_oss"}
#: the families whose vLLM host results are checked equal to the transformers host's (tests/test_vllm_host.py)
VLLM_CHECKED = {"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "smollm3", "granite", "mixtral", "qwen3_moe"}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_adapter_reaches_what_the_model_holds(arch):
    model = build_model(arch)
    family = family_of(model)
    assert type(family) is ADAPTERS[arch] and family.model_type == arch
    layers = model.model.layers
    modules = family.attention_modules(model)
    assert len(modules) == len(layers) == model.config.num_hidden_layers
    assert all(m is layer.self_attn for m, layer in zip(modules, layers))
    assert attention_modules(model) == modules
    for i, module in enumerate(modules):
        assert family.layer_index(module) == i
        expected = ({"qkv": module.qkv_proj, "o": module.o_proj} if arch in FUSED_QKV else
                    {"q": module.q_proj, "k": module.k_proj, "v": module.v_proj, "o": module.o_proj})
        assert family.projections(module) == expected
        assert family.output_weight(module) is module.o_proj.weight
        assert output_weight(module) is module.o_proj.weight
        assert family.query_scaling == pytest.approx(module.scaling, rel=1e-6)
        assert family.attention_sinks(module) is (module.sinks if arch in SINKS else None)
        norms = family.qk_norms(module)
        if arch in QK_NORMS:
            assert norms == (module.q_norm, module.k_norm)
        else:
            assert norms is None and not hasattr(module, "q_norm")
        # each layer's RoPE frequencies are what its rotary embedding rotates with (none: zeros)
        freq = family.rope_inv_freq(model, i)
        rotary = model.model.rotary_emb
        kind = (model.config.layer_types or [None] * len(layers))[i] if hasattr(model.config, "layer_types") else None
        if i in family.layers_without_rope:
            assert not module.use_rope and torch.equal(freq, torch.zeros_like(rotary.inv_freq))
        else:
            assert freq is getattr(rotary, f"{kind}_inv_freq", None) or freq is rotary.inv_freq
        # ... and what a host without the transformers model (vLLM) computes from the config alone
        assert torch.equal(config_rope_inv_freq(model.config, i), freq)
    assert rope_inv_freq(model) is family.rope_inv_freq(model, 0)
    assert family.logit_softcap == getattr(model.config, "attn_logit_softcapping", None)
    assert family.layers_without_rope == ((1,) if arch == "smollm3" else ())  # every second layer in the tiny one
    if arch in HYBRID:
        assert family.sliding_window == WINDOW and family.sliding_window_layers == (0, 2)
        assert all(modules[i].sliding_window == WINDOW for i in (0, 2)) and modules[1].sliding_window is None
    else:
        assert family.sliding_window is None and family.sliding_window_layers == ()
    # tensor parallelism: the style transformers' plan gives each projection split by head
    styles = family.head_projection_styles(model.config.base_model_tp_plan or {})
    assert set(styles) == {name for role, name in family.projection_names.items() if role != "o"}
    assert family.head_projection_styles({"layers.*.self_attn.k_proj": "rowwise"}).get("k_proj") in (
        None if arch in FUSED_QKV else "rowwise",)
    # what vLLM's models of these families hold: the same decoder layers, attention modules and projections
    assert family.engine_attention_modules(model) == modules
    assert family.engine_output_weight(modules[0]) is modules[0].o_proj.weight
    assert family.refuses("transformers") is None
    refusal = family.refuses("vllm")
    assert (refusal is None) == (arch in VLLM_CHECKED)
    assert refusal is None or ("\n" not in refusal and ("sliding-window" in refusal) == (arch in HYBRID))


SCALED_ROPE = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
                 "short_factor": [1.0 + i / 4 for i in range(8)], "long_factor": [2.0 + i for i in range(8)]},
}


@pytest.mark.parametrize("rope", list(SCALED_ROPE))
def test_rope_frequencies_from_the_config_are_the_transformers_models(rope):
    """A scaled RoPE (llama3, yarn, linear, longrope): the frequencies computed from the config (a transformers config,
    or its config.json mapping) are the transformers model's, and the scaling changes them (so the check could
    fail); a layer without RoPE (SmolLM3) gets zeros of the same shape."""
    config = LlamaConfig(**SMALL, rope_parameters=SCALED_ROPE[rope])
    model = LlamaForCausalLM(config).eval()
    want = model.model.rotary_emb.inv_freq
    theta = SCALED_ROPE[rope]["rope_theta"]
    plain = config_rope_inv_freq(LlamaConfig(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": theta}))
    assert not torch.allclose(want, plain)
    for given in (config, config.to_dict()):
        for i in range(config.num_hidden_layers):
            assert torch.equal(config_rope_inv_freq(given, i), want), (rope, type(given).__name__, i)
    smol = build_model("smollm3")
    family = family_for(smol.config)
    assert family.layers_without_rope == (1,)
    for i in range(smol.config.num_hidden_layers):
        freq = config_rope_inv_freq(smol.config, i)
        assert torch.equal(freq, family.rope_inv_freq(smol, i))
        assert freq.shape == smol.model.rotary_emb.inv_freq.shape and bool((freq == 0).all()) == (i == 1)


def test_a_config_without_its_transformers_rotary_embedding_is_refused_in_one_line():
    class Foreign:
        model_type = "llama"

    with pytest.raises(ValueError) as err:
        config_rope_inv_freq(Foreign(), 0)
    assert "\n" not in str(err.value) and "not a transformers config" in str(err.value)


def test_a_model_without_rotary_frequencies_is_refused_in_one_line(llama):
    class Bare(torch.nn.Module):
        def get_decoder(self):
            return torch.nn.Module()

    with pytest.raises(ValueError) as err:
        family_for(llama.config).rope_inv_freq(Bare())
    assert "\n" not in str(err.value) and "rotary_emb.inv_freq" in str(err.value)


def test_an_unsupported_model_type_is_refused_in_one_line():
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10)
    for given in (config, {"model_type": "gpt2"}):
        with pytest.raises(ValueError) as err:
            family_for(given)
        message = str(err.value)
        assert "\n" not in message and "'gpt2'" in message
        assert all(t in message for t in ("llama", "mistral", "qwen2", "qwen3"))
    with pytest.raises(ValueError, match="unsupported model type None"):
        family_for({})
    with pytest.raises(ValueError) as err, preset("snapkv", compression_ratio=0.5)(GPT2LMHeadModel(config)):
        pass
    assert "\n" not in str(err.value) and "'gpt2'" in str(err.value)


def test_supported_model_types_is_a_live_view_of_the_registry():
    assert tuple(SUPPORTED_MODEL_TYPES) == supported_model_types() == tuple(sorted(ADAPTERS)) == ARCHITECTURES
    assert hf.SUPPORTED_MODEL_TYPES is SUPPORTED_MODEL_TYPES and SUPPORTED_MODEL_TYPES == ARCHITECTURES
    register_family("registry_probe")(LlamaFamily)
    try:
        assert "registry_probe" in SUPPORTED_MODEL_TYPES and SUPPORTED_MODEL_TYPES[-2] == "registry_probe"
        with pytest.raises(ValueError, match="already served by LlamaFamily"):
            register_family("registry_probe")(Qwen3Family)
        register_family("registry_probe", override=True)(Qwen3Family)
        assert type(family_for({"model_type": "registry_probe"})) is Qwen3Family
    finally:
        unregister_family("registry_probe")
    assert "registry_probe" not in SUPPORTED_MODEL_TYPES and len(SUPPORTED_MODEL_TYPES) == len(ADAPTERS)
    with pytest.raises(TypeError, match="subclass of Family"):
        register_family("not_a_family")(object)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="model_type"):
        register_family()


# ------------------------------------------------------------------------------- sliding window
@pytest.mark.parametrize("window, layers", [(None, ()), (32, (0, 1, 2))])
def test_mistral_declares_every_layer_sliding_when_its_config_has_a_window(window, layers):
    family = family_for(MistralConfig(**{**SMALL, "sliding_window": window}))
    assert type(family) is MistralFamily
    assert family.sliding_window_layers == layers and family.sliding_window == window


@pytest.mark.parametrize("use, max_window_layers, layers", [(False, 1, ()), (True, 1, (1, 2)), (True, 28, ())])
def test_qwen2_declares_the_layers_its_config_makes_slide(use, max_window_layers, layers):
    family = family_for(Qwen2Config(**SMALL, use_sliding_window=use, sliding_window=16,
                                    max_window_layers=max_window_layers))
    assert family.sliding_window_layers == layers
    assert family.sliding_window == (16 if layers else None)


def test_llama_declares_no_sliding_window():
    assert family_for(LlamaConfig(**SMALL)).sliding_window_layers == ()
    assert family_for({"model_type": "llama", "num_hidden_layers": 2}).sliding_window is None


def test_a_press_refuses_to_grow_past_the_window_when_every_layer_slides():
    model = build_model("mistral", sliding_window=32)
    assert held_windows(family_of(model)) == () and window_limit(family_of(model)) == 32
    ids = torch.randint(5, 100, (1, 40))
    with preset("streamingllm", compression_ratio=0.5)(model), pytest.raises(ValueError, match=r"window \(32\)"):
        model(ids)


@pytest.mark.parametrize("arch, overrides", [("qwen2", dict(use_sliding_window=True, sliding_window=16,
                                                             max_window_layers=1)),
                                              ("gemma3_text", {}), ("gemma2", {}), ("gpt_oss", {})])
def test_a_hybrid_models_sliding_layers_hold_their_window_and_the_press_compresses_the_others(arch, overrides):
    """The hybrid rule: past the window, a sliding-window layer holds the window's last tokens (what the model's
    own cache holds), the global layers hold what the press keeps (a ratio of the prompt), the layer schedule splits
    its budget across the global layers only, and the bytes cover every layer."""
    model = build_model(arch, **overrides)
    family = family_of(model)
    held = held_windows(family)
    window = family.sliding_window
    assert held and window is not None and set(held) | set(compressed_layers(family)) == set(range(family.n_layers))
    ids = torch.randint(5, 100, (1, max(3 * window, 80)))
    reference = output_cache(model(ids, use_cache=True))
    prefill = capture_prefill(model, ids)
    for name in ("snapkv", "ada_pyramidkv", "kvzip"):
        press = preset(name, compression_ratio=0.5)
        with press(model):
            cache = output_cache(model(ids, use_cache=True))
        fanned = prefill.compressed_cache(press)  # fan-out derives the same cache from one dense prefill
        for i in range(family.n_layers):
            assert torch.equal(fanned.head_lengths(i), cache.head_lengths(i)), (name, i)
            if i not in held:
                assert torch.allclose(fanned.view(i).keys, cache.view(i).keys), (name, i)
        assert [type(layer).__name__ == "WindowLayer" for layer in cache.layers] == [
            i in held for i in range(family.n_layers)]
        kept = {i: int(cache.head_lengths(i).sum()) for i in range(family.n_layers)}
        heads = model.config.num_key_value_heads
        for i in held:  # the window's last tokens, exactly what the model's own cache holds there
            assert kept[i] == heads * (window - 1)
            # the same tokens; the global layers before it attend through the library's dense prefill, whose
            # rounding may differ from the model's own attention (5.18's sdpa for Gemma-2: 3e-7)
            torch.testing.assert_close(cache.layers[i].keys, reference.layers[i].keys, atol=1e-5, rtol=0)
        compressed = [kept[i] for i in compressed_layers(family)]
        assert sum(compressed) == len(compressed) * heads * round(0.5 * ids.shape[1]), name
        assert cache.nbytes() == sum(cache.layers[i].nbytes() for i in range(family.n_layers))


# ------------------------------------------------------------------------------- a user's family
class _ProbeConfig(LlamaConfig):
    model_type = "probe_llama"


class ProbeFamily(LlamaFamily):
    """A user's family for a Llama architecture under its own model_type, recording what it is asked."""

    asked: list[str] = []

    def output_weight(self, module):
        self.asked.append("output_weight")
        return super().output_weight(module)


def test_a_family_a_user_registers_is_served_by_a_press():
    kwargs = {**SMALL, "pad_token_id": 0}
    torch.manual_seed(0)
    probe = LlamaForCausalLM(_ProbeConfig(**kwargs)).eval()
    reference = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    reference.load_state_dict(probe.state_dict())
    for model in (probe, reference):
        model.generation_config.pad_token_id = 0
        use_tokenizer(model, build_tokenizer())
    press = preset("criticalkv", compression_ratio=0.5)  # reads each layer's output projection weight
    ids = torch.randint(5, 100, (1, 64))
    with pytest.raises(ValueError, match="'probe_llama'"), press(probe):
        pass
    register_family("probe_llama")(ProbeFamily)
    try:
        outs = {}
        with torch.no_grad():
            for name, model in (("probe", probe), ("reference", reference)):
                with press(model):
                    cache = output_cache(model(ids))
                    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
                outs[name] = (cache.layers[0].row_lengths.tolist(), tokens)
    finally:
        unregister_family("probe_llama")
    assert "output_weight" in ProbeFamily.asked
    lengths, tokens = outs["probe"]
    assert sum(lengths) == 2 * 32  # 2 kv heads, half of 64 entries each on average
    assert lengths == outs["reference"][0] and torch.equal(tokens, outs["reference"][1])


# ------------------------------------------------------------------------------- host-neutral
def test_the_families_package_imports_no_host_library():
    for path in (ROOT / "kvpress_ada" / "families").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("transformers", "triton", "vllm", "..hosts", "kvpress_ada.hosts")), (
                    f"{path.name} imports {name}")
    code = ("import sys, kvpress_ada.families; "
            "print([m for m in ('transformers', 'triton', 'vllm') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_every_registered_family_is_a_family():
    assert all(issubclass(type(family_for({"model_type": t})), Family) for t in supported_model_types())


@pytest.mark.parametrize("arch", sorted(HYBRID))
@pytest.mark.parametrize("mode", ["chunked prefill", "decode compaction", "int8", "batch row alone"])
def test_every_mode_of_a_hybrid_model(arch, mode):
    """The hybrid rule in each mode: chunked prefill, decode compaction and int8 storage give the tokens and logits of
    the Mask reference (the same rule over a dense cache) on a left-padded batch past the window; a row of the batch
    generates what it generates alone."""
    model = build_model(arch)
    ids, mask = left_padded_batch(seed=5, lengths=(100, 72))
    overrides = {"chunked prefill": dict(prefill_chunk=32), "decode compaction": dict(decode_budget=30,
                                                                                       decode_interval=4),
                 "int8": {}, "batch row alone": {}}[mode]

    def run(evictor, ids, mask, storage="full"):
        press = preset("snapkv", compression_ratio=0.5, evictor=evictor, storage=storage, **overrides)
        with press(model):
            return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)

    storage = Int8(group_size=16) if mode == "int8" else "full"
    with preset("snapkv", compression_ratio=0.5, storage=storage, **overrides)(model):
        cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
    heads = model.config.num_key_value_heads
    for i in compressed_layers(family_of(model)):  # each row keeps half its real tokens in every global layer
        assert cache.head_lengths(i).sum(-1).tolist() == [heads * 50, heads * 36], (mode, i)
    if mode == "batch row alone":
        both = run("topk", ids, mask)
        alone = run("topk", ids[1:, 28:], mask[1:, 28:])
        assert torch.equal(both.sequences[1, 28:], alone.sequences[0])
        return
    got = run("topk", ids, mask, storage=storage)
    reference = run("mask", ids, mask)
    if mode == "int8":  # int8 keys and values: the same greedy tokens, logits within the quantization error
        assert torch.equal(got.sequences, reference.sequences)
        return
    assert torch.equal(got.sequences, reference.sequences)
    for a, b in zip(got.scores, reference.scores):
        assert torch.allclose(a, b, atol=1e-4, rtol=0)
