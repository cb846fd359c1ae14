"""KVgrad (``KVgrad``, presets ``kvgrad`` / ``ada_kvgrad``): the pass scores against the paper's formula recomputed in
plain torch (one forward over context + pass, autograd for the gradient of the last layer's energy w.r.t. each
attention output), the same under ``torch.inference_mode`` (fan-out) as outside it, the cache and the model left as
they were, the refusals where a backward pass cannot run, and the presets' budgets. Ragged (TopK) against the Mask
reference on every family runs in test_matrix.py."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model
from transformers import DynamicCache

from kvpress_ada import Pipeline, preset
from kvpress_ada.hosts.transformers import check_press
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache
from kvpress_ada.hosts.transformers.model_pass import check_gradient_pass, model_pass_scores, tokenizer_for
from kvpress_ada.scorers import KVgrad, KVzip
from kvpress_ada.scorers.base import PassChunk


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _formula_scores(model, ids, scorer):
    """Per layer ``[H_kv, L]``: KVgrad's scores of a one-row Llama context recomputed from the weights.

    Each pass runs as one plain forward over ``context + pass``; the attention module outputs keep their gradient
    and ``Phi`` sums the squared norms of the last decoder layer's outputs over the pass's tokens. ``A``: the
    softmax of a pass query over the chunk's visible entries and the pass's tokens up to itself (causal); each
    entry's score ``max_{p, g} A_g(p, c) ||W_O^g v_c|| ||dPhi / da_p||``."""
    cfg = model.config
    decoder = model.get_decoder()
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D, G, L = cfg.hidden_size // Hq, Hq // Hkv, ids.shape[1]
    totals = [torch.zeros(Hkv, L) for _ in decoder.layers]
    for chunk in scorer.pass_chunks(ids, torch.ones_like(ids, dtype=torch.bool), tokenizer_for(model)):
        full = torch.cat([ids, chunk.ids], dim=1)
        n, T = full.shape[1], chunk.ids.shape[1]
        outputs, last = [], []
        hooks = [layer.self_attn.register_forward_hook(lambda m, a, o: outputs.append(o[0])) for layer in
                 decoder.layers]
        hooks.append(decoder.layers[-1].register_forward_hook(
            lambda m, a, o: last.append(o[0] if isinstance(o, tuple) else o)))
        with torch.enable_grad():
            hidden = model(full, output_hidden_states=True, use_cache=False).hidden_states
            phi = last[0][0, L:].square().sum()
            grads = torch.autograd.grad(phi, outputs)
        for h in hooks:
            h.remove()
        angles = torch.arange(n).float()[:, None] * decoder.rotary_emb.inv_freq.float()[None]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        allowed = torch.cat([chunk.visible[0], torch.ones(T, dtype=torch.bool)])[None].repeat(T, 1)
        allowed[:, L:] &= torch.ones(T, T, dtype=torch.bool).tril()
        with torch.no_grad():
            for layer_idx, layer in enumerate(decoder.layers):
                attn = layer.self_attn
                x = layer.input_layernorm(hidden[layer_idx][0])
                q = attn.q_proj(x).view(n, Hq, D).transpose(0, 1)
                k = attn.k_proj(x).view(n, Hkv, D).transpose(0, 1)
                v = attn.v_proj(x).view(n, Hkv, D).transpose(0, 1)
                q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
                sensitivity = grads[layer_idx][0, L:].norm(dim=-1)  # [T]
                for h in range(Hkv):
                    for g in range(G):
                        head = h * G + g
                        probs = ((q[head, L:] @ k[h].T) / D**0.5).masked_fill(~allowed, float("-inf")).softmax(-1)
                        w_o = attn.o_proj.weight[:, head * D:(head + 1) * D]
                        s = probs[:, :L] * (v[h, :L] @ w_o.T).norm(dim=-1)[None] * sensitivity[:, None]
                        totals[layer_idx][h] = torch.maximum(totals[layer_idx][h], s.amax(0) * chunk.scored[0])
    return totals


def _dense_cache(model, ids):
    return output_cache(model(ids, use_cache=True, **{cache_kwarg(model): DynamicCache(config=model.config)}))


def test_pass_scores_match_the_formula_on_a_model():
    model = build_model("llama", seed=5)
    ids = torch.randint(5, 100, (1, 40), generator=torch.Generator().manual_seed(2))
    scorer = KVgrad(chunk=24)  # two passes: the second sees the sinks and quotes the first
    cache = _dense_cache(model, ids)
    held = [(layer.keys, layer.values) for layer in cache.layers]
    got = model_pass_scores(model, scorer, cache, ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([40]))
    assert cache.get_seq_length() == 40
    assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, held))  # left as it was
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # frozen for the pass only
    want = _formula_scores(model, ids, scorer)
    for layer_idx, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a[0], b, rtol=1e-4, atol=1e-7, msg=f"layer {layer_idx}")
        assert (a[0] > 0).all()  # every entry scored by a pass
    kvzip = model_pass_scores(model, KVzip(chunk=24), cache, ids, torch.ones_like(ids, dtype=torch.bool),
                              torch.tensor([40]))
    assert not torch.allclose(got[1], kvzip[1])  # the gradient and ||W_O v|| change KVzip's scores


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # a hybrid family: test_presets_run_and_equal_fanout
def test_same_scores_under_inference_mode(arch):
    """Fan-out captures the prefill under torch.inference_mode: the pass leaves it for its backward and finds what it
    finds outside it."""
    model = build_model(arch)
    ids = torch.randint(5, 100, (1, 50), generator=torch.Generator().manual_seed(3))
    scorer = KVgrad(chunk=32)
    cache = _dense_cache(model, ids)
    plain = model_pass_scores(model, scorer, cache, ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([50]))
    with torch.inference_mode():
        prefill = capture_prefill(model, ids)
        fanned = prefill.pass_scores(scorer)
        assert all(c.keys.is_inference() for c in prefill.layers)
    for i in prefill.scope:
        torch.testing.assert_close(fanned[i], plain[i], rtol=1e-4, atol=1e-8)


def test_padded_rows_score_as_alone():
    model = build_model("llama", seed=2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, 100, (2, 45), generator=g)
    mask = torch.ones(2, 45, dtype=torch.bool)
    ids[1, :9], mask[1, :9] = 0, False
    scorer = KVgrad(chunk=20)
    with torch.inference_mode():
        batch = capture_prefill(model, ids, mask.long()).pass_scores(scorer)
        alone = capture_prefill(model, ids[1:, 9:]).pass_scores(scorer)
    for a, b in zip(batch, alone):
        torch.testing.assert_close(a[1:, :, 9:], b, rtol=1e-3, atol=1e-8)


def test_pass_scores_need_the_gradient_inputs():
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, T, L, D = 1, 2, 2, 5, 7, 4
    chunk = PassChunk(ids=torch.zeros(B, T, dtype=torch.long), mask=torch.ones(B, T, dtype=torch.bool),
                      scored=torch.ones(B, L, dtype=torch.bool), visible=torch.ones(B, L, dtype=torch.bool))
    query, key = torch.randn(B, Hkv * G, T, D, generator=g), torch.randn(B, Hkv, L + T, D, generator=g)
    value, weight = torch.randn(B, Hkv, L + T, D, generator=g), torch.randn(8, Hkv * G * D, generator=g)
    with pytest.raises(ValueError, match="output_grad_norm"):
        KVgrad().pass_scores(query, key, chunk, 0.5, value=value, output_weight=weight)
    grad = torch.tensor([[0.5, 2.0, 0.0, 1.5, 3.0]])  # a zero gradient: that query scores nothing
    got = KVgrad().pass_scores(query, key, chunk, 0.5, value=value, output_weight=weight, output_grad_norm=grad)
    # KVzip+ divides by ||h_p||: with ||h_p|| = 1 / ||grad_p|| it multiplies by the gradient's norm
    plus = KVzip(plus=True).pass_scores(query, key, chunk, 0.5, value=value, output_weight=weight,
                                        hidden_norm=1.0 / grad)
    torch.testing.assert_close(got, plus)
    assert (got > 0).all() and not torch.allclose(got, KVgrad().pass_scores(
        query, key, chunk, 0.5, value=value, output_weight=weight, output_grad_norm=torch.ones(B, T)))
    assert KVgrad().chunk == 512 and KVgrad.pass_needs_gradients and not KVzip.pass_needs_gradients


def test_refused_where_no_backward_can_run():
    with torch.inference_mode():
        frozen = build_model("llama")
    with pytest.raises(ValueError, match="inference_mode") as err:
        check_press(preset("kvgrad", compression_ratio=0.5), frozen)
    assert "\n" not in str(err.value)
    check_press(preset("kvzip", compression_ratio=0.5), frozen)  # no backward: served
    split = build_model("llama")
    split._tp_size = 2  # as transformers marks a model loaded with a tp_plan (attention split or not)
    with pytest.raises(ValueError, match="tensor-parallel"):
        check_gradient_pass(split, KVgrad())
    check_gradient_pass(split, KVzip())  # no backward: nothing to refuse
    with pytest.raises(ValueError, match="model pass"):
        Pipeline(scorer=KVgrad(), compression_ratio=0.5, prefill_chunk=16)
    with pytest.raises(ValueError, match="model pass"):
        preset("kvgrad", compression_ratio=0.5).replace(decode_budget=32, decode_interval=4)
    from kvpress_ada.serving.requests import check_servable

    with pytest.raises(ValueError, match="model pass"):
        check_servable(preset("kvgrad", compression_ratio=0.5))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_presets_run_and_equal_fanout(arch):
    """``with press(model)`` (autograd allowed) and fan-out (under torch.inference_mode) keep the same entries."""
    model = build_model(arch)
    press = preset("kvgrad", compression_ratio=0.5)
    kvzip = preset("kvzip", compression_ratio=0.5)
    assert press.scorer == KVgrad() and (press.layers, press.allocator) == (kvzip.layers, kvzip.allocator)
    ada = preset("ada_kvgrad", compression_ratio=0.5)
    assert ada.scorer == KVgrad() and ada.allocator.alpha == 0.2 and ada.layers.alpha == 0.2
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    ids = torch.randint(5, 100, (2, 60), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 60, dtype=torch.long)
    ids[1, :7], mask[1, :7] = 0, 0
    with torch.no_grad(), press(model):
        out = model(ids, attention_mask=mask)
    cache = output_cache(out)
    assert cache.get_seq_length() == 60
    H, scope = model.config.num_key_value_heads, cache.compressed_layers()
    kept = torch.stack([cache.head_lengths(i).sum(-1) for i in scope], 1).sum(-1)
    assert torch.equal(kept, len(scope) * H * torch.round(0.5 * mask.sum(-1).double()).long())
    with torch.inference_mode():
        prefill = capture_prefill(model, ids, mask)
        fanned = prefill.compressed_cache(press)
        for i in scope:
            assert torch.equal(fanned.head_lengths(i), cache.head_lengths(i))
        assert any(not torch.equal(a, b) for a, b in zip(prefill.keep_masks(press), prefill.keep_masks(kvzip)))
