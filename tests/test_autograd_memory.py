"""A press cache holds no autograd graph: with grad mode on (no ``torch.no_grad``), a compressed
cache's buffers carry no ``grad_fn``, and what stays alive after the forward's outputs are dropped
is the cache's ``nbytes()`` plus a small constant, exactly as under ``torch.no_grad``.

Live memory is measured on what autograd keeps: every tensor the forward saved for backward is
tracked by a weak reference (``saved_tensors_hooks``); the bytes of those still alive once the
outputs are gone (model weights aside) are memory the cache's graph pins beyond ``nbytes()``.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from kvpress_ada import Mask, TopK, preset
from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache


def _ids(n, seed=0):
    return torch.randint(5, 100, (1, n), generator=torch.Generator().manual_seed(seed))


class _SavedTensors:
    """Weak references to every tensor autograd saves while active."""

    def __init__(self):
        self.refs: list[weakref.ref] = []

    def pack(self, t):
        alias = t.detach()  # same storage; returning ``t`` itself would tie it to its own grad_fn in a cycle
        self.refs.append(weakref.ref(alias))
        return alias

    @staticmethod
    def unpack(t):
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def alive_bytes(self, exclude: set[int]) -> int:
        """Bytes of the distinct storages of saved tensors still alive, storages in ``exclude`` aside."""
        gc.collect()
        seen: dict[int, int] = {}
        for ref in self.refs:
            t = ref()
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in exclude:
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


def _stored_tensors(cache):
    for layer in cache.layers:
        for name in ("keys", "values", "k_flat", "v_flat"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                yield name, t


def _run(model, evictor, grad: bool, decode_steps: int = 3):
    """Prefill 200 tokens and decode a few inside the press; return (cache, bytes autograd keeps alive)."""
    press = preset("snapkv", compression_ratio=0.75, evictor=evictor)
    saved = _SavedTensors()
    key = cache_kwarg(model)
    mode = contextlib.nullcontext() if grad else torch.no_grad()
    with mode, saved.hooks(), press(model):
        out = model(input_ids=_ids(200))
        cache = output_cache(out)
        for step in range(decode_steps):
            out = model(input_ids=_ids(1, seed=step + 1), **{key: cache})
    del out
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {t.untyped_storage().data_ptr() for _, t in _stored_tensors(cache)}  # counted by nbytes()
    return cache, saved.alive_bytes(params)


@pytest.mark.parametrize("evictor", [TopK(), Mask()], ids=["ragged", "masked"])
def test_cache_keeps_no_graph_with_grad_on(llama, evictor):
    cache, pinned = _run(llama, evictor, grad=True)
    for name, t in _stored_tensors(cache):
        assert t.grad_fn is None and not t.requires_grad, (name, t.grad_fn)
    reference, pinned_no_grad = _run(llama, evictor, grad=False)
    assert pinned_no_grad == 0 and cache.nbytes() == reference.nbytes()
    # a small constant (e.g. RoPE tables cached by the model) at most, far below one layer's cache
    assert pinned <= 4096, (pinned, cache.nbytes())


def test_prefill_logits_still_carry_gradients(llama):
    """Only the stored copies are detached: the forward's own output still differentiates."""
    with preset("snapkv", compression_ratio=0.5)(llama):
        out = llama(input_ids=_ids(80))
    assert out.logits.requires_grad
    out.logits.sum().backward()
    grads = [p.grad for p in llama.parameters() if p.grad is not None]
    llama.zero_grad(set_to_none=True)
    assert grads and any(bool(g.abs().sum() > 0) for g in grads)
