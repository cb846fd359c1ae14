"""The press finds its host through the registry; the host, not the evictor, picks the storage; the
storage is configuration like every other component."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

import kvpress_ada
from kvpress_ada import Int4, Int8, Mask, Pipeline, SnapKV, preset
from kvpress_ada.hosts.base import Host, host_for, host_names, register_host, unregister_host
from kvpress_ada.hosts.transformers import HOST


def test_a_transformers_model_is_served_by_the_transformers_host(llama):
    assert host_names()[0] == "transformers"
    assert host_for(llama) is HOST


def test_an_object_no_host_serves_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        preset("snapkv", compression_ratio=0.5)(object())
    message = str(err.value)
    assert "\n" not in message and "object" in message and "transformers" in message


class _Recorder:
    """A host of a made-up engine: it records what press(model, **options) hands it."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def serves(self, model) -> bool:
        return isinstance(model, str) and model.startswith("engine:")

    @contextmanager
    def apply(self, press, model, **options):
        self.calls.append((press, model, options))
        yield model


def test_another_host_registers_and_receives_the_press_with_its_options():
    host = _Recorder()
    assert isinstance(host, Host)
    register_host(host)
    try:
        press = preset("ada_snapkv", compression_ratio=0.75)
        with press("engine:one", block_size=32) as served:
            assert served == "engine:one"
        assert host.calls == [(press, "engine:one", {"block_size": 32})]
        with pytest.raises(ValueError, match="already registered"):
            register_host(_Recorder())
    finally:
        unregister_host("recorder")
    assert "recorder" not in host_names()


def test_register_host_refuses_an_object_without_the_protocol():
    with pytest.raises(TypeError, match="serves"):
        register_host(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("storage", ["full", "int8", "int4", {"name": "int4", "group_size": 64}])
def test_storage_round_trips_through_json(storage):
    press = Pipeline(scorer=SnapKV(), compression_ratio=0.5, storage=storage)
    again = Pipeline.model_validate_json(press.model_dump_json())
    assert again == press and json.loads(press.model_dump_json())["storage"]["name"] == press.storage.label


def test_a_quantized_storage_with_the_mask_evictor_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        Pipeline(scorer=SnapKV(), compression_ratio=0.5, evictor=Mask(), storage="int4")
    assert "\n" not in str(err.value) and "int4" in str(err.value) and "topk" in str(err.value)


@pytest.mark.parametrize("group_size", [0, 8, 48, 256])
def test_an_unsupported_group_size_is_refused_at_construction(group_size):
    with pytest.raises(ValueError) as err:
        Int4(group_size=group_size)
    assert "\n" not in str(err.value) and f"group_size={group_size}" in str(err.value)


def test_a_head_dim_the_group_does_not_divide_is_refused_when_the_press_meets_the_model(llama):
    head_dim = llama.config.hidden_size // llama.config.num_attention_heads
    size = next(g for g in (16, 32, 64, 128) if head_dim % g)
    press = Pipeline(scorer=SnapKV(), compression_ratio=0.5, storage=Int8(group_size=size))
    with pytest.raises(ValueError) as err:
        kvpress_ada.check_press(press, llama)
    assert "\n" not in str(err.value) and str(head_dim) in str(err.value)


def test_a_dtype_storage_cannot_quantize_is_refused():
    with pytest.raises(ValueError, match="float64"):
        Int8().check_geometry(64, torch.float64)
