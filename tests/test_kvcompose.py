"""KVCompose: the second reading's scores against the formula written out, the composite-token layer schedule
against its definition, and the press through its entry points (forward, fan-out, batch rows as alone)."""

import math

import pytest
import torch
from conftest import build_model

from kvpress_ada import Observation, Pipeline, preset
from kvpress_ada.allocators import CompositeLayer, UniformHead
from kvpress_ada.allocators.composite import composite_scores
from kvpress_ada.evictors import Mask
from kvpress_ada.hosts.transformers import model_pass
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.scorers import KVCompose, PassChunk


def _attention(query, key, b, hq, t, j, G, visible, pass_mask, L, scaling):
    """Softmax weight of pass token ``t`` of query head ``hq`` on context entry ``j`` (over the visible context and
    the pass's valid tokens up to ``t``)."""
    cols = [c for c in range(L) if visible[b, c]] + [L + u for u in range(t + 1) if pass_mask[b, u]]
    q = query[b, hq, t].double()
    logit = {c: float(q @ key[b, hq // G, c].double()) * scaling for c in cols}
    top = max(logit.values())
    z = sum(math.exp(v - top) for v in logit.values())
    return math.exp(logit[j] - top) / z if j in logit else 0.0


@pytest.mark.parametrize("agg_task", ["max", "mean"])
@pytest.mark.parametrize("agg_group", ["max", "mean"])
def test_pass_scores_match_the_formula_written_out(agg_task, agg_group):
    g = torch.Generator().manual_seed(1)
    B, Hkv, G, T, L, D = 2, 2, 3, 6, 6, 4
    query = torch.randn(B, Hkv * G, T, D, generator=g)
    key = torch.randn(B, Hkv, L + T, D, generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, :2] = False  # row 1: left padding, in the context and in its pass (the context read again)
    chunk = KVCompose().pass_chunks(torch.zeros(B, L, dtype=torch.long), mask, None)[0]
    assert torch.equal(chunk.mask, mask) and chunk.whole_context
    scaling = 0.6
    got = KVCompose(agg_task=agg_task, agg_group=agg_group).pass_scores(query, key, chunk, scaling)
    task = max if agg_task == "max" else (lambda xs: sum(xs) / len(xs))
    group = max if agg_group == "max" else (lambda xs: sum(xs) / len(xs))
    for b in range(B):
        voting = [t for t in range(T) if mask[b, t]]
        for h in range(Hkv):
            for j in range(L):
                if not mask[b, j]:
                    assert float(got[b, h, j]) == 0.0
                    continue
                per_head = [task([_attention(query, key, b, h * G + gq, t, j, G, mask, mask, L, scaling)
                                  for t in voting]) for gq in range(G)]
                want = group(per_head)
                assert abs(float(got[b, h, j]) - want) < 1e-5, (b, h, j, float(got[b, h, j]), want)


def test_mean_from_the_callers_lse_equals_the_computed_one():
    from kvpress_ada.kernels.model_pass.lse_attention import attention_with_lse

    g = torch.Generator().manual_seed(2)
    B, Hkv, G, T, L, D = 2, 1, 2, 5, 5, 3
    query = torch.randn(B, Hkv * G, T, D, generator=g)
    key = torch.randn(B, Hkv, L + T, D, generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :1] = False
    chunk = PassChunk(ids=torch.zeros(B, T, dtype=torch.long), mask=mask, scored=mask, visible=mask,
                      whole_context=True)
    allowed = torch.cat([mask[:, None, :].expand(B, T, L),
                         torch.ones(T, T, dtype=torch.bool).tril()[None] & mask[:, None, :]], -1)[:, None]
    lse = attention_with_lse(query, key, key, allowed, 0.5)[1]
    scorer = KVCompose(agg_task="mean")
    torch.testing.assert_close(scorer.pass_scores(query, key, chunk, 0.5, lse=lse),
                               scorer.pass_scores(query, key, chunk, 0.5))


@pytest.mark.parametrize("add_v_norm", [False, True])
@pytest.mark.parametrize("add_mean", [False, True])
def test_score_adds_the_layers_head_mean_and_value_norm(add_v_norm, add_mean):
    g = torch.Generator().manual_seed(3)
    B, H, L, D = 2, 3, 7, 4
    measured = torch.rand(B, H, L, generator=g)
    values = torch.randn(B, H, L, D, generator=g)
    obs = Observation(keys=torch.randn(B, H, L, D, generator=g), values=values, queries=torch.zeros(B, H, 0, D),
                      key_mask=torch.ones(B, L, dtype=torch.bool), layer_idx=0, n_layers=1, scaling=0.5,
                      pass_scores=measured)
    got = KVCompose(add_v_norm=add_v_norm, add_mean_across_heads=add_mean).score(obs)
    for b in range(B):
        for j in range(L):
            s = [float(measured[b, h, j]) * (float(values[b, h, j].norm()) if add_v_norm else 1.0) for h in range(H)]
            mean = sum(s) / H
            for h in range(H):
                assert abs(float(got[b, h, j]) - (s[h] + (mean if add_mean else 0.0))) < 1e-5


def _composite_written_out(scores):
    """[B][n][L] mean over heads of each head's r-th best finite score (row b, layer l, rank r)."""
    B, n, H, L = scores.shape
    out = []
    for b in range(B):
        layers = []
        for layer in range(n):
            ranked = [sorted((float(x) for x in scores[b, layer, h] if x != -math.inf), reverse=True)
                      for h in range(H)]
            layers.append([sum(r[i] for r in ranked if i < len(r)) / max(1, sum(i < len(r) for r in ranked))
                           if any(i < len(r) for r in ranked) else -math.inf for i in range(L)])
        out.append(layers)
    return out


@pytest.mark.parametrize("first_layer_max", [False, True])
def test_composite_layer_budgets_match_their_definition(first_layer_max):
    g = torch.Generator().manual_seed(4)
    B, n, H, L = 2, 4, 3, 10
    scores = torch.rand(B, n, H, L, generator=g) * (1 + torch.rand(1, n, 1, 1, generator=g))
    scores[1, :, :, :3] = -math.inf  # row 1: 7 valid tokens
    lengths = torch.tensor([L, L - 3])
    avg = torch.tensor([4, 3])
    composite = _composite_written_out(scores)
    torch.testing.assert_close(composite_scores(scores), torch.tensor(composite, dtype=torch.float64))
    budgets = CompositeLayer(first_layer_max=first_layer_max).layer_budgets(list(scores.unbind(1)), avg, lengths)
    for b in range(B):
        table = [row[:] for row in composite[b]]
        if first_layer_max:
            table[0] = [max(table[layer][r] for layer in range(n)) for r in range(L)]
        # ties (layer 0's maxima equal another layer's scores) go to the lower rank, then the lower layer
        flat = sorted((-v, r, layer) for layer in range(n) for r, v in enumerate(table[layer]) if v != -math.inf)
        won = [0] * n
        for _, _, layer in flat[:n * int(avg[b])]:
            won[layer] += 1
        assert min(won) >= 1  # no layer below the floor of one entry per head (which would lift it)
        assert budgets[b].tolist() == won, (b, budgets[b].tolist(), won)
        assert int(budgets[b].sum()) == n * int(avg[b])
    if first_layer_max:
        assert (budgets[:, 0] >= budgets.amax(-1)).all()


def test_composite_layer_floor_and_protected_entries():
    scores = torch.zeros(1, 3, 2, 8)
    scores[0, 0] = 5.0  # layer 0 wins every composite token it can
    scores[0, 1] = -1.0  # layer 1 wins none
    scores[0, 2, :, -2:] = math.inf  # layer 2 protects two entries per head
    budgets = CompositeLayer(first_layer_max=False).layer_budgets(list(scores.unbind(1)), torch.tensor([4]),
                                                                  torch.tensor([8]))
    # won [8, 0, 4]; layer 1 lifted to one entry per head, paid by the surplus above the floors [1, 1, 2]
    # (7 and 2, scaled by 8 / 9): [7.2, 1, 3.8] rounded
    assert budgets.tolist() == [[7, 1, 4]]
    floored = CompositeLayer(first_layer_max=False, floor=3).layer_budgets(list(scores.unbind(1)), torch.tensor([4]),
                                                                          torch.tensor([8]))
    assert floored.tolist()[0][1] >= 3 and int(floored.sum()) == 12


def test_kvcompose_press_equals_fanout_and_mask_and_keeps_structure():
    model = build_model("llama")
    model_pass._TOKENIZERS.pop(model, None)  # the pass re-reads the context's ids: no tokenizer needed
    ids = torch.randint(5, 100, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    ids[1, :7] = 0
    press = preset("kvcompose", compression_ratio=0.5)
    assert isinstance(press.layers, CompositeLayer) and isinstance(press.allocator, UniformHead)
    with torch.no_grad(), press(model):
        out = model(input_ids=ids, attention_mask=mask)
    cache = output_cache(out)
    assert cache.get_seq_length() == 40  # the second reading was cropped off
    reference = model(input_ids=ids, attention_mask=mask)
    assert torch.allclose(out.logits, reference.logits, atol=1e-5)
    H = model.config.num_key_value_heads
    lengths = torch.stack([cache.head_lengths(i) for i in range(3)], 1)  # [B, layers, H]
    assert (lengths == lengths[..., :1]).all()  # structured: every kv head of a layer keeps the same count
    assert torch.equal(lengths.sum((1, 2)), 3 * H * torch.round(0.5 * mask.sum(-1).double()).long())
    prefill = capture_prefill(model, ids, mask)
    fanned = prefill.compressed_cache(press)
    masked = prefill.keep_masks(press.replace(evictor=Mask()))
    for i in range(3):
        assert torch.equal(fanned.head_lengths(i), cache.head_lengths(i))
        assert torch.equal(masked[i].sum(-1), cache.head_lengths(i))
    alone = capture_prefill(model, ids[1:, 7:]).keep_masks(press)
    for i in range(3):
        assert torch.equal(prefill.keep_masks(press)[i][1][:, 7:], alone[i][0])


def test_kvcompose_refuses_chunked_prefill_and_decode():
    with pytest.raises(ValueError, match="model pass"):
        Pipeline(scorer=KVCompose(), compression_ratio=0.5, prefill_chunk=16)
    with pytest.raises(ValueError, match="model pass"):
        Pipeline(scorer=KVCompose(), compression_ratio=0.5, decode_budget=8, decode_interval=4)
