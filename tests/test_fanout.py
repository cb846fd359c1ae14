"""Fan-out evaluation: one prefill per sample gives exactly the answers of separate runs."""

import pytest
import torch
from conftest import build_model

from kvpress_ada import AdaHead, Pipeline, SnapKV
from kvpress_ada.harness.eval import Sample
from kvpress_ada.harness.eval.runner import evaluate, evaluate_separately, grid
from kvpress_ada.harness.eval.signals import eviction_loss
from kvpress_ada.hosts.transformers.fanout import capture_prefill

SAMPLES = [
    Sample(context="The pass key is 4821. " + "Blue doors and seven gates. " * 4, question="What is the pass key?",
           answers=["4821"], task="passkey", metric="string_match_all"),
    Sample(context="Remember: the magic word is tulip. " + "Grey clouds over a quiet lake. " * 3,
           question="What is the magic word?", answers=["tulip"], task="passkey", metric="string_match_all"),
]


@pytest.mark.parametrize("question_aware", [False, True])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])  # gemma3_text: a hybrid (sliding layers hold a window)
def test_fanout_answers_equal_separate_runs(tokenizer, question_aware, arch):
    model = build_model(arch, seed=3)
    entries = grid(["snapkv", "ada_snapkv", "ada_pyramidkv", "h2o", "ada_criticalkv", "streamingllm"], [0.3, 0.7])
    result = evaluate(model, tokenizer, SAMPLES, entries, question_aware=question_aware, max_new_tokens=5,
                      progress=False)
    separate = evaluate_separately(model, tokenizer, SAMPLES, entries, question_aware=question_aware,
                                   max_new_tokens=5, progress=False)
    for i, row in enumerate(separate):
        fanned = [r.answer for r in result.records if r.sample == i and r.label != "full"]
        assert fanned == row
    full = [r for r in result.records if r.label == "full"]
    assert len(full) == len(SAMPLES) and all(r.kl == 0.0 for r in full)


def test_summary_signals_are_sane(tokenizer):
    model = build_model("llama", seed=4)
    entries = grid(["snapkv", "ada_snapkv"], [0.2, 0.8])
    rows = {(r["label"], r["ratio"]): r for r in evaluate(model, tokenizer, SAMPLES, entries, max_new_tokens=3,
                                                          progress=False).summary()}
    assert rows[("full", 0.0)]["kv_fraction"] == 1.0
    for label in ("snapkv", "ada_snapkv"):
        low, high = rows[(label, 0.2)], rows[(label, 0.8)]
        # bytes held include the decode reserve and chunk rounding, large next to these tiny contexts
        assert high["kv_fraction"] < low["kv_fraction"] and high["kv_fraction"] < 1.0
        assert high["eviction_loss"] >= low["eviction_loss"] >= 0.0
        assert 0.0 <= high["top1"] <= 1.0 and high["kl"] >= 0.0
        assert len(high["eviction_loss_per_layer"]) == model.config.num_hidden_layers


def test_eviction_loss_zero_when_keeping_everything(llama):
    prefill = capture_prefill(llama, torch.randint(5, 100, (1, 80)))
    keep_all = [torch.ones(c.keys.shape[:3], dtype=torch.bool) for c in prefill.layers]
    assert float(eviction_loss(prefill, keep_all).abs().max()) == 0.0
    press = Pipeline(scorer=SnapKV(window=8), allocator=AdaHead(), compression_ratio=0.8)
    assert float(eviction_loss(prefill, prefill.keep_masks(press)).min()) > 0.0


def test_custom_config_grid_overrides_ratio():
    base = Pipeline(scorer=SnapKV(window=16), allocator=AdaHead(alpha=0.5), budget=10)
    entries = grid({"mine": base}, [0.25, 0.5])
    assert [e.press.compression_ratio for e in entries] == [0.25, 0.5]
    assert all(e.press.budget is None and e.press.scorer == SnapKV(window=16) for e in entries)


@pytest.mark.parametrize("question_aware", [False, True])
def test_batched_entries_equal_one_at_a_time(tokenizer, question_aware):
    """Entries decoded as rows of one batch (compressed_batch) give the records of batch-1 runs:
    answers, bytes held (each row's own layout), signals; Mask and chunked entries stay batch 1."""
    from kvpress_ada import Mask, preset
    from kvpress_ada.harness.eval.runner import Entry, evaluate_sample

    model = build_model("llama", seed=5)
    entries = grid(["snapkv", "ada_snapkv", "streamingllm", "knorm"], [0.3, 0.6, 0.8])
    entries += [Entry("snapkv_mask", 0.5, preset("snapkv", compression_ratio=0.5, evictor=Mask())),
                Entry("chunked", 0.5, preset("ada_snapkv", compression_ratio=0.5, prefill_chunk=16))]
    for sample in SAMPLES:
        one = evaluate_sample(model, tokenizer, sample, entries, question_aware=question_aware, max_new_tokens=6,
                              batch_entries=1)
        many = evaluate_sample(model, tokenizer, sample, entries, question_aware=question_aware,
                               max_new_tokens=6, batch_entries=5)  # groups of 5, 5 and 2: a partial group too
        assert [(r.label, r.ratio) for r in many] == [(r.label, r.ratio) for r in one]
        for a, b in zip(one, many):
            assert (a.answer, a.kv_bytes, a.full_kv_bytes) == (b.answer, b.kv_bytes, b.full_kv_bytes)
            assert a.kl == pytest.approx(b.kl, abs=1e-4) and a.top1 == b.top1
            assert a.eviction_loss == pytest.approx(b.eviction_loss, abs=1e-6, nan_ok=True)  # NaN: chunked
            assert a.hidden_error == pytest.approx(b.hidden_error, abs=1e-4)
        assert len({r.kv_bytes for r in many}) > 3  # the ratios really hold different bytes


def test_batched_entries_of_one_storage_kind_with_other_settings_are_not_batched_together(tokenizer):
    """Two int4 entries whose storage settings differ (ring size, scale width) hold the bytes and give the answers
    each gives alone: a batch cache holds one storage, settings included (it once grouped by the kind's name)."""
    from kvpress_ada import preset
    from kvpress_ada.harness.eval.runner import Entry, evaluate_sample
    from kvpress_ada.storage import Int4

    model = build_model("llama", seed=5)
    storages = [Int4(group_size=16), Int4(group_size=16, residual=32, half_scales=False)]
    entries = [Entry(f"int4_{i}", 0.5, preset("snapkv", compression_ratio=0.5, storage=s))
               for i, s in enumerate(storages)]
    one = evaluate_sample(model, tokenizer, SAMPLES[0], entries, max_new_tokens=6, batch_entries=1)
    many = evaluate_sample(model, tokenizer, SAMPLES[0], entries, max_new_tokens=6, batch_entries=2)
    assert [(r.answer, r.kv_bytes) for r in many] == [(r.answer, r.kv_bytes) for r in one]
    assert one[1].kv_bytes != one[2].kv_bytes  # the settings really hold different bytes


def test_captured_hidden_states_are_each_attention_input(llama):
    """capture_prefill(hidden_states=True) records what enters every attention module: the layer's
    input norm applied to the residual stream before the layer."""
    ids = torch.randint(5, 100, (2, 12))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :3] = False
    prefill = capture_prefill(llama, ids, mask, hidden_states=True)
    with torch.no_grad():
        residual = llama(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states
    for i, (layer, c) in enumerate(zip(llama.model.layers, prefill.layers)):
        assert c.hidden is not None and c.hidden.shape == (2, 12, llama.config.hidden_size)
        torch.testing.assert_close(c.hidden, layer.input_layernorm(residual[i]))
    assert all(c.hidden is None for c in capture_prefill(llama, ids, mask).layers)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_the_full_caches_bytes_are_what_the_models_own_cache_holds(arch):
    """The full-cache row's bytes: every token of every layer for Llama; for a hybrid model the sliding-window
    layers hold their window (as the model's own cache does), the global layers every token."""
    model = build_model(arch)
    ids = torch.randint(5, 100, (1, 80), generator=torch.Generator().manual_seed(0))
    prefill = capture_prefill(model, ids)
    layers = model.config.num_hidden_layers
    per_token = 2 * model.config.num_key_value_heads * prefill.layers[0].keys.shape[-1] * 4  # keys + values, fp32
    window = getattr(model.config, "sliding_window", None)
    held = [80 if arch == "llama" or kind == "full_attention" else window - 1
            for kind in getattr(model.config, "layer_types", None) or ["full_attention"] * layers]
    assert prefill.nbytes == sum(held) * per_token
    assert (prefill.nbytes < layers * 80 * per_token) == (arch == "gemma3_text")
