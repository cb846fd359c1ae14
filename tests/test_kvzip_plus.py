"""KVzip+ (``KVzip(plus=True)``, preset ``kvzip_plus``): the pass scores against the formula recomputed
from the model's weights in plain torch, the option off leaves KVzip unchanged, and the preset runs.
Ragged (TopK) against the Mask reference and a padded batch against single rows run for every preset,
``kvzip_plus`` included, in test_matrix.py and test_press_edge_cases.py."""

import pytest
import torch
from conftest import build_model
from transformers import DynamicCache

from kvpress_ada import KVzip, Pipeline, preset
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache
from kvpress_ada.hosts.transformers.model_pass import model_pass_scores, tokenizer_for
from kvpress_ada.scorers.kvzip import PassChunk, output_norms


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@torch.no_grad()
def _formula_scores(model, ids, scorer):
    """Per layer ``[H_kv, L]``: KVzip(+) scores of a one-row context, recomputed from the weights.

    Every pass is run as one plain forward over ``context + pass`` (the pass's tokens see the whole
    context, like the real pass over the cache); the scoring softmax spans the chunk's visible
    entries and the pass's tokens up to the query; KVzip+ multiplies by ``||W_O^g v_i||`` and divides
    by the norm of the query token's hidden state after the layer's input norm."""
    cfg = model.config
    decoder = model.get_decoder()
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D, G, L = cfg.hidden_size // Hq, Hq // cfg.num_key_value_heads, ids.shape[1]
    totals = [torch.zeros(Hkv, L) for _ in decoder.layers]
    for chunk in scorer.pass_chunks(ids, torch.ones_like(ids, dtype=torch.bool), tokenizer_for(model)):
        assert chunk.mask.all()  # one row: no padding in the pass
        full = torch.cat([ids, chunk.ids], dim=1)
        n, T = full.shape[1], chunk.ids.shape[1]
        hidden = model(full, output_hidden_states=True, use_cache=False).hidden_states  # [l]: entering layer l
        angles = torch.arange(n).float()[:, None] * decoder.rotary_emb.inv_freq.float()[None]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        columns = torch.cat([chunk.visible[0], torch.ones(T, dtype=torch.bool)])
        allowed = columns[None].repeat(T, 1)
        allowed[:, L:] &= torch.ones(T, T, dtype=torch.bool).tril()  # causal among the pass's tokens
        for layer_idx, layer in enumerate(decoder.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden[layer_idx][0])  # [n, hidden]: what the attention module receives
            q = attn.q_proj(x).view(n, Hq, D).transpose(0, 1)
            k = attn.k_proj(x).view(n, Hkv, D).transpose(0, 1)
            v = attn.v_proj(x).view(n, Hkv, D).transpose(0, 1)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            for h in range(Hkv):
                for g in range(G):
                    head = h * G + g
                    logits = (q[head, L:] @ k[h].T) / D**0.5  # [T, n]
                    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)[:, :L]  # [T, L]
                    if scorer.plus:
                        w_o = attn.o_proj.weight[:, head * D:(head + 1) * D]  # [hidden, D]: this head's slice
                        probs = probs / x[L:].norm(dim=-1)[:, None] * (v[h, :L] @ w_o.T).norm(dim=-1)[None]
                    best = probs.amax(0) * chunk.scored[0]
                    totals[layer_idx][h] = torch.maximum(totals[layer_idx][h], best)
    return totals


@pytest.mark.parametrize("plus", [False, True])
def test_pass_scores_match_the_formula_on_a_model(plus, monkeypatch):
    from kvpress_ada.hosts.transformers import model_pass

    split_calls = []
    parts = model_pass.prefix_then_causal_parts
    monkeypatch.setattr(model_pass, "prefix_then_causal_parts",
                        lambda *a, **k: split_calls.append(1) or parts(*a, **k))
    model = build_model("llama", seed=5)
    ids = torch.randint(5, 100, (1, 40), generator=torch.Generator().manual_seed(2))
    scorer = KVzip(chunk=24, plus=plus)  # two passes: the second sees the sinks and quotes the first
    cache = output_cache(model(ids, use_cache=True, **{cache_kwarg(model): DynamicCache(config=model.config)}))
    got = model_pass_scores(model, scorer, cache, ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([40]))
    assert cache.get_seq_length() == 40
    assert len(split_calls) == 2 * model.config.num_hidden_layers  # the unpadded passes took the split kernels
    want = _formula_scores(model, ids, scorer)
    for layer_idx, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a[0], b, rtol=1e-4, atol=1e-7, msg=f"layer {layer_idx}")


def _random_pass(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G, T, L, D, hidden = 2, 2, 3, 5, 7, 4, 16
    query = torch.randn(B, Hkv * G, T, D, generator=g)
    key = torch.randn(B, Hkv, L + T, D, generator=g)
    value = torch.randn(B, Hkv, L + T, D, generator=g)
    weight = torch.randn(hidden, Hkv * G * D, generator=g)
    hidden_norm = torch.rand(B, T, generator=g) + 0.5
    mask = torch.tensor([[True] * T, [False, False] + [True] * (T - 2)])
    scored = torch.zeros(B, L, dtype=torch.bool)
    scored[:, 2:] = True
    visible = scored.clone()
    visible[:, 0] = True
    chunk = PassChunk(ids=torch.zeros(B, T, dtype=torch.long), mask=mask, scored=scored, visible=visible)
    return query, key, chunk, dict(value=value, output_weight=weight, hidden_norm=hidden_norm)


def test_option_off_ignores_the_plus_inputs_and_on_changes_the_scores():
    query, key, chunk, extra = _random_pass()
    plain = KVzip().pass_scores(query, key, chunk, 0.5)
    assert not KVzip().pass_reads_hidden_states() and KVzip(plus=True).pass_reads_hidden_states()
    assert torch.equal(KVzip(plus=False).pass_scores(query, key, chunk, 0.5, **extra), plain)
    plus = KVzip(plus=True).pass_scores(query, key, chunk, 0.5, **extra)
    assert not torch.allclose(plus, plain)
    assert torch.equal(plus == 0, plain == 0)  # the same entries are scored (unscored ones stay 0)
    with pytest.raises(ValueError, match="KVzip\\+"):
        KVzip(plus=True).pass_scores(query, key, chunk, 0.5)


def test_output_norms_use_each_query_heads_slice_of_o_proj():
    _, key, _, extra = _random_pass(seed=1)
    value, weight = extra["value"], extra["output_weight"]
    got = output_norms(value, weight)  # [B, Hkv, G, L + T]
    B, Hkv, n, D = value.shape
    G = weight.shape[1] // (Hkv * D)
    for h in range(Hkv):
        for g in range(G):
            head = h * G + g
            want = (value[:, h] @ weight[:, head * D:(head + 1) * D].T).norm(dim=-1)  # [B, n]
            torch.testing.assert_close(got[:, h, g], want, rtol=1e-5, atol=1e-6)


def test_kvzip_plus_preset_runs_and_equals_fanout():
    model = build_model("llama")
    press = preset("kvzip_plus", compression_ratio=0.5)
    kvzip = preset("kvzip", compression_ratio=0.5)
    assert press.scorer == KVzip(plus=True) and (press.layers, press.allocator) == (kvzip.layers, kvzip.allocator)
    assert type(press.scorer).comparable_across_heads  # one scale for every head and layer: global top-k
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    ids = torch.randint(5, 100, (2, 60), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 60, dtype=torch.long)
    ids[1, :7], mask[1, :7] = 0, 0
    with press(model):
        out = model(ids, attention_mask=mask)
    cache = output_cache(out)
    assert cache.get_seq_length() == 60
    H = model.config.num_key_value_heads
    kept = torch.stack([cache.head_lengths(i).sum(-1) for i in range(3)], 1).sum(-1)
    assert torch.equal(kept, 3 * H * torch.round(0.5 * mask.sum(-1).double()).long())
    prefill = capture_prefill(model, ids, mask)
    fanned = prefill.compressed_cache(press)
    for i in range(3):
        assert torch.equal(fanned.head_lengths(i), cache.head_lengths(i))
    plain = prefill.keep_masks(kvzip)
    assert any(not torch.equal(a, b) for a, b in zip(prefill.keep_masks(press), plain))  # plus changes the choice
