"""Scorers that read the hidden states entering attention (``reads_hidden_states``), and the model-scope
layer schedule in chunked prefill and decode compression.

A hidden-state scorer scores each token's entries once, when the token arrives; the integration keeps
those scores with the sequence and hands them back aligned with the entries (``obs.entry_scores``) in
every mode. Exactness checks use a model whose attention outputs are zeroed (``o_proj = 0``): every
hidden state, key norm and entry score then depends on its token alone, so a greedy top-k over a
growing set (chunks, decode compactions) must end with the one-shot top-k of everything seen.
"""

from typing import ClassVar, Literal

import pytest
import torch
from conftest import build_model, generate_ragged_and_mask
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import AdaHead, AdaLayer, KNorm, Pipeline, Scorer, register_scorer
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import output_cache

torch.set_num_threads(1)


def _projection(layer_idx: int, hidden: int, heads: int) -> torch.Tensor:
    return torch.randn(hidden, heads, generator=torch.Generator().manual_seed(100 + layer_idx))


@register_scorer("test_hidden_projection", override=True)
class HiddenProjection(Scorer):
    """Entry score: a fixed random projection of the token's hidden state entering the layer."""

    name: Literal["test_hidden_projection"] = "test_hidden_projection"
    heads: int = 2
    reads_hidden_states: ClassVar[bool] = True

    def query_window(self) -> int:
        return 0

    def entry_scores(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        w = _projection(layer_idx, hidden.shape[-1], self.heads).to(hidden)
        return (hidden @ w).transpose(1, 2)

    def score(self, obs):
        return self.entry_scored(obs)

MODEL_SCOPE = dict(layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0))


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", seed=5)


@pytest.fixture(scope="module")
def token_local():
    """A model whose attention writes nothing (o_proj = 0): every hidden state depends on its token only."""
    model = build_model("llama", seed=6)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


def _ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(4, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _cache(model, press, ids, mask=None):
    with press(model):
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    return output_cache(out)


def _kept(cache, layer: int) -> list[list[list[int]]]:
    """Sequence positions each (row, kv head) of a layer keeps (sorted)."""
    held = cache.layers[layer].view()
    return [[sorted(int(p) for p, v in zip(held.positions[b, h], held.valid[b, h]) if v)
             for h in range(held.positions.shape[1])] for b in range(held.positions.shape[0])]


def _all_kept(cache):
    return [_kept(cache, i) for i in range(len(cache.layers))]


def test_entry_scores_reach_the_scorer_aligned_with_the_entries(llama):
    """What the scorer sees as obs.entry_scores is its own entry_scores of the hidden state that entered
    the attention with each token (checked against a fan-out capture of those hidden states)."""
    seen = {}

    class Spy(HiddenProjection):
        def score(self, obs):
            seen[obs.layer_idx] = obs.entry_scores.clone()
            return super().score(obs)

    ids = _ids(30, seed=1)
    _cache(llama, Pipeline(scorer=Spy(), compression_ratio=0.5), ids)
    prefill = capture_prefill(llama, ids, hidden_states=True)
    for i, c in enumerate(prefill.layers):
        torch.testing.assert_close(seen[i], HiddenProjection().entry_scores(c.hidden, i))


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_fan_out_equals_the_press_and_mask_equals_ragged(llama, scope):
    extra = MODEL_SCOPE if scope == "model" else {}
    press = Pipeline(scorer=HiddenProjection(), compression_ratio=0.6, **extra)
    ids = _ids(40, seed=2)
    cache = _cache(llama, press, ids)
    fanned = capture_prefill(llama, ids, hidden_states=True).compressed_cache(press)
    assert _all_kept(cache) == _all_kept(fanned)
    with pytest.raises(ValueError, match="hidden_states=True"):
        capture_prefill(llama, ids).keep_masks(press)
    assert torch.equal(*generate_ragged_and_mask(llama, press, ids, max_new_tokens=5))


@settings(max_examples=6, deadline=None)
@given(pad=st.integers(1, 9), ratio=st.sampled_from([0.3, 0.7]), scope=st.sampled_from(["layer", "model"]))
def test_a_padded_batch_row_equals_the_row_alone(llama, pad, ratio, scope):
    extra = MODEL_SCOPE if scope == "model" else {}
    press = Pipeline(scorer=HiddenProjection(), compression_ratio=ratio, **extra)
    a, b = _ids(30, seed=3), _ids(30 - pad, seed=4)
    ids = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    both = _all_kept(_cache(llama, press, ids, mask))
    alone = _all_kept(_cache(llama, press, b))
    assert [layer[1] for layer in both] == [[[p + pad for p in h] for h in layer[0]] for layer in alone]


# KNorm's scores are not comparable across heads: model scope then compares each head's shares of its own
# mass, which depend on what the head holds, so only its layer scope is a top-k of fixed scores
PER_TOKEN = [(HiddenProjection(), "layer"), (HiddenProjection(), "model"), (KNorm(), "layer")]
PER_TOKEN_IDS = ["hidden-layer", "hidden-model", "knorm-layer"]


@pytest.mark.parametrize("scorer,scope", PER_TOKEN, ids=PER_TOKEN_IDS)
@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_keeps_the_one_shot_entries_when_scores_are_per_token(token_local, scorer, scope, chunk):
    """Scores fixed per entry: keeping the best after every chunk ends with the one-shot top-k (model
    scope too: one top-k over all layers and heads, chunk by chunk)."""
    extra = MODEL_SCOPE if scope == "model" else {}
    press = Pipeline(scorer=scorer, budget=9, **extra)
    ids = _ids(61, seed=5)
    chunked = _cache(token_local, press.model_copy(update={"prefill_chunk": chunk}), ids)
    assert _all_kept(chunked) == _all_kept(_cache(token_local, press, ids))


@pytest.mark.parametrize("chunk", [5, 12])
def test_model_scope_chunked_totals_are_exact(llama, chunk):
    """Every row ends with n_layers * H * b entries over all layers, split as the scores say."""
    press = Pipeline(scorer=HiddenProjection(), budget=6, prefill_chunk=chunk, **MODEL_SCOPE)
    ids, mask = _ids(50, seed=6, batch=2), torch.ones(2, 50, dtype=torch.long)
    mask[1, :11] = 0
    cache = _cache(llama, press, ids, mask)
    n, H = len(cache.layers), llama.config.num_key_value_heads
    totals = sum(cache.head_lengths(i).sum(-1) for i in range(n))
    assert totals.tolist() == [n * H * 6, n * H * 6]
    per_layer = {int(cache.head_lengths(i)[0].sum()) for i in range(n)}
    assert len(per_layer) > 1  # the split follows the scores, not a uniform share


@pytest.mark.parametrize("scorer,scope", PER_TOKEN, ids=PER_TOKEN_IDS)
def test_decode_compaction_keeps_the_one_shot_entries_when_scores_are_per_token(token_local, scorer, scope):
    """Generated tokens are scored as they arrive: after a compaction the cache holds what a one-shot
    prefill of the whole sequence (prompt and generated tokens) keeps at the same budget."""
    extra = MODEL_SCOPE if scope == "model" else {}
    ids = _ids(24, seed=7)
    press = Pipeline(scorer=scorer, budget=8, decode_budget=8, decode_interval=4, **extra)
    with torch.no_grad(), press(token_local):
        out = token_local.generate(ids, max_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert cache.state.compactions == [2] * len(cache.layers)
    if scorer.reads_hidden_states:  # one score per token fed (the last generated token was never fed)
        assert [s.shape[2] for s in cache.state.entry_scores] == [24 + 8] * len(cache.layers)
    fed = out.sequences[:, :24 + 8]
    reference = _cache(token_local, Pipeline(scorer=scorer, budget=8, **extra), fed)
    assert _all_kept(cache) == _all_kept(reference)


def test_model_scope_decode_compaction_bounds_the_whole_cache(llama):
    press = Pipeline(scorer=HiddenProjection(), budget=10, decode_budget=5, decode_interval=3, **MODEL_SCOPE)
    with torch.no_grad(), press(llama):
        out = llama.generate(_ids(30, seed=8), max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    n, H = len(cache.layers), llama.config.num_key_value_heads
    lengths = torch.stack([cache.head_lengths(i)[0] for i in range(n)])
    # the last compaction left n * H * 5 entries; at most 3 tokens arrived since (minus the unfed last one)
    assert int(lengths.sum()) <= n * H * (5 + 3)
    assert len({int(x) for x in lengths.sum(-1)}) > 1 or n == 1


def test_decode_only_press_scores_the_prefill_tokens(llama):
    press = Pipeline(scorer=HiddenProjection(), decode_budget=6, decode_interval=4)
    with torch.no_grad(), press(llama):
        out = llama.generate(_ids(20, seed=9), max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    state = out.past_key_values.state
    assert [s.shape[2] for s in state.entry_scores] == [25] * 3
    assert state.compactions == [1, 1, 1]


def test_entry_scores_are_dropped_after_a_prefill_without_decode_compression(llama):
    for chunk in (None, 8):
        cache = _cache(llama, Pipeline(scorer=HiddenProjection(), budget=5, prefill_chunk=chunk), _ids(30))
        assert cache.state.entry_scores == [None] * len(cache.layers)
