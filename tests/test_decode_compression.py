"""Decode-phase compression: Pipeline(decode_budget=B, decode_interval=K).

What is asserted is what ``kvpress_ada/hosts/transformers/decode_compression.py`` documents: ragged
cache == Mask reference (same tokens, logits within 1e-4) on every architecture; after each
compaction a layer holds exactly ``min(H_kv * B, held)`` entries per batch row, at most
``H_kv * (B + K - 1)`` after any forward from the first compaction on, and the ragged cache's
bytes stay at ``n_layers * batch * H_kv * (B + K) * D * 2 * itemsize``.
"""

import pytest
import torch
from conftest import build_model, random_qfilters, random_query_stats, random_surrogate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpress_ada import Pipeline, generate
from kvpress_ada import qfilters as qf
from kvpress_ada import query_stats as qs
from kvpress_ada import surrogate as sur
from kvpress_ada.allocators import AdaHead, UniformHead
from kvpress_ada.evictors import Mask, TopK
from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache
from kvpress_ada.kernels.ragged.reference import CHUNK
from kvpress_ada.scorers import SCORERS, KeyDiff, SnapKV, StreamingLLM

torch.set_num_threads(1)


def _press(evictor, **kwargs):
    fields = dict(scorer=SnapKV(window=4, kernel=3), allocator=AdaHead(alpha=0.2), budget=16, decode_budget=10,
                  decode_interval=4)
    fields.update(kwargs)
    return Pipeline(evictor=evictor, **fields)


def _generate(model, press, ids, new_tokens, attention_mask=None):
    """Greedy generation inside the press: (new token ids, per-step logits, cache)."""
    with torch.inference_mode(), press(model):
        out = model.generate(ids, attention_mask=attention_mask, max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1), output_cache(out)


def _assert_same(model, ids, attention_mask=None, new_tokens=24, **kwargs):
    tokens_r, logits_r, cache_r = _generate(model, _press(TopK(), **kwargs), ids, new_tokens, attention_mask)
    tokens_m, logits_m, cache_m = _generate(model, _press(Mask(), **kwargs), ids, new_tokens, attention_mask)
    assert torch.equal(tokens_r, tokens_m)
    torch.testing.assert_close(logits_r, logits_m, atol=1e-4, rtol=0)
    for i in range(len(cache_r.layers)):
        assert torch.equal(cache_r.head_lengths(i), cache_m.head_lengths(i))
    assert min(cache_r.state.compactions[i] for i in cache_r.state.scope) >= (
        new_tokens // kwargs.get("decode_interval", 4) - 1)
    return cache_r


@pytest.mark.parametrize("mode", ["prefill+decode", "decode-only"])
def test_ragged_matches_mask_reference(arch_model, mode):
    ids = torch.randint(5, 100, (1, 30), generator=torch.Generator().manual_seed(1))
    extra = {} if mode == "prefill+decode" else {"budget": None}
    _assert_same(arch_model, ids, **extra)


def test_ragged_matches_mask_left_padded_batch(llama):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 100, (2, 28), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids[1, :6] = 0
    for extra in ({}, {"budget": None}):
        cache = _assert_same(llama, ids, attention_mask=mask, decode_interval=5, **extra)
        assert all(int(cache.head_lengths(i).sum(-1).max()) <= 2 * (10 + 5 - 1) for i in range(3))


@pytest.mark.parametrize("name", sorted(SCORERS.names()))
def test_every_scorer_decodes_or_refuses(llama, name, tmp_path):
    scorer = SCORERS.build(name)
    if name == "duo_attention":
        pytest.skip("DuoAttention's head patterns are a calibration file of one model: tests/test_structure_presses.py")
    if getattr(type(scorer), "model_specific", False):  # a file made for this model: Q-filters, query statistics,
        # KVzap's surrogate
        path = tmp_path / "model.safetensors"
        if name == "qfilter":
            qf.save(random_qfilters(llama.config, seed=1), path)
        elif name == "expected_attention_stats":
            qs.save(random_query_stats(llama.config, seed=1), path)
        else:
            sur.save(random_surrogate(llama.config, seed=1), path)
        scorer = scorer.model_copy(update={"path": str(path)})
    try:
        press = Pipeline(scorer=scorer, budget=16, decode_budget=10, decode_interval=4)
    except ValidationError as err:
        assert scorer.query_window() is None or type(scorer).needs_model_pass, err
        assert "decode" in str(err)
        return
    ids = torch.randint(5, 100, (1, 70), generator=torch.Generator().manual_seed(3))
    tokens_r, logits_r, _ = _generate(llama, press, ids, 12)
    tokens_m, logits_m, _ = _generate(llama, press.model_copy(update={"evictor": Mask()}), ids, 12)
    assert torch.equal(tokens_r, tokens_m)
    torch.testing.assert_close(logits_r, logits_m, atol=1e-4, rtol=0)


def test_budget_above_held_keeps_everything_and_positions(llama):
    """A decode budget above what is held keeps every entry: the re-laid-out cache must give the
    same logits as the plain prefill-compressed cache (order and RoPE positions intact)."""
    ids = torch.randint(5, 100, (1, 30), generator=torch.Generator().manual_seed(4))
    plain = Pipeline(scorer=SnapKV(window=4), allocator=AdaHead(alpha=0.2), budget=12)
    relaid = plain.model_copy(update={"decode_budget": 1000, "decode_interval": 3})
    tokens_a, logits_a, _ = _generate(llama, plain, ids, 20)
    tokens_b, logits_b, cache = _generate(llama, relaid, ids, 20)
    assert torch.equal(tokens_a, tokens_b)
    torch.testing.assert_close(logits_a, logits_b, atol=1e-4, rtol=0)
    assert cache.state.compactions == [6, 6, 6]


def _check_bound(model, press, ids, steps):
    """Decode step by step and check the documented bound after every forward."""
    B_dec, K = press.decode_budget, press.decode_interval
    cfg = model.config
    H, n_layers = cfg.num_key_value_heads, cfg.num_hidden_layers
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    slot_bytes = n_layers * ids.shape[0] * H * D * 2 * 4  # keys + values, fp32, per slot of every row
    bound_bytes = slot_bytes * (B_dec + K + CHUNK - 1)  # each row's room rounded up to whole chunks
    needed_bytes = slot_bytes * (B_dec + K)
    with torch.inference_mode(), press(model):
        out = model(ids, use_cache=True)
        cache = output_cache(out)
        previous = [cache.head_lengths(i).sum(-1) for i in range(n_layers)]
        for step in range(1, steps + 1):
            out = model(out.logits[:, -1:].argmax(-1), use_cache=True, **{cache_kwarg(model): cache})
            state = cache.state
            full = True
            for layer in range(n_layers):
                totals = cache.head_lengths(layer).sum(-1)  # [batch]: entries of the layer per batch row
                held = previous[layer] + H  # one token appended to every kv head
                previous[layer] = totals
                assert state.compactions[layer] == step // K
                if step < K:
                    assert torch.equal(totals, held)
                    continue
                assert int(totals.max()) <= H * (B_dec + K - 1)
                if step % K == 0:  # compacted in this forward: exact totals
                    assert torch.equal(totals, torch.clamp(held, max=H * B_dec))
                full = full and bool((totals >= H * B_dec).all()) if step % K == 0 else full
            if step >= K:
                assert cache.nbytes() <= bound_bytes
                if step % K == 0 and full:
                    assert cache.nbytes() >= needed_bytes
    return cache


def test_bytes_bounded_over_many_steps(llama):
    ids = torch.randint(5, 100, (1, 40), generator=torch.Generator().manual_seed(5))
    press = _press(TopK(), budget=24, decode_budget=8, decode_interval=6)
    _check_bound(llama, press, ids, steps=60)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(interval=st.integers(1, 7), decode_budget=st.integers(1, 20), prefill=st.sampled_from([None, 4, 12, 30]),
       ada=st.booleans(), scorer=st.sampled_from(["snapkv", "streamingllm", "keydiff"]))
def test_bound_and_reference_over_intervals_and_budgets(llama, interval, decode_budget, prefill, ada, scorer):
    """KeyDiff brings exact ties (a head holding two entries: equal cosines to their mean)."""
    ids = torch.randint(5, 100, (1, 24), generator=torch.Generator().manual_seed(interval * 31 + decode_budget))
    scorers = {"snapkv": SnapKV(window=3, kernel=3), "streamingllm": StreamingLLM(sinks=2), "keydiff": KeyDiff()}
    fields = dict(scorer=scorers[scorer],
                  allocator=AdaHead(alpha=0.3) if ada else UniformHead(), budget=prefill,
                  decode_budget=decode_budget, decode_interval=interval)
    press = Pipeline(evictor=TopK(), **fields)
    _check_bound(llama, press, ids, steps=2 * interval + 3)
    tokens_r, logits_r, _ = _generate(llama, press, ids, 2 * interval + 3)
    tokens_m, logits_m, _ = _generate(llama, Pipeline(evictor=Mask(), **fields), ids, 2 * interval + 3)
    assert torch.equal(tokens_r, tokens_m)
    torch.testing.assert_close(logits_r, logits_m, atol=1e-4, rtol=0)


def test_validation():
    Pipeline(scorer=SnapKV(), decode_budget=32, decode_interval=8)  # decode only: valid
    Pipeline(scorer=SnapKV(), compression_ratio=0.0, decode_budget=32, decode_interval=8)
    assert not Pipeline(scorer=SnapKV(), compression_ratio=0.0, decode_budget=32, decode_interval=8).is_noop
    with pytest.raises(ValidationError, match="exactly one"):
        Pipeline(scorer=SnapKV())
    with pytest.raises(ValidationError, match="go together"):
        Pipeline(scorer=SnapKV(), budget=8, decode_interval=4)
    with pytest.raises(ValidationError, match="go together"):
        Pipeline(scorer=SnapKV(), decode_budget=8)
    with pytest.raises(ValidationError, match="decode_budget"):
        Pipeline(scorer=SnapKV(), decode_budget=0, decode_interval=4)
    with pytest.raises(ValidationError, match="decode_interval"):
        Pipeline(scorer=SnapKV(), decode_budget=8, decode_interval=0)
    with pytest.raises(ValidationError, match="query_window None"):
        Pipeline(scorer="h2o", decode_budget=8, decode_interval=4)
    with pytest.raises(ValidationError, match="model pass"):
        Pipeline(scorer="kvzip", budget=8, decode_budget=8, decode_interval=4)
    assert Pipeline(scorer=SnapKV(), layers="ada_layer", budget=8, decode_budget=8, decode_interval=4).decode_budget
    press = Pipeline(scorer=SnapKV(), budget=8, decode_budget=16, decode_interval=4)
    assert Pipeline.model_validate_json(press.model_dump_json()) == press


def test_decode_ratio_keeps_a_fraction_of_each_rows_tokens_seen(llama):
    """decode_ratio (kvpress's CompressionRatioDecodingPress): each compaction keeps
    ``H_kv * round((1 - r) * seen)`` entries of a row, ``seen`` its real tokens (prompt less its left padding,
    plus the generated ones), so the two rows of a padded batch keep different totals; ragged == Mask."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(5, 100, (2, 28), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    ids[1, :6] = 0
    ratio, K = 0.6, 4
    _assert_same(llama, ids, attention_mask=mask, decode_interval=K, budget=None, decode_budget=None,
                 decode_ratio=ratio)
    press = _press(TopK(), budget=None, decode_budget=None, decode_ratio=ratio, decode_interval=K)
    H, n_layers = llama.config.num_key_value_heads, llama.config.num_hidden_layers
    real = mask.sum(-1)
    with torch.inference_mode(), press(llama):
        out = llama(ids, attention_mask=mask, use_cache=True)
        cache = output_cache(out)
        held = [cache.head_lengths(i).sum(-1) for i in range(n_layers)]
        for step in range(1, 3 * K + 1):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
            out = llama(out.logits[:, -1:].argmax(-1), attention_mask=mask, use_cache=True,
                        **{cache_kwarg(llama): cache})
            for layer in range(n_layers):
                held[layer] = held[layer] + H
                totals = cache.head_lengths(layer).sum(-1)
                if step % K == 0:  # compacted in this forward (every row holds more than it keeps)
                    want = torch.round((1 - ratio) * (real + step).double()).long()
                    assert torch.equal(totals, H * want)
                    assert int(totals[0]) != int(totals[1])
                else:
                    assert torch.equal(totals, held[layer])
                held[layer] = totals
    budget = press.decode_budget_for(torch.tensor([1, 10, 100]))
    assert budget.average.tolist() == [1, 4, 40]


def test_decode_ratio_validation():
    Pipeline(scorer=SnapKV(), decode_ratio=0.5, decode_interval=8)  # decode only: valid
    assert Pipeline(scorer=SnapKV(), decode_ratio=0.0, decode_interval=8).compresses_decode
    with pytest.raises(ValidationError, match="at most one of decode_budget"):
        Pipeline(scorer=SnapKV(), decode_budget=8, decode_ratio=0.5, decode_interval=4)
    with pytest.raises(ValidationError, match="go together"):
        Pipeline(scorer=SnapKV(), decode_ratio=0.5)
    with pytest.raises(ValidationError, match="decode_ratio"):
        Pipeline(scorer=SnapKV(), decode_ratio=1.0, decode_interval=4)
    with pytest.raises(ValidationError, match="model pass"):
        Pipeline(scorer="kvzip", budget=8, decode_ratio=0.5, decode_interval=4)
    press = Pipeline(scorer=SnapKV(), budget=8, decode_ratio=0.25, decode_interval=4)
    assert Pipeline.model_validate_json(press.model_dump_json()) == press


def test_generate_several_questions_with_decode_compression(tokenizer):
    model = build_model("qwen2")
    press = Pipeline(scorer=SnapKV(window=4), budget=24, decode_budget=12, decode_interval=3)
    context = "the quick brown fox jumps over the lazy dog. " * 2
    both = generate(model, tokenizer, context, ["what?", "who is it?"], press=press, max_new_tokens=10)
    one = [generate(model, tokenizer, context, [q], press=press, max_new_tokens=10)[0] for q in ["what?", "who is it?"]]
    assert both == one


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from conftest import build_tokenizer

    path = tmp_path_factory.mktemp("tiny_decode")
    build_model("llama", max_position_embeddings=4096).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def test_cli_eval_and_demo_with_decode_compression(tiny_model_dir, tmp_path, capsys):
    import json

    from kvpress_ada.harness.cli import main

    out = tmp_path / "run"
    assert main(["eval", "--model", tiny_model_dir, "--presets", "snapkv", "--ratios", "0.0,0.5", "--tasks", "passkey",
                 "--n", "1", "--context", "200", "--max-new-tokens", "12", "--decode-budget", "40",
                 "--decode-interval", "4", "--out", str(out), "--no-progress"]) == 0
    data = json.loads((out / "results.json").read_text())
    presses = [r["press"] for r in data["summary"]] if "press" in data["summary"][0] else None
    assert {(r["label"], r["ratio"]) for r in data["summary"]} == {("full", 0.0), ("snapkv", 0.0), ("snapkv", 0.5)}
    assert presses is None or all(p is None or p["decode_budget"] == 40 for p in presses)
    capsys.readouterr()
    assert main(["demo", "--model", tiny_model_dir, "--preset", "snapkv", "--ratio", "0.5", "--context", "200",
                 "--max-new-tokens", "12", "--decode-budget", "40", "--decode-interval", "4"]) == 0
    assert "decode compression: back to 40 tokens per kv head every 4" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--decode-budget", "8"], "go together"),
    (["--decode-budget", "0", "--decode-interval", "4"], "must be >= 1"),
])
def test_cli_decode_options_refused(extra, message, capsys):
    from kvpress_ada.harness.cli import main

    code = main(["demo", "--model", "nowhere", "--preset", "snapkv", *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_cli_decode_refused_for_h2o(capsys):
    from kvpress_ada.harness.cli import main

    assert main(["demo", "--model", "nowhere", "--preset", "h2o", "--decode-budget", "8",
                 "--decode-interval", "4"]) == 2
    assert "query_window None" in capsys.readouterr().err


def test_decode_compaction_scores_each_kv_head_with_its_index(llama):
    """A decode compaction hands every kv head its own index (``RandomScorer`` draws per head): on a
    decode-only press, where every head holds the same entries, the heads keep different entries."""
    from kvpress_ada.scorers import RandomScorer

    press = Pipeline(scorer=RandomScorer(seed=1), decode_budget=8, decode_interval=4)
    ids = torch.randint(5, 100, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), press(llama):
        out = llama.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert cache.state.compactions == [2] * len(cache.layers)
    for i in range(len(cache.layers)):
        positions = cache.layers[i].view().positions[0]  # [H_kv, n]
        assert not all(torch.equal(positions[0], p) for p in positions[1:]), f"layer {i}: every head kept the same"
