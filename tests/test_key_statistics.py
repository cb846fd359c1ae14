"""Key-statistics scorers (leverage, CUR, non-causal attention, Compactor, Q-filters, CAP) against their
formulas, recomputed independently in float64 with explicit loops on tiny left-padded batches, plus the
invariants each formula promises."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

from kvpress_ada import Observation
from kvpress_ada.scorers import CAP, CUR, Compactor, Leverage, NonCausalAttention, QFilter
from kvpress_ada.scorers.statistics import gaussian_sketch, row_zscore

RTOL, ATOL = 1e-4, 1e-5


def _inv_freq(D, base=10000.0):
    return [1.0 / base ** (2 * i / D) for i in range(D // 2)]


def _setup(seed, B=2, Hkv=2, G=2, L=14, D=8, pads=(0, 3)):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, Hkv, L, D, generator=g)
    values = torch.randn(B, Hkv, L, D, generator=g)
    queries = torch.randn(B, Hkv * G, L, D, generator=g)
    key_mask = torch.ones(B, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        key_mask[b, :p] = False
    return keys, values, queries, key_mask


def _obs(keys, values, queries, key_mask, positions=None):
    D = keys.shape[-1]
    return Observation(keys=keys, values=values, queries=queries, key_mask=key_mask, layer_idx=0, n_layers=1,
                       scaling=D**-0.5, rope_inv_freq=torch.tensor(_inv_freq(D)), positions=positions)


def _rotate(vec, pos, D, sign=1.0):
    """RoPE (half-split) of one vector at position ``pos`` written out pair by pair (``sign=-1``: undo it)."""
    half = D // 2
    out = list(vec)
    for i, f in enumerate(_inv_freq(D)):
        a = sign * pos * f
        x, y = vec[i], vec[i + half]
        out[i], out[i + half] = x * math.cos(a) - y * math.sin(a), y * math.cos(a) + x * math.sin(a)
    return out


def _leverage_ref(K, ridge, phi=None):
    """Ridge leverage of the rows of ``K`` (list of vectors): centre, sketch, ``x^T (X^T X + ridge I)^-1 x``."""
    X = torch.tensor(K, dtype=torch.float64)
    X = X - X.mean(dim=0, keepdim=True)
    if phi is not None:
        X = X @ phi.double()
    gram = X.T @ X + ridge * torch.eye(X.shape[1], dtype=torch.float64)
    inv = torch.linalg.inv(gram)
    return [max(0.0, float(x @ inv @ x)) for x in X]


# ----------------------------------------------------------------------------- leverage
@pytest.mark.parametrize("sketch", [None, 6, 48])
@pytest.mark.parametrize("seed", [0, 1])
def test_leverage_formula(seed, sketch):
    keys, values, queries, key_mask = _setup(seed)
    B, H, L, D = keys.shape
    scorer = Leverage(sketch_dimension=sketch, ridge=1e-2, seed=3)
    got = scorer.score(_obs(keys, values, queries[:, :, :0], key_mask))
    phi = None if sketch is None else gaussian_sketch(D, sketch, 3, "cpu")
    for b in range(B):
        valid = [j for j in range(L) if key_mask[b, j]]
        for h in range(H):
            # the cache holds post-RoPE keys of consecutive tokens: undo RoPE at each token's rank
            pre = [_rotate(keys[b, h, j].double().tolist(), r, D, sign=-1.0) for r, j in enumerate(valid)]
            want = _leverage_ref(pre, 1e-2, phi)
            torch.testing.assert_close(got[b, h, valid].double(), torch.tensor(want, dtype=torch.float64),
                                       rtol=RTOL, atol=ATOL)
            assert bool((got[b, h, ~key_mask[b]] == 0).all())


def test_leverage_reads_pre_rope_keys_at_their_positions():
    """Keys rotated by RoPE at scattered positions (a chunked prefill's kept entries) score as the pre-RoPE
    keys themselves; a common shift of every position changes nothing (without a sketch)."""
    g = torch.Generator().manual_seed(5)
    B, H, L, D = 1, 2, 10, 8
    pre = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 3, 9, 14, 15, 30, 31, 32]).expand(B, H, L)
    post = torch.tensor([[[_rotate(pre[0, h, j].tolist(), int(positions[0, h, j]), D) for j in range(L)]
                          for h in range(H)]], dtype=torch.float32)
    mask = torch.ones(B, L, dtype=torch.bool)
    scorer = Leverage(sketch_dimension=None, ridge=1e-4)
    got = scorer.score(_obs(post, post, post[:, :, :0], mask, positions=positions))
    want = torch.tensor([[_leverage_ref(pre[0, h].tolist(), 1e-4) for h in range(H)]], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-4)
    shifted = scorer.score(_obs(post, post, post[:, :, :0], mask, positions=positions + 7))
    torch.testing.assert_close(shifted, got)
    # the positions matter: reading the same keys as consecutive tokens scores them differently
    assert not torch.allclose(scorer.score(_obs(post, post, post[:, :, :0], mask)), got, atol=1e-3)


def test_leverage_scores_sum_to_the_rank_in_every_head():
    """Exact leverage (no sketch, tiny ridge) of n > D centred keys sums to D in each head: one scale for
    every head, what ``comparable_across_heads`` claims."""
    keys, values, queries, key_mask = _setup(2, L=40)
    got = Leverage(sketch_dimension=None, ridge=1e-6).score(_obs(keys, values, queries[:, :, :0], key_mask))
    torch.testing.assert_close(got.sum(-1), torch.full(got.shape[:2], float(keys.shape[-1])), rtol=1e-3, atol=1e-3)
    assert Leverage.comparable_across_heads


def test_row_zscore_is_per_row_over_heads():
    scores = torch.randn(2, 3, 7, dtype=torch.float64)
    mask = torch.ones(2, 3, 7, dtype=torch.bool)
    mask[1, :, :2] = False
    z = row_zscore(scores, mask)
    for b in range(2):
        vals = scores[b][mask[b]]
        torch.testing.assert_close(z[b][mask[b]], ((vals - vals.mean()) / vals.std()).float())
    assert bool((z[~mask] == 0).all())


# ----------------------------------------------------------------------------- CUR
def _cur_ref(K, V, sinks, kind, window):
    """CurDKV's approximate leverage of one (row, head) written out: squared norms, shares of consecutive
    windows of ``window`` tokens (``None``: the norms as they are), combined, shares of the head's total;
    sinks ``inf``."""
    n = len(K)

    def shares(x):
        if window is None:
            return x
        out = []
        for start in range(0, n, window):
            part = x[start:start + window]
            out += [v / sum(part) for v in part]
        return out

    k2 = shares([sum(c * c for c in k) for k in K])
    v2 = shares([sum(c * c for c in v) for v in V])
    combined = {"key": k2, "value": v2, "kv_avg": [(a + b) / 2 for a, b in zip(k2, v2)],
                "kv_product": [a * b for a, b in zip(k2, v2)]}[kind]
    total = sum(combined)
    return [math.inf if j < sinks else c / total for j, c in enumerate(combined)]


@pytest.mark.parametrize("kind", ["key", "value", "kv_avg", "kv_product"])
@pytest.mark.parametrize("window,sinks", [(16, 4), (4, 0), (5, 2), (None, 1)])
def test_cur_formula(kind, window, sinks):
    keys, values, queries, key_mask = _setup(7, L=23, pads=(0, 6))
    got = CUR(leverage_type=kind, local_window=window, sinks=sinks).score(
        _obs(keys, values, queries[:, :, :0], key_mask))
    for b in range(keys.shape[0]):
        valid = [j for j in range(keys.shape[2]) if key_mask[b, j]]
        for h in range(keys.shape[1]):
            want = _cur_ref([keys[b, h, j].double().tolist() for j in valid],
                            [values[b, h, j].double().tolist() for j in valid], sinks, kind, window)
            torch.testing.assert_close(got[b, h, valid].double(), torch.tensor(want, dtype=torch.float64),
                                       rtol=RTOL, atol=1e-7)


def test_cur_shares_sum_to_one_per_head_and_projection_is_seeded():
    keys, values, queries, key_mask = _setup(8, L=30)
    obs = _obs(keys, values, queries[:, :, :0], key_mask)
    scores = CUR(sinks=0).score(obs)
    torch.testing.assert_close(scores.sum(-1), torch.ones(scores.shape[:2]))
    projected = CUR(sinks=0, random_projection=5, seed=1)
    assert torch.equal(projected.score(obs), projected.score(obs))
    assert not torch.allclose(projected.score(obs), CUR(sinks=0, random_projection=5, seed=2).score(obs))


# ----------------------------------------------------------------------------- non-causal attention, Compactor
def _non_causal_ref(Q, K, V, G, chunk):
    """Compactor's attention part for one (row, kv head) over consecutive tokens: per chunk, every query's
    softmax over the chunk's keys (raw dot products), summed over queries, averaged over the ``G`` query heads,
    times ``||v||``, then ``(s[j-1] + s[j] + s[j+1]) / 3`` with zeros past both ends."""
    n = len(K)
    received = [0.0] * n
    for g in range(G):
        for start in range(0, n, chunk):
            idx = range(start, min(start + chunk, n))
            for i in idx:
                logits = [sum(a * b for a, b in zip(Q[g][i], K[j])) for j in idx]
                top = max(logits)
                e = [math.exp(v - top) for v in logits]
                for j, v in zip(idx, e):
                    received[j] += v / sum(e) / G
    s = [r * math.sqrt(sum(c * c for c in v)) for r, v in zip(received, V)]
    return [((s[j - 1] if j else 0.0) + s[j] + (s[j + 1] if j + 1 < n else 0.0)) / 3 for j in range(n)]


def _zscore(rows):
    flat = [v for row in rows for v in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1))
    return [[(v - mean) / std for v in row] for row in rows]


def _head_refs(keys, values, queries, b, h, idx, G, chunk):
    Q = [[queries[b, h * G + g, j].double().tolist() for j in idx] for g in range(G)]
    K = [keys[b, h, j].double().tolist() for j in idx]
    V = [values[b, h, j].double().tolist() for j in idx]
    return _non_causal_ref(Q, K, V, G, chunk)


@pytest.mark.parametrize("chunk", [4, 5, 64])
def test_non_causal_attention_formula(chunk):
    keys, values, queries, key_mask = _setup(11, L=17, pads=(0, 4))
    B, H, L, _ = keys.shape
    G = queries.shape[1] // H
    got = NonCausalAttention(chunk_size=chunk).score(_obs(keys, values, queries, key_mask))
    for b in range(B):
        valid = [j for j in range(L) if key_mask[b, j]]
        want = _zscore([_head_refs(keys, values, queries, b, h, valid, G, chunk) for h in range(H)])
        torch.testing.assert_close(got[b][:, valid].double(), torch.tensor(want, dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL)


def test_non_causal_attention_refuses_a_query_window_and_chunked_prefill():
    keys, values, queries, key_mask = _setup(0)
    with pytest.raises(ValueError, match="query of every entry"):
        NonCausalAttention().score(_obs(keys, values, queries[:, :, -4:], key_mask))
    from kvpress_ada import Pipeline

    for scorer in (NonCausalAttention(), Compactor()):
        with pytest.raises(ValueError, match="chunked prefill"):
            Pipeline(scorer=scorer, compression_ratio=0.5, prefill_chunk=64)
        with pytest.raises(ValueError, match="query_window None"):
            Pipeline(scorer=scorer, decode_budget=64, decode_interval=16)


@pytest.mark.parametrize("blending", [0.0, 0.35, 2.0])
def test_compactor_formula(blending):
    keys, values, queries, key_mask = _setup(12, L=30, pads=(0, 5))
    B, H, L, D = keys.shape
    G = queries.shape[1] // H
    scorer = Compactor(sinks_start=3, sinks_end=2, chunk_size=8, sketch_dimension=None, blending=blending)
    got = scorer.score(_obs(keys, values, queries, key_mask))
    for b in range(B):
        valid = [j for j in range(L) if key_mask[b, j]]
        inner = valid[3:-2]
        # leverage of the inner tokens' pre-RoPE keys (RoPE undone at each token's rank in the row)
        lev = [_leverage_ref([_rotate(keys[b, h, j].double().tolist(), valid.index(j), D, sign=-1.0)
                              for j in inner], 1e-2) for h in range(H)]
        attn = [_head_refs(keys, values, queries, b, h, inner, G, 8) for h in range(H)]
        want = [[blending * x + y for x, y in zip(lh, ah)] for lh, ah in zip(_zscore(lev), _zscore(attn))]
        torch.testing.assert_close(got[b][:, inner].double(), torch.tensor(want, dtype=torch.float64),
                                   rtol=RTOL, atol=1e-4)
        kept = valid[:3] + valid[-2:]
        assert bool(torch.isinf(got[b][:, kept]).all())
    assert scorer.protected(torch.tensor([30, 4])).tolist() == [5, 4]


# ----------------------------------------------------------------------------- Q-filters
def _qfilters_file(tmp_path, model, filters=None):
    """A Q-filters file for ``model``: ``filters`` (``[layers, kv heads, D]``) or made from its documentation."""
    from kvpress_ada.calibration import model_identity
    from kvpress_ada.harness.qfilters import make_qfilters
    from kvpress_ada.qfilters import QFilters, QFiltersMeta, save

    if filters is None:
        made = make_qfilters(model, _tokenizer(), n=2, context=96, samples=60, progress=False)
    else:
        made = QFilters(filters, QFiltersMeta(model=model_identity(model.config), data={}, library_version="test",
                                              created="now"))
    path = tmp_path / "qf.safetensors"
    save(made, path)
    return str(path), made


def _tokenizer():
    from conftest import build_tokenizer

    return build_tokenizer()


def test_principal_filters_point_away_from_the_queries():
    """The filter of a head is minus the principal direction of its queries, oriented towards where most
    queries project (checked against the top eigenvector of ``X^T X``), averaged over the query group."""
    from kvpress_ada.harness.qfilters import principal_filters

    g = torch.Generator().manual_seed(3)
    D, S = 8, 400
    dirs = torch.nn.functional.normalize(torch.randn(4, D, generator=g), dim=-1)
    sign = torch.tensor([1.0, -1.0, 1.0, 1.0])  # head 1's queries sit on the negative side
    queries = (sign[:, None, None] * (3.0 + torch.rand(4, S, 1, generator=g)) * dirs[:, None, :]
               + 0.3 * torch.randn(4, S, D, generator=g))
    got = principal_filters(queries, kv_heads=2)
    want = []
    for h in range(4):
        X = queries[h].double()
        top = torch.linalg.eigh(X.T @ X).eigenvectors[:, -1]
        top = top if (X @ top > 0).double().mean() > 0.5 else -top  # towards most queries
        want.append(-top)
    torch.testing.assert_close(got, torch.stack(want).view(2, 2, D).mean(1).float(), rtol=1e-4, atol=1e-5)
    # and it points against the queries' mean direction in every group
    assert bool((torch.einsum("hd,hsd->hs", got.repeat_interleave(2, 0), queries).mean(-1) < 0).all())


def test_qfilter_formula_per_head_and_offset(tmp_path):
    from conftest import build_model

    model = build_model("llama")
    L, H, D = model.config.num_hidden_layers, model.config.num_key_value_heads, 16
    filters = torch.randn(L, H, D, generator=torch.Generator().manual_seed(4))
    path, _ = _qfilters_file(tmp_path, model, filters)
    keys = torch.randn(2, H, 9, D, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 9, dtype=torch.bool)
    scorer = QFilter(path=path)
    for layer in range(L):
        obs = Observation(keys=keys, values=keys, queries=keys[:, :, :0], key_mask=mask, layer_idx=layer,
                          n_layers=L, scaling=1.0)
        got = scorer.score(obs)
        for b in range(2):
            for h in range(H):
                for j in range(9):
                    want = -sum(float(f) * float(k) for f, k in zip(filters[layer, h], keys[b, h, j]))
                    assert abs(float(got[b, h, j]) - want) < 1e-4
        # one kv head scored alone (chunked prefill after Ada) reads its own filter
        alone = Observation(keys=keys[:, 1:], values=keys[:, 1:], queries=keys[:, :0], key_mask=mask,
                            layer_idx=layer, n_layers=L, scaling=1.0, head_offset=1)
        torch.testing.assert_close(scorer.score(alone), got[:, 1:])


def test_qfilter_made_for_one_model_serves_it_and_refuses_another(tmp_path):
    from conftest import build_model

    from kvpress_ada import Pipeline
    from kvpress_ada.hosts.transformers.fanout import capture_prefill

    model = build_model("llama")
    path, made = _qfilters_file(tmp_path, model)
    assert made.filters.shape == (model.config.num_hidden_layers, model.config.num_key_value_heads, 16)
    assert made.meta.data["samples_per_head"] == 60
    press = Pipeline(scorer=QFilter(path=path), compression_ratio=0.5)
    ids = torch.randint(5, 90, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        kept = capture_prefill(model, ids).keep_masks(press)
    assert all(int(k.sum(-1).min()) == 20 for k in kept)
    with press(model):
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 43)
    other = build_model("qwen2")
    with pytest.raises(ValueError, match="kvpress-ada qfilters") as err:
        press.check_config(other.config)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="kvpress-ada qfilters"):  # the default model's filters on a tiny model
        Pipeline(scorer=QFilter(), compression_ratio=0.5).check_config(model.config)


def test_qfilter_on_a_padded_batch_ragged_matches_mask_and_rows_score_alone(tmp_path):
    from conftest import build_model, left_padded_batch

    from kvpress_ada import Pipeline

    model = build_model("llama")
    path, _ = _qfilters_file(tmp_path, model, torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(6)))
    ids, mask = left_padded_batch(seed=3)
    outs = {}
    for evictor in ("topk", "mask"):
        with Pipeline(scorer=QFilter(path=path), evictor=evictor, compression_ratio=0.5)(model):
            outs[evictor] = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                           output_scores=True, return_dict_in_generate=True)
    assert torch.equal(outs["topk"].sequences, outs["mask"].sequences)
    keys, values, queries, key_mask = _setup(9, D=16, pads=(0, 4))
    scorer = QFilter(path=path)
    padded = scorer.score(_obs(keys, values, queries[:, :, :0], key_mask))
    alone = scorer.score(_obs(keys[1:, :, 4:], values[1:, :, 4:], queries[1:, :, :0], key_mask[1:, 4:]))
    torch.testing.assert_close(padded[1:, :, 4:], alone)


def test_qfilters_command_writes_filters_the_scorer_accepts(tmp_path, monkeypatch, capsys):
    from conftest import build_model

    import kvpress_ada.harness.cli as cli
    from kvpress_ada import qfilters

    model, loads = build_model("llama"), []
    monkeypatch.setattr(cli, "_load_model", lambda name: loads.append(name) or (model, _tokenizer()))
    assert cli.main(["qfilters", "--model", "tiny", "--n", "0"]) == 2
    assert capsys.readouterr().err.strip() == "kvpress-ada qfilters: error: --n must be >= 1, got 0"
    assert loads == []  # refused before the model loads
    out = tmp_path / "qf.safetensors"
    assert cli.main(["qfilters", "--model", "tiny", "--n", "2", "--context", "96", "--samples", "40",
                     "--out", str(out), "--no-progress"]) == 0
    made = qfilters.load(str(out))
    assert made.meta.command[:2] == ["kvpress-ada", "qfilters"] and made.meta.data["samples_per_head"] == 40
    QFilter(path=str(out)).check_model(model.config)


def test_shipped_qfilters_are_the_default_models():
    from kvpress_ada import qfilters

    shipped = qfilters.load(qfilters.SHIPPED)
    assert shipped.meta.model.name == "SmolLM2-135M-Instruct"
    assert shipped.filters.shape == (30, 3, 64) and bool(torch.isfinite(shipped.filters).all())
    assert shipped.meta.data["samples_per_head"] >= 3000
    # averages of unit vectors over a group of 3 query heads: norms in (0, 1]
    norms = shipped.filters.norm(dim=-1)
    assert bool((norms > 0.05).all() and (norms <= 1.0 + 1e-5).all())


# ----------------------------------------------------------------------------- CAP
def _cap_ref(Qh, K, V, ranks_q, n, sinks, tau, n_future, eps, D):
    """CapKV for one query head of one row, written out: the anchor is the mean over the (non-sink) queries of
    ``mean_k R(n + k) R(-r) q`` (a query at rank ``r`` re-rotated to the future positions ``n .. n + n_future - 1``),
    ``w_i = exp(tau (cos(mu, k_i) - max))``, ``A = I + sum (w + eps) v v^T``, score ``w_i v_i^T A^-1 v_i``."""
    rotated = []
    for q, r in zip(Qh, ranks_q):
        if r < sinks:
            continue
        outs = [_rotate(q, n + k - r, D) for k in range(n_future)]
        rotated.append([sum(o[d] for o in outs) / n_future for d in range(D)])
    mu = [sum(x[d] for x in rotated) / len(rotated) for d in range(D)]

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    stats = [min(1.0, max(-1.0, cos(mu, k))) for k in K[sinks:]]
    top = max(stats)
    w = [math.exp(tau * (c - top)) for c in stats]
    A = torch.eye(D, dtype=torch.float64)
    for wi, v in zip(w, V[sinks:]):
        vt = torch.tensor(v, dtype=torch.float64)
        A += (wi + eps) * torch.outer(vt, vt)
    inv = torch.linalg.inv(A)
    vs = [torch.tensor(v, dtype=torch.float64) for v in V[sinks:]]
    return [math.inf] * sinks + [wi * float(v @ inv @ v) for wi, v in zip(w, vs)]


@pytest.mark.parametrize("window,sinks,tau", [(None, 4, 5.0), (6, 2, 2.0), (None, 0, 10.0)])
def test_cap_formula(window, sinks, tau):
    keys, values, queries, key_mask = _setup(21, L=16, pads=(0, 5))
    B, H, L, D = keys.shape
    G = queries.shape[1] // H
    w = L if window is None else window
    scorer = CAP(window=window, sinks=sinks, tau=tau, n_future=5)
    got = scorer.score(_obs(keys, values, queries[:, :, L - w:], key_mask))
    for b in range(B):
        valid = [j for j in range(L) if key_mask[b, j]]
        n = len(valid)
        q_pos = [j for j in range(L - w, L) if key_mask[b, j]]
        for h in range(H):
            K = [keys[b, h, j].double().tolist() for j in valid]
            V = [values[b, h, j].double().tolist() for j in valid]
            per_head = [_cap_ref([queries[b, h * G + g, j].double().tolist() for j in q_pos],
                                 K, V, [valid.index(j) for j in q_pos], n, sinks, tau, 5, 1e-6, D)
                        for g in range(G)]
            want = [sum(p[i] for p in per_head) / G for i in range(n)]
            torch.testing.assert_close(got[b, h, valid].double(), torch.tensor(want, dtype=torch.float64),
                                       rtol=1e-4, atol=1e-6)


def test_cap_scores_are_ridge_leverages_below_their_weight():
    """Each score is ``w_i`` times a ridge leverage in ``[0, 1)``: at most the token's weight, itself at most 1."""
    keys, values, queries, key_mask = _setup(22, L=40)
    got = CAP(sinks=0).score(_obs(keys, values, queries, key_mask))
    assert bool((got >= 0).all() and (got < 1).all())


# ----------------------------------------------------------------------------- chunked prefill
def _chunked_press(name, tmp_path, model, **kwargs):
    from conftest import random_qfilters

    from kvpress_ada import preset
    from kvpress_ada import qfilters as qf

    if name == "qfilter":
        path = tmp_path / "qf.safetensors"
        qf.save(random_qfilters(model.config, seed=2), path)
        return preset(name, scorer=QFilter(path=str(path)), **kwargs)
    return preset(name, **kwargs)


@pytest.mark.parametrize("name", ["leverage", "ada_leverage", "cur", "ada_cur", "cap", "qfilter"])
def test_chunked_prefill_ragged_matches_mask_and_one_chunk_is_one_shot(name, tmp_path):
    from conftest import build_model

    from kvpress_ada import Mask

    model = build_model("llama")
    ids = torch.randint(4, 128, (1, 83), generator=torch.Generator().manual_seed(5))
    press = _chunked_press(name, tmp_path, model, compression_ratio=0.7, prefill_chunk=16)
    outs = {}
    with torch.no_grad():
        for label, p in (("topk", press), ("mask", press.model_copy(update={"evictor": Mask()})),
                         ("one chunk", press.model_copy(update={"prefill_chunk": 200})),
                         ("one shot", press.model_copy(update={"prefill_chunk": None}))):
            with p(model):
                outs[label] = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                             return_dict_in_generate=True)
    assert torch.equal(outs["topk"].sequences, outs["mask"].sequences)
    for a, b in zip(outs["topk"].logits, outs["mask"].logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert torch.equal(outs["one chunk"].sequences, outs["one shot"].sequences)


class _RecordingLeverage(Leverage):
    seen: ClassVar[list] = []

    def score(self, obs):
        if obs.layer_idx == 0:
            self.seen.append((obs.keys.clone(), obs.key_mask.clone(), None if obs.positions is None
                              else obs.positions.clone()))
        return super().score(obs)


def test_chunked_prefill_hands_leverage_the_kept_entries_positions():
    """After the first chunk the first layer holds scattered positions; the observation names each entry's
    position, and each held key is the one-shot prefill's key at that position (what RoPE is undone at)."""
    from conftest import build_model

    from kvpress_ada import Pipeline
    from kvpress_ada.hosts.transformers.fanout import capture_prefill

    model = build_model("llama")
    ids = torch.randint(4, 128, (1, 60), generator=torch.Generator().manual_seed(6))
    _RecordingLeverage.seen.clear()
    with torch.no_grad(), Pipeline(scorer=_RecordingLeverage(), compression_ratio=0.6, prefill_chunk=16)(model):
        model(ids, use_cache=True)
    full = capture_prefill(model, ids).layers[0].keys
    scattered = 0
    for keys, mask, positions in _RecordingLeverage.seen:
        assert positions is not None
        for h in range(keys.shape[1]):
            pos = positions[0, h][mask[0]]
            torch.testing.assert_close(keys[0, h][mask[0]], full[0, h, pos], atol=1e-5, rtol=1e-5)
            scattered += int((pos.diff() > 1).any())
    assert len(_RecordingLeverage.seen) >= 3 and scattered > 0
