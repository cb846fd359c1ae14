"""Exact score ties are broken by position, never by float noise (``kvpress_ada.ranking``).

Scores equal in exact arithmetic (KNorm's norms of a repeated token, KeyDiff's cosines of a head's
two entries to their mean) come out a few ulps apart, differently in a padded batch than alone, or
over a ragged cache than over the Mask reference. Selections must not depend on those bits: a
padded batch row keeps what the row alone keeps, and the ragged cache what the Mask reference keeps.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpress_ada import AdaHead, KeyDiff, KNorm, Mask, Pipeline, TopK, UniformHead
from kvpress_ada.allocators.heads import flat_topk_counts
from kvpress_ada.evictors import topk_mask

torch.set_num_threads(1)
_MODELS: dict[str, torch.nn.Module] = {}


def _model(arch):
    if arch not in _MODELS:
        _MODELS[arch] = build_model(arch)
    return _MODELS[arch]


@st.composite
def tied_scores(draw):
    """``[B, H, L]`` scores drawn from a few levels (many exact ties), a copy with a few ulps of noise
    on every entry, and counts ``[B, H]``."""
    B, H, L = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 24))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    levels = torch.randn(draw(st.integers(1, 4)), generator=g) * 10 ** draw(st.integers(-3, 3))
    levels = torch.cat([levels, torch.tensor([float("inf"), float("-inf")])[: draw(st.integers(0, 2))]])
    scores = levels[torch.randint(0, levels.numel(), (B, H, L), generator=g)]
    ulps = torch.randint(-4, 5, (B, H, L), generator=g).float()
    noisy = torch.where(torch.isfinite(scores), scores * (1 + ulps * torch.finfo(torch.float32).eps), scores)
    counts = torch.randint(0, L + 1, (B, H), generator=g)
    return scores, noisy, counts


@settings(max_examples=200, deadline=None)
@given(tied_scores())
def test_selection_ignores_float_noise_and_breaks_ties_by_position(case):
    scores, noisy, counts = case
    keep = topk_mask(scores, counts)
    assert torch.equal(topk_mask(noisy, counts), keep)
    assert torch.equal(keep.sum(-1), counts)
    # among equal scores the later positions are kept: no kept entry has a later, dropped equal
    later_dropped = torch.zeros_like(keep)
    for pos in range(scores.shape[-1] - 1, -1, -1):
        for later in range(pos + 1, scores.shape[-1]):
            same = scores[..., later] == scores[..., pos]
            later_dropped[..., pos] |= same & ~keep[..., later]
    assert not bool((keep & later_dropped).any())
    k = counts.sum(-1)
    assert torch.equal(flat_topk_counts(noisy, k), flat_topk_counts(scores, k))


def _pad_left(rows):
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, L - len(row):], mask[b, L - len(row):] = row, 1
    return ids, mask


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), ada=st.booleans(), lengths=st.lists(st.integers(20, 60), min_size=2, max_size=3))
def test_knorm_on_repeated_tokens_batch_equals_alone(seed, ada, lengths):
    """Two token ids repeated over the whole prompt: KNorm's scores are full of exact ties."""
    model = _model("qwen3")
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(5, 7, (n,), generator=g) for n in lengths]
    ids, mask = _pad_left(rows)
    press = Pipeline(scorer=KNorm(), allocator=AdaHead(alpha=0.2) if ada else UniformHead(), compression_ratio=0.5)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad(), press(model):
        batch = model.generate(ids, attention_mask=mask, **kwargs)
    for b, row in enumerate(rows):
        with torch.no_grad(), press(model):
            alone = model.generate(row[None], **kwargs)
        assert torch.equal(batch.sequences[b, ids.shape[1]:], alone.sequences[0, len(row):])
        for x, y in zip(batch.scores, alone.scores):
            torch.testing.assert_close(x[b], y[0], atol=1e-4, rtol=0)


def _generate(model, press, ids, new_tokens):
    with torch.inference_mode(), press(model):
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), prefill=st.sampled_from([None, 1, 2, 8]), ada=st.booleans())
def test_keydiff_two_entry_heads_ragged_equals_mask(arch, seed, prefill, ada):
    """``decode_budget=1, decode_interval=1``: at every compaction each head holds its kept entry and
    the new token, whose KeyDiff scores (cosine to their mean) are equal in exact arithmetic."""
    model = _model(arch)
    ids = torch.randint(5, 100, (2, 20), generator=torch.Generator().manual_seed(seed))
    fields = dict(scorer=KeyDiff(), allocator=AdaHead(alpha=0.0) if ada else UniformHead(), budget=prefill,
                  decode_budget=1, decode_interval=1)
    tokens_r, logits_r = _generate(model, Pipeline(evictor=TopK(), **fields), ids, 8)
    tokens_m, logits_m = _generate(model, Pipeline(evictor=Mask(), **fields), ids, 8)
    assert torch.equal(tokens_r, tokens_m)
    torch.testing.assert_close(logits_r, logits_m, atol=1e-4, rtol=0)
