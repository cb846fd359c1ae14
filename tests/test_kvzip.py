"""KVzip: the reconstruction passes, their scores against the formula written out, and the press
through every entry point (direct forward, fan-out, batches equal single rows)."""

import math

import pytest
import torch
from conftest import build_model, build_tokenizer

from kvpress_ada import KVzip, preset
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.scorers.kvzip import FIRST_PROMPT, NEXT_PROMPT, PassChunk


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_pass_chunks_follow_each_rows_valid_tokens():
    tok = build_tokenizer()
    ctx = torch.arange(10, 30).view(2, 10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False  # row 1: 7 valid tokens
    chunks = KVzip(chunk=4, overlap=2).pass_chunks(ctx, mask, tok)
    assert len(chunks) == 3  # ceil(10 / 4) for row 0
    suffix = _enc(tok, "</s><s>assistant: ")
    first, later = _enc(tok, FIRST_PROMPT), _enc(tok, NEXT_PROMPT)
    row = lambda c, b: chunks[c].ids[b][chunks[c].mask[b]].tolist()  # noqa: E731
    assert row(0, 0) == first + suffix + [10, 11, 12, 13]
    assert row(1, 0) == later + [12, 13] + suffix + [14, 15, 16, 17]
    assert row(0, 1) == first + suffix + [23, 24, 25, 26]  # row 1's valid tokens start at column 3
    assert row(2, 1) == later + [28, 29] + suffix  # nothing left to repeat for row 1
    assert chunks[1].scored[1].nonzero().flatten().tolist() == [7, 8, 9]
    assert not chunks[0].visible[0, 4:].any() and chunks[1].visible[0, :2].all()  # sinks from chunk 2 on
    assert chunks[1].visible[1, 3:5].all() and not chunks[1].visible[1, :3].any()


def test_pass_scores_match_the_formula_written_out():
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, T, L, D = 2, 2, 2, 4, 6, 3
    query = torch.randn(B, Hkv * G, T, D, generator=g)
    key = torch.randn(B, Hkv, L + T, D, generator=g)
    pass_mask = torch.tensor([[True] * 4, [False, True, True, True]])
    scored = torch.zeros(B, L, dtype=torch.bool)
    scored[0, 2:5] = True
    scored[1, 3:6] = True
    visible = scored.clone()
    visible[:, 0] = True  # a sink
    chunk = PassChunk(ids=torch.zeros(B, T, dtype=torch.long), mask=pass_mask, scored=scored, visible=visible)
    scaling = 0.7
    got = KVzip().pass_scores(query, key, chunk, scaling)
    for b in range(B):
        for h in range(Hkv):
            for j in range(L):
                best = 0.0
                for gq in range(G):
                    for t in range(T):
                        if not pass_mask[b, t] or not scored[b, j]:
                            continue
                        cols = [c for c in range(L) if visible[b, c]]
                        cols += [L + u for u in range(T) if pass_mask[b, u] and u <= t]
                        q = query[b, h * G + gq, t]
                        logit = {c: float(q @ key[b, h, c]) * scaling for c in cols}
                        z = sum(math.exp(v) for v in logit.values())
                        best = max(best, math.exp(logit[j]) / z)
                assert abs(float(got[b, h, j]) - best) < 1e-5, (b, h, j)


def test_kvzip_press_keeps_cache_intact_and_equals_fanout():
    model = build_model("llama")
    ids = torch.randint(5, 100, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[0, :9] = 0
    ids[0, :9] = 0
    press = preset("kvzip", compression_ratio=0.5, scorer=KVzip(chunk=16))  # several passes
    with press(model):
        out = model(input_ids=ids, attention_mask=mask)
    cache = output_cache(out)
    assert cache.get_seq_length() == 70  # the passes were cropped off
    reference = model(input_ids=ids, attention_mask=mask)  # logits of the prefill are the model's own
    assert torch.allclose(out.logits, reference.logits, atol=1e-5)
    kept = torch.stack([cache.head_lengths(i).sum(-1) for i in range(3)], 1).sum(-1)
    H = model.config.num_key_value_heads
    assert torch.equal(kept, 3 * H * torch.round(0.5 * mask.sum(-1).double()).long())
    fanned = capture_prefill(model, ids, mask).compressed_cache(press)
    for i in range(3):
        assert torch.equal(fanned.head_lengths(i), cache.head_lengths(i))


def test_kvzip_needs_a_tokenizer_and_says_how():
    model = build_model("llama", seed=3)
    from kvpress_ada.hosts.transformers import model_pass

    model_pass._TOKENIZERS.pop(model, None)
    with pytest.raises(ValueError, match="use_tokenizer"), preset("kvzip", compression_ratio=0.5)(model):
        model(input_ids=torch.randint(5, 100, (1, 20)))


def test_kvzip_scores_need_the_pass():
    model = build_model("llama")
    prefill = capture_prefill(model, torch.randint(5, 100, (1, 20)))
    obs = prefill.view(KVzip(), 0).observations()[0]
    with pytest.raises(ValueError, match="model pass"):
        KVzip().score(obs)


def test_pass_scores_from_the_callers_own_lse_equal_the_computed_ones():
    """The pass hands ``lse_own`` (the log-sum-exp over its own tokens) from its attention kernel;
    the scores must equal those computed from scratch, on a chunk whose softmax spans only part of
    the context (so only those columns are multiplied)."""
    from kvpress_ada.kernels.model_pass.lse_attention import attention_with_lse

    g = torch.Generator().manual_seed(3)
    B, Hkv, G, T, L, D = 2, 2, 3, 5, 9, 4
    query = torch.randn(B, Hkv * G, T, D, generator=g)
    key = torch.randn(B, Hkv, L + T, D, generator=g)
    pass_mask = torch.tensor([[True] * T, [False] + [True] * (T - 1)])
    scored = torch.zeros(B, L, dtype=torch.bool)
    scored[0, 4:7] = True
    scored[1, 5:8] = True
    visible = scored.clone()
    visible[:, :2] = True
    chunk = PassChunk(ids=torch.zeros(B, T, dtype=torch.long), mask=pass_mask, scored=scored, visible=visible)
    scorer = KVzip()
    own = key[:, :, L:]
    lse_own = attention_with_lse(query, own, own, scorer.pass_mask(chunk)[..., L:], 0.5)[1]
    from_caller = scorer.pass_scores(query, key, chunk, 0.5, lse_own=lse_own)
    torch.testing.assert_close(from_caller, scorer.pass_scores(query, key, chunk, 0.5))
    assert (from_caller[~scored[:, None, :].expand_as(from_caller)] == 0).all()
    assert (from_caller[scored[:, None, :].expand_as(from_caller)] > 0).all()
