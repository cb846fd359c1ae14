"""Chunked prefill (``Pipeline(prefill_chunk=N)``): compress after every chunk of the context."""

from typing import ClassVar, Literal

import pytest
import torch
from conftest import build_model
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpress_ada as ka
from kvpress_ada import AdaHead, AdaLayer, KNorm, KVzip, Mask, Pipeline, SnapKV, StreamingLLM, preset
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.hosts.transformers.ragged_cache import RaggedLayer
from kvpress_ada.runtime import Schedule

torch.set_num_threads(1)

SMALL = dict(scorer=SnapKV(window=8, kernel=3))


def _ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, 128, (batch, length), generator=gen)


@torch.no_grad()
def _prefill(model, press, ids, **kwargs):
    with press(model):
        out = model(ids, use_cache=True, **kwargs)
    return out, output_cache(out)


def _lengths(cache):
    return [cache.head_lengths(i).clone() for i in range(len(cache.layers))]


@pytest.fixture(scope="module")
def llama():
    return build_model("llama")


def test_chunks_are_aligned_on_the_end():
    schedule = Schedule(preset("snapkv", budget=8, prefill_chunk=4))
    assert schedule.chunks(10) == [(0, 2), (2, 6), (6, 10)]
    assert schedule.chunks(8) == [(0, 4), (4, 8)]
    assert schedule.chunks(4) == [(0, 4)]
    assert Schedule(preset("snapkv", budget=8)).chunks(10) == [(0, 10)]


@pytest.mark.parametrize("name", ["ada_snapkv", "snapkv", "streamingllm", "knorm", "h2o", "tova", "criticalkv",
                                  "expected_attention", "lagkv", "keydiff", "random"])
def test_chunk_at_least_context_equals_unchunked(llama, name):
    ids = _ids(70)
    plain = preset(name, compression_ratio=0.6)
    for chunk in (70, 200):
        out, cache = _prefill(llama, plain.model_copy(update={"prefill_chunk": chunk}), ids)
        ref_out, ref_cache = _prefill(llama, plain, ids)
        assert torch.equal(out.logits, ref_out.logits)
        for layer in range(len(cache.layers)):
            assert torch.equal(cache.layers[layer].view().keys, ref_cache.layers[layer].view().keys)
            assert torch.equal(cache.head_lengths(layer), ref_cache.head_lengths(layer))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_no_eviction_equals_plain_prefill(arch):
    """Ratio 0 (nothing evicted): chunked prefill gives the plain prefill's logits, so chunk k's
    queries see every earlier token at its true RoPE position."""
    model = build_model(arch)
    ids = _ids(90, seed=3)
    with torch.no_grad():
        ref = model(ids).logits
        press = preset("snapkv", compression_ratio=0.0, prefill_chunk=16)
        out, cache = _prefill(model, press, ids)
        gen_ref = model.generate(ids, max_new_tokens=6, do_sample=False)
        with press(model):
            gen = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.logits.shape == ref.shape
    torch.testing.assert_close(out.logits, ref, atol=1e-4, rtol=0)
    assert all(int(n) == 90 for layer in _lengths(cache) for n in layer.flatten())
    assert torch.equal(gen, gen_ref)


def test_logits_to_keep_spans_chunks(llama):
    ids = _ids(70)
    press = preset("snapkv", compression_ratio=0.0, prefill_chunk=8)
    with torch.no_grad():
        ref = llama(ids).logits
        for keep in (1, 5, 13):
            out, _ = _prefill(llama, press, ids, logits_to_keep=keep)
            torch.testing.assert_close(out.logits, ref[:, -keep:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("allocator", [ka.UniformHead(), AdaHead(alpha=0.2)])
def test_cache_never_exceeds_budget_plus_chunk(llama, allocator, monkeypatch):
    budget, chunk = 12, 10
    seen = []
    update = RaggedLayer.update

    def spy(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        seen.append(self.head_lengths().clone())
        return out

    monkeypatch.setattr(RaggedLayer, "update", spy)
    press = Pipeline(**SMALL, allocator=allocator, budget=budget, prefill_chunk=chunk)
    _, cache = _prefill(llama, press, _ids(97))
    assert len(seen) == len(cache.layers) * 10  # 10 chunks
    H = cache.head_lengths(0).shape[1]
    for lengths in seen:
        assert float(lengths.float().mean(-1).max()) <= budget + chunk  # per kv head, on average over the layer
        limit = budget + chunk if isinstance(allocator, ka.UniformHead) else H * budget + chunk
        assert int(lengths.max()) <= limit
    for layer in _lengths(cache):
        assert int(layer.sum()) == H * budget


@pytest.mark.parametrize("name", ["ada_snapkv", "pyramidkv", "h2o", "ada_expected_attention", "ada_criticalkv",
                                  "ada_lagkv", "random"])
def test_ragged_equals_mask_reference(llama, name):
    ids = _ids(83, seed=5)
    press = preset(name, compression_ratio=0.7, prefill_chunk=16)
    with torch.no_grad():
        with press(llama):
            tokens = llama.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
        mask_press = press.model_copy(update={"evictor": Mask()})
        with mask_press(llama):
            ref = llama.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert torch.equal(tokens.sequences, ref.sequences)
    for a, b in zip(tokens.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    lengths = _lengths(output_cache(tokens))
    ref_lengths = _lengths(output_cache(ref))
    for a, b in zip(lengths, ref_lengths):
        assert torch.equal(a, b)


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(3, 40), budget=st.integers(1, 60), length=st.integers(20, 70),
       alpha=st.sampled_from([0.0, 0.2, 1.0]), pyramid=st.booleans())
def test_exact_totals(chunk, budget, length, alpha, pyramid):
    model = _tiny()
    layers = ka.PyramidLayer() if pyramid else ka.UniformLayer()
    press = Pipeline(scorer=SnapKV(window=4, kernel=3), allocator=AdaHead(alpha=alpha), layers=layers,
                     budget=budget, prefill_chunk=chunk)
    _, cache = _prefill(model, press, _ids(length, seed=chunk))
    one_shot = press.model_copy(update={"prefill_chunk": None})
    _, ref = _prefill(model, one_shot, _ids(length, seed=chunk))
    for layer in range(len(cache.layers)):
        lengths = cache.head_lengths(layer)
        assert int(lengths.sum()) == int(ref.head_lengths(layer).sum())  # the one-shot press's exact total
        assert int(lengths.max()) <= length


_TINY = {}


def _tiny():
    if "llama" not in _TINY:
        _TINY["llama"] = build_model("llama")
    return _TINY["llama"]


@pytest.mark.parametrize("name", ["ada_snapkv", "streamingllm", "ada_expected_attention"])
def test_left_padded_batch_equals_single_runs(name):
    model = build_model("qwen2")
    rows = [_ids(75, seed=1)[0], _ids(41, seed=2)[0], _ids(58, seed=4)[0]]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = row
        mask[b, width - len(row):] = 1
    overrides = {"ada_snapkv": SMALL}.get(name, {})
    press = preset(name, budget=14, prefill_chunk=12, **overrides)
    with torch.no_grad(), press(model):
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
        singles = [model.generate(r[None], max_new_tokens=6, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True) for r in rows]
    batch_cache = output_cache(batch)
    for b, single in enumerate(singles):
        assert torch.equal(batch.sequences[b, width:], single.sequences[0, len(rows[b]):])
        for x, y in zip(batch.logits, single.logits):
            torch.testing.assert_close(x[b], y[0], atol=1e-4, rtol=0)
        single_cache = output_cache(single)
        for layer in range(len(batch_cache.layers)):
            assert torch.equal(batch_cache.head_lengths(layer)[b], single_cache.head_lengths(layer)[0])


@pytest.mark.parametrize("scorer", [KNorm(), StreamingLLM(sinks=3)])
def test_context_independent_scores_keep_the_one_shot_set(llama, scorer):
    """Scores that do not depend on the other entries: top-b of (top-b of the past + chunk) is the
    top-b of everything, so chunked and one-shot keep the same entries of the first layer (deeper
    layers' keys differ: there the chunks attended to compressed caches)."""
    ids = _ids(77, seed=9)
    press = Pipeline(scorer=scorer, budget=15, prefill_chunk=9)
    _, cache = _prefill(llama, press, ids)
    _, ref = _prefill(llama, press.model_copy(update={"prefill_chunk": None}), ids)
    for layer in range(len(cache.layers)):
        assert torch.equal(cache.head_lengths(layer), ref.head_lengths(layer))
    torch.testing.assert_close(cache.layers[0].view().keys, ref.layers[0].view().keys, atol=1e-6, rtol=0)


def test_refusals():
    with pytest.raises(ValueError, match="scorer KVzip scores with its own model pass"):
        preset("kvzip_layerwise", compression_ratio=0.5, prefill_chunk=64)
    assert Pipeline(scorer=SnapKV(), layers=AdaLayer(), compression_ratio=0.5, prefill_chunk=64).prefill_chunk == 64
    with pytest.raises(ValueError, match="prefill_chunk"):
        Pipeline(scorer=KVzip(), compression_ratio=0.5, prefill_chunk=64)

    with pytest.raises(ValueError, match="scorer WholeContext does not support chunked prefill"):
        Pipeline(scorer=WholeContext(), budget=4, prefill_chunk=8)
    assert Pipeline(scorer=WholeContext(), budget=4).prefill_chunk is None


class WholeContext(ka.Scorer):
    """A user scorer that needs the whole context at once."""

    name: Literal["whole_context_only"] = "whole_context_only"
    supports_chunked_prefill: ClassVar[bool] = False

    def score(self, obs):
        return obs.keys[..., 0]


def test_refuses_outputs_it_cannot_give(llama):
    press = preset("snapkv", budget=8, prefill_chunk=16)
    with press(llama), pytest.raises(ValueError, match="output_hidden_states"):
        llama(_ids(40), output_hidden_states=True)


def test_json_round_trip_and_noop():
    press = preset("ada_snapkv", compression_ratio=0.5, prefill_chunk=256)
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    assert not preset("snapkv", compression_ratio=0.0, prefill_chunk=8).is_noop
    assert preset("snapkv", compression_ratio=0.0).is_noop


def test_kvpress_generate_and_fanout_refusal(llama, tokenizer):
    press = preset("ada_snapkv", budget=20, prefill_chunk=16, scorer=SnapKV(window=8))
    answers = ka.generate(llama, tokenizer, ["hello world " * 10, "some other text " * 6], ["what?", "why?"],
                          press=press, max_new_tokens=4)
    single = ka.generate(llama, tokenizer, "some other text " * 6, ["what?", "why?"], press=press, max_new_tokens=4)
    assert answers[1] == single
    from kvpress_ada.hosts.transformers.fanout import capture_prefill

    prefill = capture_prefill(llama, _ids(40))
    with pytest.raises(ValueError, match="prefills in chunks of 16 tokens"):
        prefill.keep_masks(press)


def test_cli_refuses_unsupported_press(capsys, tmp_path):
    from kvpress_ada.harness.cli import main

    code = main(["eval", "--presets", "ada_snapkv,kvzip", "--prefill-chunk", "64", "--out", str(tmp_path / "o")])
    assert code != 0
    assert "--prefill-chunk with kvzip" in capsys.readouterr().err


def test_query_blocks_equal_one_attention_call(llama, monkeypatch):
    """Rows padded to a long head are attended in query blocks (bounded temporaries): the same output,
    the same kept sets and logits as one call over the whole chunk."""
    from kvpress_ada.hosts.transformers import chunked_prefill as cp

    gen = torch.Generator().manual_seed(3)
    B, H, Hq, C, L, D = 2, 2, 4, 7, 19, 8
    q, k, v = (torch.randn(B, h, n, D, generator=gen) for h, n in ((Hq, C), (H, L), (H, L)))
    pos = torch.randint(0, 30, (B, H, L), generator=gen)
    valid = torch.rand(B, H, L, generator=gen) > 0.3
    chunk_pos = torch.arange(20, 20 + C)
    whole = cp._chunk_attention(q, k, v, pos, valid, chunk_pos, 0.3)
    monkeypatch.setattr(cp, "SCORE_BYTES", 4 * B * Hq * L * 3)  # blocks of 3 queries: 3 + 3 + 1
    torch.testing.assert_close(cp._chunk_attention(q, k, v, pos, valid, chunk_pos, 0.3), whole, atol=1e-6, rtol=0)

    ids = _ids(90, seed=4)
    press = Pipeline(scorer=KNorm(), layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0),
                     compression_ratio=0.6, prefill_chunk=16)
    monkeypatch.setattr(cp, "SCORE_BYTES", 1 << 40)
    out, cache = _prefill(llama, press, ids)
    monkeypatch.setattr(cp, "SCORE_BYTES", 1)  # one query per block
    out_blocks, cache_blocks = _prefill(llama, press, ids)
    torch.testing.assert_close(out_blocks.logits, out.logits, atol=1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(_lengths(cache_blocks), _lengths(cache)))
