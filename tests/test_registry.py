"""Registries: no silent hijack of a name, old names load as aliases, errors name the right decorator."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch

import kvpress_ada
from kvpress_ada import (
    H2O,
    HeadAllocator,
    LayerSchedule,
    ObservedAttention,
    Pipeline,
    Scorer,
    SnapKV,
    StreamingLLM,
    preset,
    preset_names,
    register_allocator,
    register_evictor,
    register_preset,
    register_scorer,
)
from kvpress_ada.allocators import ALLOCATORS, LAYER_SCHEDULES, register_layer_schedule
from kvpress_ada.evictors import EVICTORS, TopK
from kvpress_ada.presets import unregister_preset
from kvpress_ada.scorers import SCORERS


def _fake_snapkv():
    """A class from 'another module' with SnapKV's qualname and name (a registry hijack)."""

    class SnapKV(Scorer):  # noqa: F811 - same qualname on purpose
        name: Literal["snapkv"] = "snapkv"

        def score(self, obs):
            return torch.zeros(obs.keys.shape[:3])

    SnapKV.__qualname__ = kvpress_ada.SnapKV.__qualname__
    return SnapKV


def test_second_registration_of_a_name_is_refused_even_with_the_same_qualname():
    fake = _fake_snapkv()
    with pytest.raises(ValueError, match="already registered.*override=True"):
        register_scorer("snapkv")(fake)
    assert SCORERS.get("snapkv") is kvpress_ada.SnapKV
    assert Pipeline(scorer="snapkv", compression_ratio=0.5).scorer == SnapKV()


def test_an_alias_cannot_be_taken_either():
    class Old(Scorer):
        name: Literal["observed_attention"] = "observed_attention"

    with pytest.raises(ValueError, match="observed_attention.*already registered"):
        register_scorer("observed_attention")(Old)
    assert SCORERS.get("observed_attention") is ObservedAttention


def test_override_replaces_explicitly_and_can_be_undone():
    fake = _fake_snapkv()
    try:
        assert register_scorer("snapkv", override=True)(fake) is fake
        assert SCORERS.get("snapkv") is fake
    finally:
        register_scorer("snapkv", override=True)(kvpress_ada.SnapKV)
    assert SCORERS.get("snapkv") is kvpress_ada.SnapKV


@pytest.mark.parametrize("register, registry, base, taken", [
    (register_allocator, ALLOCATORS, HeadAllocator, "ada"),
    (register_layer_schedule, LAYER_SCHEDULES, LayerSchedule, "pyramid"),
    (register_evictor, EVICTORS, kvpress_ada.Evictor, "topk"),
])
def test_every_register_decorator_refuses_hijack_and_takes_override(register, registry, base, taken):
    original = registry.get(taken)
    fake = type(original.__name__, (base,), {"__annotations__": {"name": Literal[taken]}, "name": taken,
                                              "__module__": "somewhere_else"})
    fake.__qualname__ = original.__qualname__
    with pytest.raises(ValueError, match=f"{register.__name__}\\({taken!r}, override=True\\)"):
        register(taken)(fake)
    assert registry.get(taken) is original
    try:
        register(taken, override=True)(fake)
        assert registry.get(taken) is fake
    finally:
        register(taken, override=True)(original)


def test_layer_schedule_errors_name_the_real_decorator():
    with pytest.raises(TypeError, match=r"register_layer_schedule\('x_test'\)"):
        register_layer_schedule("x_test")(int)
    with pytest.raises(ValueError) as info:
        register_layer_schedule("uniform")(LAYER_SCHEDULES.get("uniform"))
    assert "register_layer schedule" not in str(info.value) and "register_layer_schedule" in str(info.value)


def test_register_preset_refuses_an_existing_name_unless_override():
    with pytest.raises(ValueError, match="already exists.*override=True"):
        register_preset("snapkv", lambda: dict(scorer=StreamingLLM()))
    assert preset("snapkv", compression_ratio=0.5).scorer == SnapKV()
    register_preset("registry_test_preset", lambda: dict(scorer=SnapKV(window=2)))
    try:
        with pytest.raises(ValueError, match="already exists"):
            register_preset("registry_test_preset", lambda: dict(scorer=SnapKV(window=3)))
        register_preset("registry_test_preset", lambda: dict(scorer=SnapKV(window=3)), override=True)
        assert preset("registry_test_preset", budget=8).scorer == SnapKV(window=3)
    finally:
        unregister_preset("registry_test_preset")
    assert "registry_test_preset" not in preset_names()


# ----------------------------------------------------------------------------- one name per component

CANONICAL = {"snapkv", "streamingllm", "h2o", "tova", "knorm", "expected_attention", "criticalkv", "random", "lagkv",
             "keydiff", "kvzip", "kvzap", "kvcompose", "fastkvzip", "chunkkv", "finch", "simlayerkv", "duo_attention",
             "composed", "leverage", "cur", "non_causal_attention", "compactor", "qfilter", "cap",
             "entropy_gated_chunkkv", "kvgrad", "expected_attention_stats"}


def test_file_registry_and_preset_names_agree():
    files = {p.stem for p in Path(kvpress_ada.scorers.__file__).parent.glob("*.py")} - {"__init__", "base",
                                                                                         "attention"}
    assert CANONICAL <= set(SCORERS.names())
    builtin = [n for n in SCORERS.names() if SCORERS.get(n).__module__.startswith("kvpress_ada.")]
    assert set(builtin) == CANONICAL  # a new built-in scorer: add it here, with its file and preset
    for name in builtin:
        cls = SCORERS.get(name)
        assert cls.__module__ == f"kvpress_ada.scorers.{name}", (name, cls.__module__)
        assert name in files
        assert name in preset_names() and type(preset(name, compression_ratio=0.5).scorer) is cls


@pytest.mark.parametrize("old, new, cls", [("observed_attention", "h2o", ObservedAttention),
                                           ("streaming_llm", "streamingllm", StreamingLLM)])
def test_old_registry_names_load_and_dump_the_canonical_name(old, new, cls):
    press = Pipeline.model_validate_json(f'{{"scorer": {{"name": "{old}"}}, "compression_ratio": 0.5}}')
    assert type(press.scorer) is cls and press.scorer.name == new
    assert f'"name":"{new}"' in press.model_dump_json() and old not in press.model_dump_json()
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    assert Pipeline(scorer=old, budget=4).scorer == cls()
    with_field = Pipeline.model_validate({"scorer": {"name": old, **({"recent": 3} if cls is H2O else {})},
                                          "budget": 4})
    assert type(with_field.scorer) is cls


def test_public_names_are_kept():
    for name in ("ObservedAttention", "H2O", "StreamingLLM", "RandomScorer", "CriticalKV", "SnapKV", "TOVA",
                 "KNorm", "ExpectedAttention", "register_scorer", "register_preset", "Pipeline"):
        assert hasattr(kvpress_ada, name)
    assert kvpress_ada.H2O is kvpress_ada.ObservedAttention


def test_registry_names_do_not_list_aliases_and_unknown_lists_canonical():
    assert "observed_attention" not in SCORERS.names()
    with pytest.raises(ValueError, match="h2o"):
        SCORERS.get("nope")
    with pytest.raises(ValueError):
        Pipeline.model_validate({"scorer": {"name": 5}, "budget": 4})
    assert EVICTORS.get("topk") is TopK


def test_usage_guide_register_example_runs():
    """The usage guide's 'Register your own scorer' block works as written (then is unregistered)."""
    import re

    guide = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    section = guide[guide.index("## Register your own scorer"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    try:
        exec(compile(code, "docs/usage.md", "exec", dont_inherit=True), namespace)
        press = namespace["press"]
        assert press.scorer.name == "value_norm" and isinstance(press.scorer, SCORERS.get("value_norm"))
        assert Pipeline.model_validate_json(press.model_dump_json()) == press
        with pytest.raises(ValueError, match="already registered"):
            exec(compile(code, "docs/usage.md", "exec", dont_inherit=True), {})
    finally:
        SCORERS.unregister("value_norm")
