"""KVzap: a learned surrogate scores every entry from its token's hidden state, in every mode."""

import pytest
import torch
from conftest import ARCHITECTURES, build_model, build_tokenizer, generate_ragged_and_mask, random_surrogate

from kvpress_ada import AdaHead, AdaLayer, Pipeline, Threshold, generate, preset
from kvpress_ada import surrogate as sur
from kvpress_ada.families import family_of
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.presets import portable_preset_names
from kvpress_ada.runtime import compressed_layers
from kvpress_ada.scorers.kvzap import KVzap

torch.set_num_threads(1)
MODEL_SCOPE = dict(layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request, tmp_path_factory):
    """A tiny model of each architecture with a random linear surrogate file made for it."""
    model = build_model(request.param, seed=11)
    path = tmp_path_factory.mktemp("surrogate") / f"{request.param}.safetensors"
    sur.save(random_surrogate(model.config, seed=3), path)
    return model, str(path)


def _ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(4, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _kept(cache) -> list[torch.Tensor]:
    """Kept positions of every layer the press compresses (a hybrid model's sliding-window layers hold their
    window)."""
    out = []
    for i in cache.compressed_layers():
        held = cache.layers[i].view()
        out.append(torch.where(held.valid, held.positions, -1).sort(-1).values)
    return out


@torch.no_grad()
def _cache(model, press, ids, mask=None):
    with press(model):
        return output_cache(model(input_ids=ids, attention_mask=mask, use_cache=True))


def test_scores_are_the_surrogate_of_each_attention_input_with_sinks_protected(tiny):
    model, path = tiny
    seen = {}

    class Spy(KVzap):
        def score(self, obs):
            seen[obs.layer_idx] = super().score(obs)
            return seen[obs.layer_idx]

    ids = _ids(20, seed=1)
    _cache(model, Pipeline(scorer=Spy(path=path, sinks=3), compression_ratio=0.5), ids)
    hidden = capture_prefill(model, ids, hidden_states=True).layers
    assert set(seen) == set(compressed_layers(family_of(model)))
    for i in seen:
        want = sur.load(path).predict(hidden[i].hidden, i)
        want[..., :3] = float("inf")
        torch.testing.assert_close(seen[i], want)


def test_every_mode_runs_and_agrees(tiny):
    """One-shot == fan-out, ragged == Mask, a padded row == the row alone, chunked and decode compression
    hold their budgets, generate (question-agnostic) answers."""
    model, path = tiny
    press = Pipeline(scorer=KVzap(path=path), compression_ratio=0.5, **MODEL_SCOPE)
    ids = _ids(36, seed=2)
    kept = _kept(_cache(model, press, ids))
    assert all(torch.equal(a, b) for a, b in zip(kept, _kept(
        capture_prefill(model, ids, hidden_states=True).compressed_cache(press))))
    assert torch.equal(*generate_ragged_and_mask(model, press, ids))
    pad = 5
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), ids[:, pad:]], 1), ids])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    padded = _kept(_cache(model, press, batch, mask))
    alone = _kept(_cache(model, press, ids[:, pad:]))
    for a, b in zip(padded, alone):
        assert torch.equal(a[0][a[0] >= 0], b[0][b[0] >= 0] + pad)
    scope, H = compressed_layers(family_of(model)), model.config.num_key_value_heads
    n = len(scope)
    chunked = _cache(model, press.model_copy(update={"prefill_chunk": 8}), ids)
    assert sum(int(chunked.head_lengths(i).sum()) for i in scope) == n * H * 18
    decoding = Pipeline(scorer=KVzap(path=path, window=2), budget=6, decode_budget=6, decode_interval=4,
                        **MODEL_SCOPE)
    with torch.no_grad(), decoding(model):
        out = model.generate(ids, max_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert [cache.state.compactions[i] for i in scope] == [2] * n
    assert sum(int(cache.head_lengths(i).sum()) for i in scope) <= n * H * (6 + 4)
    tok = build_tokenizer()
    answer = generate(model, tok, "The key is 42. " * 3, ["Key?"], press=press, max_new_tokens=3)
    assert isinstance(answer, list) and len(answer) == 1


def test_threshold_keeps_what_the_surrogate_clears(tiny):
    model, path = tiny
    ids = _ids(30, seed=4)
    prefill = capture_prefill(model, ids, hidden_states=True)
    tau = float(sur.load(path).predict(prefill.layers[0].hidden, 0).median())
    press = Pipeline(scorer=KVzap(path=path, sinks=0), allocator=Threshold(tau=tau, floor=0))
    cache = _cache(model, press, ids)
    for i in compressed_layers(family_of(model)):
        want = (sur.load(path).predict(prefill.layers[i].hidden, i) >= tau).sum(-1)
        assert torch.equal(cache.head_lengths(i), want.clamp(min=0))


def test_a_surrogate_for_another_model_is_refused_in_one_line(tiny):
    model, path = tiny
    other = build_model("llama", seed=0, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"was trained for model .* not for") as err:
        with Pipeline(scorer=KVzap(path=path), compression_ratio=0.5)(other):
            pass
    assert "\n" not in str(err.value)


def test_presets_use_the_shipped_surrogates_and_are_model_specific():
    for name in ("kvzap", "kvzap_linear", "kvzap_threshold"):
        press = preset(name, compression_ratio=None if name == "kvzap_threshold" else 0.5)
        assert isinstance(press.scorer, KVzap) and name not in portable_preset_names()
    assert preset("kvzap", compression_ratio=0.5).scorer.path == sur.SHIPPED_MLP
    assert preset("kvzap_linear", compression_ratio=0.5).scorer.path == sur.SHIPPED_LINEAR
    assert isinstance(preset("kvzap_threshold").allocator, Threshold)
    assert isinstance(preset("kvzap", compression_ratio=0.5).layers, AdaLayer)
