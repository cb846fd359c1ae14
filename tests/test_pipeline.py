"""Pipeline configuration: JSON round trips, validation errors, user-registered scorers."""

from typing import Literal

import pytest
import torch
import yaml
from conftest import build_model
from hypothesis import find, given, settings
from hypothesis import strategies as st
from pydantic import Field, ValidationError
from test_scorer_registry import any_scorer

from kvpress_ada import (
    AdaHead,
    Mask,
    Pipeline,
    PyramidLayer,
    Scorer,
    SnapKV,
    TopK,
    UniformHead,
    UniformLayer,
    generate,
    preset,
    preset_names,
    register_scorer,
)
from kvpress_ada.components import ConfigError
from kvpress_ada.hosts.transformers.hf import output_cache

# every registered scorer (looked up lazily, so scorers registered by tests or plugins are drawn too),
# fields drawn inside their pydantic constraints
scorers = st.deferred(any_scorer)
allocators = st.one_of(st.just(UniformHead()), st.builds(AdaHead, alpha=st.floats(0, 1)))
layer_schedules = st.one_of(st.just(UniformLayer()), st.builds(PyramidLayer, beta=st.floats(1.01, 100)))
evictors = st.sampled_from([TopK(), Mask()])


@settings(max_examples=80, deadline=None)
@given(scorers, allocators, layer_schedules, evictors, st.one_of(st.floats(0, 0.999), st.integers(1, 4096)))
def test_pipeline_round_trips_through_json_and_yaml(scorer, allocator, layers, evictor, amount):
    kwargs = {"compression_ratio": amount} if isinstance(amount, float) else {"budget": amount}
    press = Pipeline(scorer=scorer, allocator=allocator, layers=layers, evictor=evictor, **kwargs)
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    assert Pipeline.model_validate(yaml.safe_load(yaml.safe_dump(press.model_dump()))) == press


def test_components_by_name():
    press = Pipeline.model_validate({"scorer": "snapkv", "allocator": {"name": "ada", "alpha": 0.5},
                                     "layers": "pyramid", "evictor": "mask", "budget": 32})
    assert press.scorer == SnapKV() and press.allocator == AdaHead(alpha=0.5)
    assert press.layers == PyramidLayer() and press.evictor == Mask()


@pytest.mark.parametrize("kwargs, field", [
    (dict(scorer=SnapKV(), compression_ratio=1.0), "compression_ratio"),
    (dict(scorer=SnapKV(), compression_ratio=-0.1), "compression_ratio"),
    (dict(scorer=SnapKV(), allocator=dict(name="ada", alpha=1.5), compression_ratio=0.5), "alpha"),
    (dict(scorer=SnapKV(), allocator=dict(name="ada", alpha=-0.1), compression_ratio=0.5), "alpha"),
    (dict(scorer=dict(name="snapkv", window=0), compression_ratio=0.5), "window"),
    (dict(scorer=dict(name="snapkv", kernel=0), compression_ratio=0.5), "kernel"),
    (dict(scorer=SnapKV(), compression_ratio=0.5, budget=10), "exactly one"),
    (dict(scorer=SnapKV()), "exactly one"),
    (dict(scorer=SnapKV(), budget=0), "budget"),
    (dict(scorer="no_such_scorer", compression_ratio=0.5), "no_such_scorer"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises((ValidationError, ValueError)) as info:
        Pipeline(**kwargs)
    assert field in str(info.value)


def test_bad_component_fields_direct():
    with pytest.raises(ValidationError, match="alpha"):
        AdaHead(alpha=2)
    with pytest.raises(ValidationError, match="window"):
        SnapKV(window=0)
    with pytest.raises(ValidationError, match="kernel"):
        SnapKV(kernel=0)
    with pytest.raises(ValueError, match="snapkv"):
        preset("nope", compression_ratio=0.5)


def test_unknown_scorer_lists_registered():
    with pytest.raises(ValidationError) as info:
        Pipeline.model_validate({"scorer": {"name": "bogus"}, "compression_ratio": 0.5})
    assert "snapkv" in str(info.value) and "bogus" in str(info.value)


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64))
    with pytest.raises(ValueError, match="llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3"):
        with preset("snapkv", compression_ratio=0.5)(model):
            pass


def test_context_shorter_than_window_is_refused(llama):
    ids = torch.randint(0, 100, (1, 10))
    with pytest.raises(ValueError, match="shorter than SnapKV needs"):
        with preset("snapkv", compression_ratio=0.5)(llama):
            llama.generate(ids, max_new_tokens=2, do_sample=False)


def test_presets_cover_the_published_methods():
    expected = {"snapkv", "pyramidkv", "ada_snapkv", "ada_pyramidkv", "streamingllm", "h2o", "tova", "knorm",
                "expected_attention", "ada_expected_attention", "criticalkv", "ada_criticalkv", "random"}
    assert expected <= set(preset_names())
    assert preset("ada_snapkv", compression_ratio=0.75) == Pipeline(
        scorer=SnapKV(), allocator=AdaHead(alpha=0.2), compression_ratio=0.75)


@register_scorer("last_tokens_test")
class LastTokens(Scorer):
    """Test scorer: prefers recent tokens, scaled per head."""

    name: Literal["last_tokens_test"] = "last_tokens_test"
    power: float = Field(1.0, ge=0.5, le=4.0)

    def query_window(self) -> int:
        return 0

    def score(self, obs):
        rank = (obs.key_mask.long().cumsum(-1) - 1).clamp(min=0).float()  # position among valid tokens
        return rank.pow(self.power)[:, None, :].expand(*obs.keys.shape[:3]).clone()


def test_registered_scorer_works_end_to_end_by_name(tokenizer):
    model = build_model("llama")
    press = Pipeline.model_validate_json(
        '{"scorer": {"name": "last_tokens_test", "power": 2.0}, "allocator": "ada", "compression_ratio": 0.5}')
    assert isinstance(press.scorer, LastTokens) and press.scorer.power == 2.0
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    context = "the quick brown fox jumps over the lazy dog. " * 3
    answers = generate(model, tokenizer, context, ["what?", "who?"], press=press, max_new_tokens=4)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    # the custom scorer decided what was kept: every head keeps the most recent half
    with press(model) as m:
        ids = torch.randint(5, 100, (1, 40))
        out = m(ids, use_cache=True)
    cache = output_cache(out)
    lengths = cache.head_lengths(0)
    assert int(lengths.sum()) == 20 * lengths.shape[1]


def test_strategy_draws_scorers_registered_later():
    """The round-trip strategy follows the registry: ``last_tokens_test`` (registered above, after the
    strategy was defined) is drawn, with its field varied."""
    # one registered scorer of ~45 with a varied field: a fixed, ample search (the default budget missed it once)
    found = find(scorers, lambda s: isinstance(s, LastTokens) and s.power != 1.0,
                 settings=settings(database=None, max_examples=20_000, derandomize=True))
    assert isinstance(found, LastTokens)


def test_register_rejects_mismatched_name():
    with pytest.raises(TypeError, match="Literal"):
        @register_scorer("other_name_test")
        class Wrong(Scorer):
            name: Literal["wrong"] = "wrong"


def test_replace_returns_a_validated_copy():
    press = preset("ada_snapkv", compression_ratio=0.5)
    changed = press.replace(compression_ratio=None, budget=16, storage="int4")
    assert changed.budget == 16 and changed.compression_ratio is None and changed.storage.label == "int4"
    assert changed.scorer == press.scorer and changed.allocator == press.allocator and press.budget is None
    with pytest.raises(ConfigError, match="budget") as bad:
        press.replace(budget=8)  # both budgets: refused by the same validator as construction
    assert "\n" not in str(bad.value)
    with pytest.raises(ConfigError, match="no_such_field"):
        press.replace(no_such_field=1)
    with pytest.raises(ConfigError, match="storage"):
        press.replace(storage="int3")


def _without_paths(config):
    """A dumped Pipeline without its file paths (a model's own calibration, filters or gate)."""
    if isinstance(config, dict):
        return {k: _without_paths(v) for k, v in config.items() if k != "path"}
    return config


# benchmark configs named after a preset that differ from it by more than a file path, and why
CONFIGS_DIFFERING = {"qwen2.5-coder-0.5b/kvzap.yaml": "window 0: its results predate the preset's window of 16"}


def test_benchmark_configs_are_their_presets_with_a_models_files():
    """Every benchmark config is a valid Pipeline; one named after a preset is that preset with another model's
    files (a typo in a hand-written copy of a preset would make its grid rows silently another press)."""
    from pathlib import Path
    folder = Path(__file__).resolve().parents[1] / "benchmarks/configs"
    configs = sorted(folder.rglob("*.yaml"))
    assert len(configs) >= 30
    named = 0
    for path in configs:
        press = Pipeline.model_validate(yaml.safe_load(path.read_text()))
        name = str(path.relative_to(folder))
        if path.stem not in preset_names() or press.compression_ratio is None:
            continue
        same = (_without_paths(press.model_dump())
                == _without_paths(preset(path.stem, compression_ratio=press.compression_ratio).model_dump()))
        assert same != (name in CONFIGS_DIFFERING), name
        named += 1
    assert named >= 8  # the 0.5B's and Gemma's copies of model-bound presets
