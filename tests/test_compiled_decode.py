"""Compiled decode steps: ``fullgraph=True``, no graph breaks, a documented number of
graphs over many decode steps, context lengths and re-layouts, and the same tokens as eager.

The compiled step uses the ``aot_eager`` backend here (dynamo tracing and functionalisation of the
in-place custom ops, without inductor's C++ code generation, which takes minutes on the CI's CPUs);
inductor runs the same graph in ``benchmarks/decode.py --compile``.
"""

import pytest
import torch
from conftest import build_model, build_tokenizer
from torch._dynamo.utils import counters

from kvpress_ada import generate, preset
from kvpress_ada.hosts.transformers import compiled

MAX_GRAPHS = 1  # one graph serves every context length, compression and re-layout (buffer lengths are dynamic)
STEPS = 64  # decode forwards per generation (the first token comes from the prefill)
CONTEXTS = (80, 130, 250)


@pytest.fixture(scope="module")
def model():
    m = build_model("llama", num_hidden_layers=2)
    with torch.no_grad():
        m.lm_head.weight.mul_(8)  # decisive logits: no near-ties between greedy candidates
    return m


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.delenv(compiled.ENV_VAR, raising=False)


def _generate(model, ids, compile, steps=STEPS):
    press = preset("ada_snapkv", compression_ratio=0.5)
    with press(model, compile=compile):
        step = model.__dict__.get("forward")
        out = model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False)
    return out, step


def test_compiled_decode_contract(model):
    counters.clear()
    for i, L in enumerate(CONTEXTS):
        ids = torch.randint(5, 100, (1, L), generator=torch.Generator().manual_seed(i))
        eager, none = _generate(model, ids, compile=False)
        assert none is None  # compile=False leaves the model's forward alone
        got, step = _generate(model, ids, compile=True)
        assert isinstance(step, compiled.DecodeForward) and step.calls == STEPS
        assert "forward" not in model.__dict__  # removed when the block ends
        assert torch.equal(got, eager), f"context {L}: compiled tokens differ from eager"
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= MAX_GRAPHS, dict(counters["stats"])


def test_generate_compile_option_matches_eager():
    """``kvpress_ada.generate(compile=True)``: left-padded batch of two contexts, two questions, crop between.

    Own model: run after the contract test on the module's model, the *eager* answers came out
    different (an open finding, not explained yet; a fresh model gives equal answers repeatedly)."""
    model = build_model("llama", num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    tok = build_tokenizer()
    contexts = ["alpha beta gamma delta " * 6, "one two three " * 5]
    questions = ["What comes after beta?", "Count."]
    press = preset("ada_snapkv", compression_ratio=0.5)
    kwargs = dict(press=press, max_new_tokens=12)
    assert generate(model, tok, contexts, questions, compile=True, **kwargs) == \
        generate(model, tok, contexts, questions, compile=False, **kwargs)


def test_compile_policy(monkeypatch):
    assert compiled.compile_enabled(None, "cuda") and not compiled.compile_enabled(None, "cpu")
    assert compiled.compile_enabled(True, "cpu") and not compiled.compile_enabled(False, "cuda")
    monkeypatch.setenv(compiled.ENV_VAR, "0")
    assert not compiled.compile_enabled(None, "cuda") and compiled.compile_enabled(True, "cuda")
    monkeypatch.setenv(compiled.ENV_VAR, "1")
    assert compiled.compile_enabled(None, "cpu") and not compiled.compile_enabled(False, "cpu")
    monkeypatch.setenv(compiled.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="KVPRESS_ADA_COMPILE"):
        compiled.compile_enabled(None, "cpu")
    assert compiled.default_mode("cuda") == "reduce-overhead" and compiled.default_mode("cpu") is None


def test_cache_built_outside_inference_mode_decodes_inside_without_recompiles(model):
    """A cache prefilled under no_grad (normal tensors) and decoded under inference_mode, where
    re-layouts happen at different steps in different layers, keeps one graph: the buffers are
    always normal tensors, so no layer's dispatch keys change (found by benchmarks/decode.py)."""
    from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache

    counters.clear()
    press = preset("ada_snapkv", compression_ratio=0.5)
    ids = torch.randint(5, 100, (1, 150), generator=torch.Generator().manual_seed(7))
    with press(model, compile=True):
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
        cache = output_cache(out)
        assert not cache.layers[0].k_flat.is_inference()
        before = [layer.k_flat.shape[0] for layer in cache.layers]
        with torch.inference_mode():
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(STEPS):
                out = model(input_ids=token, use_cache=True, **{cache_kwarg(model): cache})
                token = out.logits[:, -1:].argmax(-1)
        assert model.forward.calls == STEPS
    assert all(layer.k_flat.shape[0] > n for layer, n in zip(cache.layers, before))  # every layer re-laid out
    assert not any(layer.k_flat.is_inference() for layer in cache.layers)
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= MAX_GRAPHS, dict(counters["stats"])


def test_decode_compression_under_compiled_decoding(model):
    """``decode_budget`` with ``compile=True``: the compactions, and the steps whose queries they read,
    run eagerly; every other step runs compiled. Same tokens and kept rows as eager, the bytes bound of
    decode compression held, one graph for every compaction and re-layout, no graph break."""
    from kvpress_ada import SnapKV
    from kvpress_ada.kernels.ragged.reference import CHUNK

    K, budget, window = 16, 24, 4
    press = preset("snapkv", compression_ratio=0.5, scorer=SnapKV(window=window, kernel=3), decode_budget=budget,
                   decode_interval=K)
    ids = torch.randint(5, 100, (1, 90), generator=torch.Generator().manual_seed(7))

    def run(compile):
        with press(model, compile=compile):
            step = model.__dict__.get("forward")
            out = model.generate(ids, max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1, do_sample=False,
                                 return_dict_in_generate=True)
        return out, step

    counters.clear()
    eager, _ = run(False)
    got, step = run(True)
    assert torch.equal(got.sequences, eager.sequences)
    cache, ref = got.past_key_values, eager.past_key_values
    for i in range(len(cache.layers)):
        assert torch.equal(cache.head_lengths(i), ref.head_lengths(i))
        assert torch.equal(cache.layers[i].view().keys, ref.layers[i].view().keys)
    # decode forward n (1-based) has counted ((n - 1) % K) + 1 tokens: eager when within the last
    # `window` before a compaction (its queries are read) or compacting, compiled otherwise
    eager_steps = sum(1 for n in range(1, STEPS + 1) if K - (((n - 1) % K) + 1) < window)
    assert step.calls == STEPS - eager_steps and cache.state.compactions == [STEPS // K] * len(cache.layers)
    config = model.config
    D = config.hidden_size // config.num_attention_heads
    bound = config.num_hidden_layers * config.num_key_value_heads * (budget + K + CHUNK - 1) * D * 2 * 4
    assert cache.nbytes() <= bound
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    # the model's compiled forward is shared across tests: at most one graph, whatever ran before
    assert counters["stats"]["unique_graphs"] <= MAX_GRAPHS, dict(counters["stats"])


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_compiled_decode_of_a_hybrid_model(arch):
    """A hybrid model (sliding-window layers holding their window, global layers compressed) with a soft-cap
    (Gemma-2) or sinks (GPT-OSS): the compiled step generates the eager tokens without graph breaks; past the
    window the sliding layers' shapes stop changing, so the graphs stay few."""
    m = build_model(arch)
    with torch.no_grad():
        m.lm_head.weight.mul_(8)
    counters.clear()
    for i, L in enumerate((80, 130)):
        ids = torch.randint(5, 100, (1, L), generator=torch.Generator().manual_seed(i))
        eager, _ = _generate(m, ids, compile=False, steps=24)
        got, step = _generate(m, ids, compile=True, steps=24)
        assert isinstance(step, compiled.DecodeForward) and step.calls == 24
        assert torch.equal(got, eager), f"{arch}, context {L}: compiled tokens differ from eager"
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
