"""Model-scope allocation: AdaLayer (hypothesis properties) and the global top-k it generalises."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import AdaHead, AdaLayer, Pipeline, SnapKV, UniformHead, UniformLayer
from kvpress_ada.allocators import LAYER_SCHEDULES, PyramidLayer, model_topk_counts
from kvpress_ada.allocators.model_scope import layer_floors

SETTINGS = settings(max_examples=60, deadline=None)
INF = float("inf")


@st.composite
def model_scores(draw, protect=True, ties=True, padding=True):
    """``(scores: list of [B, H, L] per layer, avg [B], lengths [B], protected_same_everywhere)``.

    Padding (``-inf``) sits at random positions of each row, the same in every layer and head (it is
    the row's missing tokens); protected (``+inf``) entries are either the same valid positions in
    every layer and head (an observation window) or drawn per (layer, head, position).
    """
    B = draw(st.integers(1, 3))
    n = draw(st.integers(1, 6))
    H = draw(st.integers(1, 4))
    L = draw(st.integers(1, 30))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.tensor([draw(st.integers(1, L)) if padding else L for _ in range(B)])
    avg = torch.tensor([draw(st.integers(1, int(n_))) for n_ in lengths])
    scale = torch.tensor([draw(st.sampled_from([1.0, 1e-3, 100.0])) for _ in range(n)])
    scores = torch.rand(n, B, H, L, generator=g) * scale[:, None, None, None]
    if ties and draw(st.booleans()):
        scores = scores.round(decimals=1)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        valid[b, torch.randperm(L, generator=g)[: int(lengths[b])]] = True
    same = True
    if protect:
        mode = draw(st.sampled_from(["none", "window", "random"]))
        if mode == "window":  # the last w valid tokens of each row, in every layer and head
            w = draw(st.integers(1, 8))
            rank = valid.long().cumsum(-1)
            window = valid & (rank > lengths[:, None] - w)
            scores = scores.masked_fill(window[None, :, None, :], INF)
        elif mode == "random":
            same = False
            p = draw(st.sampled_from([0.05, 0.3]))
            scores = scores.masked_fill(torch.rand(scores.shape, generator=g) < p, INF)
    scores = scores.masked_fill(~valid[None, :, None, :], -INF)
    return list(scores.unbind(0)), avg, lengths, same


def _need(scores, lengths):
    return torch.minimum(torch.stack([torch.isposinf(s).sum(-1).amax(-1) for s in scores], 1).clamp(min=1),
                         lengths[:, None])


@SETTINGS
@given(model_scores(), st.floats(0, 1), st.booleans())
def test_totals_exact_and_bounds(data, alpha, comparable):
    scores, avg, lengths, _ = data
    n = len(scores)
    budgets = AdaLayer(alpha=alpha).layer_budgets(scores, avg, lengths, comparable=comparable)
    assert budgets.shape == (avg.shape[0], n) and budgets.dtype == torch.long
    assert torch.equal(budgets.sum(-1), n * avg)
    assert bool((budgets >= 1).all()) and bool((budgets <= lengths[:, None]).all())
    # floor: every protected entry fits even under UniformHead when the floors fit the total,
    # otherwise at least the uniform share of it
    need = _need(scores, lengths)
    fits = need.sum(-1) <= n * avg
    floor = torch.where(fits[:, None], need, torch.minimum(need, avg[:, None]))
    assert torch.equal(floor, layer_floors(torch.stack(scores, 1), avg, lengths))
    assert bool((budgets >= floor).all())


@SETTINGS
@given(model_scores(), st.booleans())
def test_alpha_one_is_uniform_layer(data, comparable):
    """alpha=1 is UniformLayer whenever the floors allow it: always when every layer protects the same
    tokens (a window, sinks); a layer with more protected tokens than the average may be lifted."""
    scores, avg, lengths, same = data
    n = len(scores)
    budgets = AdaLayer(alpha=1.0).layer_budgets(scores, avg, lengths, comparable=comparable)
    uniform = UniformLayer().budgets(avg, n, lengths)
    floor = layer_floors(torch.stack(scores, 1), avg, lengths)
    lifted = (floor > avg[:, None]).any(-1)
    assert not bool(lifted.any()) or not same
    assert torch.equal(budgets[~lifted], uniform[~lifted])


def test_floor_lifts_a_layer_with_more_protected_tokens():
    """alpha=1, layer 0 protects 6 tokens per head, the average is 4: layer 0 keeps its 6, the others pay."""
    scores = [torch.rand(1, 2, 20) for _ in range(3)]
    scores[0][..., :6] = INF
    budgets = AdaLayer(alpha=1.0).layer_budgets(scores, torch.tensor([4]), torch.tensor([20]))
    assert budgets.tolist() == [[6, 3, 3]]
    # the floors do not fit (3 layers x 6 > 3 x 4): each layer keeps at least the average
    scores = [s.clone().fill_(INF) for s in scores]
    budgets = AdaLayer(alpha=0.0).layer_budgets(scores, torch.tensor([4]), torch.tensor([20]))
    assert budgets.tolist() == [[4, 4, 4]]


@SETTINGS
@given(model_scores(protect=False, ties=False), st.floats(0, 1), st.booleans(), st.integers(0, 2**31 - 1))
def test_invariant_to_layer_permutation(data, alpha, comparable, seed):
    scores, avg, lengths, _ = data
    n = len(scores)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    budgets = AdaLayer(alpha=alpha).layer_budgets(scores, avg, lengths, comparable=comparable)
    permuted = AdaLayer(alpha=alpha).layer_budgets([scores[int(i)] for i in perm], avg, lengths,
                                                  comparable=comparable)
    assert torch.equal(permuted.sort(-1).values, budgets[:, perm].sort(-1).values)
    if comparable:  # layers whose adaptive share is unique map exactly (equal ones may swap a rounding unit)
        won = model_topk_counts(scores, n * scores[0].shape[1] * avg).sum(-1)
        for b in range(avg.shape[0]):
            if len(set(won[b].tolist())) == n:
                assert torch.equal(permuted[b], budgets[b, perm])


@SETTINGS
@given(model_scores(), st.floats(0, 1), st.data())
def test_scale_free_when_not_comparable(data, alpha, draw):
    """comparable=False: multiplying one layer's scores by a positive factor changes nothing (powers of
    two, so the shares are bit-identical; other factors agree up to float rounding of near-ties)."""
    scores, avg, lengths, _ = data
    j = draw.draw(st.integers(0, len(scores) - 1))
    factor = 2.0 ** draw.draw(st.integers(-20, 20))
    scaled = [s * factor if i == j else s for i, s in enumerate(scores)]
    a = AdaLayer(alpha=alpha).layer_budgets(scores, avg, lengths, comparable=False)
    b = AdaLayer(alpha=alpha).layer_budgets(scaled, avg, lengths, comparable=False)
    assert torch.equal(a, b)


def test_scale_free_with_a_large_factor():
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(2, 4, 50, generator=g) ** (i + 1) for i in range(5)]
    avg, lengths = torch.tensor([10, 20]), torch.tensor([50, 50])
    a = AdaLayer(alpha=0.1).layer_budgets(scores, avg, lengths, comparable=False)
    scores[2] = scores[2] * 1000.0
    b = AdaLayer(alpha=0.1).layer_budgets(scores, avg, lengths, comparable=False)
    assert torch.equal(a, b)
    c = AdaLayer(alpha=0.1).layer_budgets(scores, avg, lengths, comparable=True)
    assert bool((c[:, 2] > b[:, 2]).all())  # comparable: the scaled layer wins most of the top-k


@pytest.mark.parametrize("comparable", [True, False])
def test_concentrated_layer_gets_less_than_a_flat_one(comparable):
    """A layer whose mass is concentrated on a few tokens needs fewer than one whose mass is spread."""
    L, H = 100, 2
    peaked = torch.zeros(L)
    peaked[:5] = 1.0
    flat = 0.5 + torch.rand(L, generator=torch.Generator().manual_seed(0))  # spread, not constant
    layer_peaked = (peaked / peaked.sum()).expand(1, H, L).clone()
    layer_flat = (flat / flat.sum()).expand(1, H, L).clone()
    budgets = AdaLayer(alpha=0.0).layer_budgets([layer_peaked, layer_flat], torch.tensor([20]),
                                                torch.tensor([L]), comparable=comparable)
    assert budgets[0, 0] < budgets[0, 1]
    assert int(budgets.sum()) == 40
    budgets = AdaLayer(alpha=0.5).layer_budgets([layer_peaked, layer_flat], torch.tensor([20]),
                                                torch.tensor([L]), comparable=comparable)
    assert 10 <= int(budgets[0, 0]) < int(budgets[0, 1])  # the safeguard keeps half the uniform share


def test_constant_heads_carry_no_preference():
    """comparable=False: a layer whose heads are all constant keeps exactly its uniform share."""
    g = torch.Generator().manual_seed(1)
    scores = [torch.full((1, 2, 30), 0.7), torch.rand(1, 2, 30, generator=g), torch.rand(1, 2, 30, generator=g) ** 4]
    budgets = AdaLayer(alpha=0.0).layer_budgets(scores, torch.tensor([8]), torch.tensor([30]), comparable=False)
    assert int(budgets[0, 0]) == 8 and int(budgets.sum()) == 24


@SETTINGS
@given(model_scores(padding=False), st.floats(0, 1), st.booleans(), st.data())
def test_padding_never_counted(data, alpha, comparable, draw):
    """Adding -inf padding columns (anywhere) changes nothing, and a row of a padded batch gets
    exactly what it gets alone."""
    scores, avg, lengths, _ = data
    B, H, L = scores[0].shape
    extra = draw.draw(st.integers(1, 10))
    where = torch.randperm(L + extra, generator=torch.Generator().manual_seed(draw.draw(st.integers(0, 1000))))
    real = where[:L].sort().values
    padded = []
    for s in scores:
        p = torch.full((B, H, L + extra), -INF)
        p[..., real] = s
        padded.append(p)
    ada = AdaLayer(alpha=alpha)
    alone = ada.layer_budgets(scores, avg, lengths, comparable=comparable)
    assert torch.equal(ada.layer_budgets(padded, avg, lengths, comparable=comparable), alone)
    # padding never enters the global top-k either
    counts = model_topk_counts(padded, len(scores) * H * avg)
    assert torch.equal(counts, model_topk_counts(scores, len(scores) * H * avg))
    # batch: row 0 of (this row, a longer one) equals row 0 alone
    other = [torch.cat([p[:1], torch.rand(1, H, L + extra)], 0) for p in padded]
    both = ada.layer_budgets(other, torch.cat([avg[:1], avg[:1]]), torch.tensor([int(lengths[0]), L + extra]),
                             comparable=comparable)
    assert torch.equal(both[0], alone[0])


@st.composite
def global_topk_case(draw):
    """Scores whose global top-k gives every layer a whole number ``m_l >= 1`` of tokens per head:
    layer ``l``'s ``H * m_l`` "high" entries (random heads and positions) score in (1, 2), the rest in
    (0, 1), padding -inf. Continuous scores: ties have probability 0."""
    B = draw(st.integers(1, 3))
    n = draw(st.integers(1, 6))
    H = draw(st.integers(1, 4))
    L = draw(st.integers(1, 30))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.tensor([draw(st.integers(1, L)) for _ in range(B)])
    avg = torch.tensor([draw(st.integers(1, int(x))) for x in lengths])
    scores = torch.rand(n, B, H, L, generator=g, dtype=torch.float64)
    m = torch.ones(B, n, dtype=torch.long)
    for b in range(B):
        for _ in range(n * int(avg[b]) - n):  # hand the remaining units to random layers with room
            room = (m[b] < lengths[b]).nonzero().flatten()
            m[b, room[torch.randint(len(room), (1,), generator=g)]] += 1
        for layer in range(n):
            valid = torch.randperm(L, generator=g)[: int(lengths[b])]
            pad = torch.ones(L, dtype=torch.bool)
            pad[valid] = False
            scores[layer, b][:, pad] = -INF
            cells = torch.randperm(H * int(lengths[b]), generator=g)[: H * int(m[b, layer])]
            heads, pos = cells // int(lengths[b]), valid[cells % int(lengths[b])]
            scores[layer, b, heads, pos] += 1.0
    return list(scores.unbind(0)), avg, lengths, m


@SETTINGS
@given(global_topk_case())
def test_ada_layer_then_ada_head_at_alpha_zero_is_the_global_topk(data):
    """AdaLayer(0) then AdaHead(0) within each layer keeps, per (layer, head), exactly the counts of one
    top-k over all layers and heads (KVzip's default) when each layer's share is a whole number per head."""
    scores, avg, lengths, m = data
    n, H = len(scores), scores[0].shape[1]
    budgets = AdaLayer(alpha=0.0).layer_budgets(scores, avg, lengths)
    assert torch.equal(budgets, m)
    per_head = torch.stack([AdaHead(alpha=0.0).allocate(s, budgets[:, i]) for i, s in enumerate(scores)], 1)
    assert torch.equal(per_head, model_topk_counts(scores, n * H * avg))


@SETTINGS
@given(model_scores(protect=False, ties=False))
def test_alpha_zero_layer_totals_track_the_global_topk(data):
    """In general a layer's total differs from its global top-k count by less than H (per-head rounding),
    as long as no layer needs its floor."""
    scores, avg, lengths, _ = data
    n, H = len(scores), scores[0].shape[1]
    won = model_topk_counts(scores, n * H * avg).sum(-1)
    budgets = AdaLayer(alpha=0.0).layer_budgets(scores, avg, lengths)
    ok = (won >= H).all(-1)
    assert bool(((H * budgets - won).abs() < H)[ok].all())


def test_model_topk_counts_small_case():
    s0 = torch.tensor([[[0.9, 0.1], [0.8, 0.2]]])
    s1 = torch.tensor([[[0.7, 0.3], [0.95, -INF]]])
    counts = model_topk_counts([s0, s1], torch.tensor([3]))
    assert counts.tolist() == [[[1, 1], [0, 1]]]  # 0.95, 0.9, 0.8


def test_budgets_without_scores_raise_a_clear_error():
    ada = AdaLayer()
    assert ada.needs_all_layers and not UniformLayer.needs_all_layers and not PyramidLayer().needs_all_layers
    with pytest.raises(NotImplementedError, match="every layer's scores.*layer_budgets"):
        ada.budgets(torch.tensor([4]), 3, torch.tensor([10]))
    with pytest.raises(NotImplementedError, match="end of prefill"):
        ada.layer_budget(torch.tensor([4]), 0, 3, torch.tensor([10]))


def test_pipeline_round_trips_through_json():
    p = Pipeline(scorer=SnapKV(), allocator=AdaHead(alpha=0.1), layers=AdaLayer(alpha=0.3), compression_ratio=0.5)
    assert Pipeline.model_validate_json(p.model_dump_json()) == p
    assert isinstance(Pipeline.model_validate_json(p.model_dump_json()).layers, AdaLayer)
    q = Pipeline(scorer="snapkv", allocator=UniformHead(), layers="ada_layer", budget=8)
    assert q.layers == AdaLayer() and LAYER_SCHEDULES.get("ada_layer") is AdaLayer
    assert Pipeline.model_validate_json(q.model_dump_json()) == q
    with pytest.raises(ValueError):
        AdaLayer(alpha=1.5)



@pytest.mark.parametrize("comparable", [True, False])
def test_layer_budgets_compile_without_graph_breaks(comparable):
    ada = AdaLayer(alpha=0.2)

    def run(stacked, avg, lengths):
        return ada.layer_budgets(list(stacked.unbind(0)), avg, lengths, comparable=comparable)

    stacked = torch.rand(4, 2, 3, 20, generator=torch.Generator().manual_seed(0))
    stacked[..., -2:] = INF
    stacked[:, 1, :, :3] = -INF  # row 1: 3 padding tokens in every layer
    avg, lengths = torch.tensor([5, 7]), torch.tensor([20, 17])
    compiled = torch.compile(run, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(stacked, avg, lengths), run(stacked, avg, lengths))
