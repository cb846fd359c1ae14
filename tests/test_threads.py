"""Threads and press blocks: a block applies to the forwards of the thread that opened it, other
threads' forwards run as if no press were open, and no hook outlives the last block."""

import threading

import torch
from conftest import build_model
from transformers import DynamicCache

from kvpress_ada import Mask, RaggedCache, preset
from kvpress_ada.hosts.transformers.hf import output_cache

TRIALS = 40


def test_each_thread_gets_its_own_press_and_plain_forwards_stay_plain():
    model = build_model("llama", seed=11)
    ids = torch.randint(5, 100, (1, 96), generator=torch.Generator().manual_seed(0))
    presses = {"ragged": preset("snapkv", compression_ratio=0.5),
               "masked": preset("knorm", compression_ratio=0.75, evictor=Mask())}
    with torch.no_grad():
        plain_logits = model(ids).logits
        expected = {}
        for name, press in presses.items():
            with press(model):
                expected[name] = output_cache(model(ids)).nbytes()
    assert expected["ragged"] != expected["masked"]
    errors: list[str] = []
    start = threading.Barrier(3)

    def pressing(name: str) -> None:
        start.wait()
        for _ in range(TRIALS):
            with torch.no_grad(), presses[name](model):
                cache = output_cache(model(ids))
            if type(cache).__name__ != ("RaggedCache" if name == "ragged" else "MaskedCache") or \
                    cache.nbytes() != expected[name]:
                errors.append(f"{name}: got {type(cache).__name__} of {cache.nbytes()} bytes")

    def plain() -> None:
        start.wait()
        for _ in range(TRIALS):
            with torch.no_grad():
                out = model(ids)
            if not isinstance(output_cache(out), DynamicCache) or isinstance(output_cache(out), RaggedCache):
                errors.append(f"plain forward got {type(output_cache(out)).__name__}")
            elif not torch.allclose(out.logits, plain_logits, atol=1e-5):
                errors.append("plain forward logits changed")

    threads = [threading.Thread(target=pressing, args=(n,)) for n in presses] + [threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not model._forward_pre_hooks and not model._forward_hooks  # no hook outlives the blocks
    assert model.config._attn_implementation != "kvpress_ada"


def test_blocks_do_not_nest_within_a_thread():
    model = build_model("llama", seed=12)
    press = preset("snapkv", compression_ratio=0.5)
    with press(model):
        try:
            with press(model):
                raise AssertionError("nested block was accepted")
        except RuntimeError as exc:
            assert "do not nest" in str(exc)
    assert not model._forward_pre_hooks
