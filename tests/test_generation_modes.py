"""Hugging Face generation modes and cache operations under a press: each runs correctly or is
refused in one line (assisted decoding, cache crop, beam reordering, attentions, other caches)."""

import copy

import pytest
import torch
from conftest import build_model, random_surrogate

from kvpress_ada import Mask, Pipeline, SnapKV, TopK
from kvpress_ada import surrogate as sur
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.scorers.kvzap import KVzap

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return build_model("llama", seed=5)


def _ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(4, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _kept(cache) -> list[torch.Tensor]:
    return [torch.where(v.valid, v.positions, -1).sort(-1).values for v in (layer.view() for layer in cache.layers)]


@pytest.mark.parametrize("evictor", [TopK(), Mask()])
@pytest.mark.parametrize("assistant", ["prompt_lookup", "assistant_model"])
def test_assisted_decoding_is_refused_in_one_line_or_gives_plain_greedy_tokens(model, evictor, assistant):
    ids = _ids(40)
    ids[0, 30:36] = ids[0, 5:11]  # something for the prompt lookup to find
    how = {"prompt_lookup_num_tokens": 3} if assistant == "prompt_lookup" else \
        {"assistant_model": build_model("llama", seed=6)}
    press = Pipeline(scorer=SnapKV(window=4), compression_ratio=0.5, evictor=evictor)
    with torch.no_grad(), press(model):
        plain = model.generate(ids, max_new_tokens=6, do_sample=False)
        try:
            assisted = model.generate(ids, max_new_tokens=6, do_sample=False, **how)
        except ValueError as err:  # refused: in one line, naming assisted decoding
            assert "assisted decoding" in str(err) and "\n" not in str(err)
        else:  # a transformers version that never rewinds compressed entries here: plain greedy's tokens exactly
            assert torch.equal(assisted, plain)


@torch.no_grad()
def test_crop_forgets_the_cropped_tokens_scores_and_counters(model, tmp_path):
    path = tmp_path / "s.safetensors"
    sur.save(random_surrogate(model.config, seed=3), path)
    press = Pipeline(scorer=KVzap(path=str(path), window=2), budget=10, decode_budget=10, decode_interval=3)
    ids, steps = _ids(30), _ids(4, seed=1)

    def run(rejected: bool):
        with press(model):
            cache = output_cache(model(input_ids=ids, use_cache=True))
            if rejected:  # a token fed, then cropped away (as assisted decoding does with a rejected candidate)
                model(input_ids=steps[:, 3:4], past_key_values=cache, use_cache=True)
                cache.crop(-1)
            for t in range(3):
                logits = model(input_ids=steps[:, t:t + 1], past_key_values=cache, use_cache=True).logits
        return cache, logits

    cropped, logits = run(True)
    plain, expected = run(False)
    assert plain.state.compactions[0] == 1
    assert cropped.state.since == plain.state.since
    assert cropped.state.compactions == plain.state.compactions
    for a, b in zip(cropped.state.entry_scores, plain.state.entry_scores):
        assert torch.equal(a, b)
    for a, b in zip(_kept(cropped), _kept(plain)):
        assert torch.equal(a, b)
    torch.testing.assert_close(logits, expected)


@torch.no_grad()
def test_crop_past_a_decode_compaction_is_refused_in_one_line(model):
    press = Pipeline(scorer=SnapKV(window=2), budget=10, decode_budget=10, decode_interval=2, evictor=Mask())
    with press(model):
        cache = output_cache(model(input_ids=_ids(30), use_cache=True))
        for t in range(3):
            model(input_ids=_ids(1, seed=t), past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="cannot crop 2 tokens"):
            cache.crop(-2)


@torch.no_grad()
def test_beam_reordering_moves_keep_masks_and_query_windows_with_their_rows(model):
    press = Pipeline(scorer=SnapKV(window=2), budget=8, decode_budget=8, decode_interval=2, evictor=Mask())
    ids, steps = _ids(30, batch=2), _ids(5, seed=2, batch=2)
    swap = torch.tensor([1, 0])
    with press(model):
        cache = output_cache(model(input_ids=ids, use_cache=True))
        for t in range(3):  # one compaction, then one step whose query is recorded for the next
            model(input_ids=steps[:, t:t + 1], past_key_values=cache, use_cache=True)
        reordered = copy.deepcopy(cache)
        reordered.reorder_cache(swap)
        for t in range(3, 5):  # the next compaction reads the query windows
            plain = model(input_ids=steps[:, t:t + 1], past_key_values=cache, use_cache=True).logits
            moved = model(input_ids=steps[swap, t:t + 1], past_key_values=reordered, use_cache=True).logits
            torch.testing.assert_close(moved, plain[swap])
    for a, b in zip(_kept(reordered), _kept(cache)):
        assert torch.equal(a, b[swap])


def test_output_attentions_is_refused_in_one_line(model):
    press = Pipeline(scorer=SnapKV(window=4), compression_ratio=0.5)
    with torch.no_grad(), press(model), pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=_ids(30), use_cache=True, output_attentions=True)


@pytest.mark.parametrize("implementation", ["static", "offloaded"])
def test_other_cache_implementations_are_refused_in_one_line(model, implementation):
    press = Pipeline(scorer=SnapKV(window=4), compression_ratio=0.5)
    with torch.no_grad(), press(model), pytest.raises(ValueError, match="cache_implementation"):
        model.generate(_ids(30), max_new_tokens=3, do_sample=False, cache_implementation=implementation)


@torch.no_grad()
def test_bytes_count_the_hidden_state_scores_held(model, tmp_path):
    path = tmp_path / "s.safetensors"
    sur.save(random_surrogate(model.config, seed=3), path)
    press = Pipeline(scorer=KVzap(path=str(path), window=2), budget=10, decode_budget=10, decode_interval=3)
    with press(model):
        cache = output_cache(model(input_ids=_ids(30), use_cache=True))
        for t in range(4):
            model(input_ids=_ids(1, seed=t), past_key_values=cache, use_cache=True)
    scores = sum(s.numel() * s.element_size() for s in cache.state.entry_scores)
    assert scores == len(cache.layers) * model.config.num_key_value_heads * 34 * 4
    assert cache.nbytes() == sum(cache.layers[i].nbytes() for i in range(len(cache.layers))) + scores
