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
from conftest import ARCHITECTURES, build_model, build_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from kvpress_ada import preset, use_tokenizer
from kvpress_ada.families import (
    SUPPORTED_MODEL_TYPES,
    Family,
    LlamaFamily,
    MistralFamily,
    Qwen2Family,
    Qwen3Family,
    family_for,
    family_of,
    register_family,
    supported_model_types,
    unregister_family,
)
from kvpress_ada.hosts.transformers import hf
from kvpress_ada.hosts.transformers.attention import attention_modules, output_weight, rope_inv_freq
from kvpress_ada.hosts.transformers.hf import output_cache

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = {"llama": LlamaFamily, "mistral": MistralFamily, "qwen2": Qwen2Family, "qwen3": Qwen3Family}
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_adapter_reaches_what_the_model_holds(arch):
    model = build_model(arch)
    family = family_of(model)
    assert type(family) is ADAPTERS[arch] and family.model_type == arch
    layers = model.model.layers
    modules = family.attention_modules(model)
    assert len(modules) == len(layers) == 3
    assert all(m is layer.self_attn for m, layer in zip(modules, layers))
    assert attention_modules(model) == modules
    for i, module in enumerate(modules):
        assert family.layer_index(module) == i
        assert family.projections(module) == {"q": module.q_proj, "k": module.k_proj, "v": module.v_proj,
                                              "o": module.o_proj}
        assert family.output_weight(module) is module.o_proj.weight
        assert output_weight(module) is module.o_proj.weight
        assert family.query_scaling == module.scaling
        assert family.attention_sinks(module) is None
        norms = family.qk_norms(module)
        if arch == "qwen3":
            assert norms == (module.q_norm, module.k_norm)
        else:
            assert norms is None and not hasattr(module, "q_norm")
    assert family.rope_inv_freq(model) is model.model.rotary_emb.inv_freq
    assert rope_inv_freq(model) is model.model.rotary_emb.inv_freq
    assert family.logit_softcap is None and family.layers_without_rope == ()
    assert family.sliding_window is None and family.sliding_window_layers == ()
    # tensor parallelism: the plan transformers ships shards this family's q/k/v projections column-wise
    assert family.head_projection_styles(model.config.base_model_tp_plan) == {
        "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise"}
    assert family.head_projection_styles({"layers.*.self_attn.k_proj": "rowwise"})["k_proj"] == "rowwise"
    # what vLLM's models of these families hold: the same decoder layers, attention modules and projections
    assert family.engine_attention_modules(model) == modules
    assert family.engine_output_weight(modules[0]) is modules[0].o_proj.weight
    assert family.refuses("transformers") is None and family.refuses("vllm") is None


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
    assert tuple(SUPPORTED_MODEL_TYPES) == supported_model_types() == ("llama", "mistral", "qwen2", "qwen3")
    assert hf.SUPPORTED_MODEL_TYPES is SUPPORTED_MODEL_TYPES and SUPPORTED_MODEL_TYPES == ARCHITECTURES
    register_family("registry_probe")(LlamaFamily)
    try:
        assert "registry_probe" in SUPPORTED_MODEL_TYPES and SUPPORTED_MODEL_TYPES[-1] == "registry_probe"
        with pytest.raises(ValueError, match="already served by LlamaFamily"):
            register_family("registry_probe")(Qwen3Family)
        register_family("registry_probe", override=True)(Qwen3Family)
        assert type(family_for({"model_type": "registry_probe"})) is Qwen3Family
    finally:
        unregister_family("registry_probe")
    assert "registry_probe" not in SUPPORTED_MODEL_TYPES and len(SUPPORTED_MODEL_TYPES) == 4
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


def test_a_press_refuses_to_grow_past_the_window_of_the_sliding_layers():
    model = build_model("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1)
    ids = torch.randint(5, 100, (1, 40))
    with preset("streamingllm", compression_ratio=0.5)(model), pytest.raises(ValueError, match=r"window \(32\)"):
        model(ids)


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
