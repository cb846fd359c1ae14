"""Expected Attention with calibrated query statistics (``ExpectedAttentionStats``, preset
``expected_attention_stats``; kvpress's ExpectedAttentionStatsPress): the scores against kvpress's definition written
out with explicit RoPE matrices on small tensors (padded rows, entries held after an eviction), the statistics the
harness measures against the queries recomputed from the weights, the file format, the command, the shipped file
and the refusal of another model in one line naming the command."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model, build_tokenizer

from kvpress_ada import Observation, Pipeline, preset
from kvpress_ada.calibration import model_identity
from kvpress_ada.query_stats import QueryStats, QueryStatsError, QueryStatsMeta, load, save
from kvpress_ada.scorers import ExpectedAttentionStats

D = 16


def _stats_file(tmp_path, config, seed=0, name="qs.safetensors"):
    """Seeded random statistics for ``config``'s model (covariances ``A A^T / D``), saved and loaded back."""
    g = torch.Generator().manual_seed(seed)
    n, hq = config.num_hidden_layers, config.num_attention_heads
    a = torch.randn(n, hq, D, D, generator=g)
    meta = QueryStatsMeta(model=model_identity(config), data={"source": "seeded random (test)"},
                          library_version="test", created="now")
    stats = QueryStats(torch.randn(n, hq, D, generator=g), a @ a.transpose(-1, -2) / D, meta)
    path = tmp_path / name
    save(stats, path)
    return str(path), load(str(path))


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angle = positions.double()[:, None] * inv_freq.double()[None]
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    half = x.shape[-1] // 2
    return x.double() * cos + torch.cat([-x[..., half:], x[..., :half]], -1).double() * sin


def _kvpress_scores(keys, values, positions, mu, cov, inv_freq, n_future, sinks, G):
    """kvpress's ExpectedAttentionStatsPress on one row: ``R = mean_t (cos(t theta) I + sin(t theta) P)`` over
    ``t = T .. T + n_future - 1`` (``T`` one past the last key), ``mu R^T``, ``R Sigma R^T``, logits ``k.mu / sqrt(d) +
    k^T Sigma k / (2 d)`` over the keys but the first ``sinks``, softmax per query head, mean over the group, times
    ``||v||``; the sinks scored +inf. ``keys``/``values`` ``[H_kv, n, D]``, ``mu`` ``[H_q, D]``, ``cov`` ``[H_q, D,
    D]``."""
    H, n, d = keys.shape
    T = int(positions.max()) + 1
    eye, P = torch.eye(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
    P[d // 2:, :d // 2], P[:d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    R = torch.zeros(d, d, dtype=torch.float64)
    for t in range(T, T + n_future):
        angle = t * torch.cat([inv_freq, inv_freq]).double()
        R += angle.cos()[None, :] * eye + angle.sin()[None, :] * P
    R /= n_future
    out = torch.zeros(H, n, dtype=torch.float64)
    rest = positions >= sinks
    for h in range(H):
        k = keys[h].double()[rest]
        for g in range(G):
            m, s = mu[h * G + g].double() @ R.T, R @ cov[h * G + g].double() @ R.T
            logits = k @ m / math.sqrt(d) + torch.einsum("nd,de,ne->n", k, s, k) / d / 2
            out[h, rest] += logits.softmax(-1) / G
        out[h] *= values[h].double().norm(dim=-1)
    out[:, ~rest] = float("inf")
    return out


def test_scores_follow_kvpress_definition_on_padded_and_evicted_rows(tmp_path):
    model = build_model("llama")
    path, stats = _stats_file(tmp_path, model.config)
    H, G = model.config.num_key_value_heads, model.config.num_attention_heads // model.config.num_key_value_heads
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    g = torch.Generator().manual_seed(1)
    L, pad = 30, 6
    pre = torch.randn(2, H, L, D, generator=g)
    values = torch.randn(2, H, L, D, generator=g)
    key_mask = torch.ones(2, L, dtype=torch.bool)
    key_mask[1, :pad] = False
    rank = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
    keys = torch.stack([torch.stack([_rope(pre[b, h], rank[b], inv_freq) for h in range(H)]) for b in range(2)])
    scorer = ExpectedAttentionStats(path=path, n_future=40, sinks=3)
    for layer in range(model.config.num_hidden_layers):
        obs = Observation(keys=keys.float(), values=values, queries=torch.zeros(2, H * G, 0, D), key_mask=key_mask,
                          layer_idx=layer, n_layers=3, scaling=D**-0.5, rope_inv_freq=inv_freq)
        got = scorer.score(obs).double()
        for b, p in ((0, 0), (1, pad)):
            want = _kvpress_scores(keys[b, :, p:], values[b, :, p:], rank[b, p:], stats.mean[layer],
                                   stats.cov[layer], inv_freq, 40, 3, G)
            torch.testing.assert_close(got[b, :, p:], want, rtol=2e-4, atol=1e-7)
    # entries held after an eviction (chunked prefill, decode compression): positions in the fed sequence, the row's
    # first held entry (a sink) at RoPE position 0, the next token one past the newest
    held = torch.tensor([0, 1, 2, 5, 9, 10, 14, 20, 21, 22, 23, 24])
    obs = Observation(keys=keys[:1, :, held].float(), values=values[:1, :, held], queries=torch.zeros(1, H * G, 0, D),
                      key_mask=torch.ones(1, len(held), dtype=torch.bool), layer_idx=1, n_layers=3, scaling=D**-0.5,
                      rope_inv_freq=inv_freq, positions=(held + 7)[None, None].expand(1, H, -1))
    want = _kvpress_scores(keys[0, :, held], values[0, :, held], held, stats.mean[1], stats.cov[1], inv_freq, 40, 3, G)
    torch.testing.assert_close(scorer.score(obs)[0].double(), want, rtol=2e-4, atol=1e-7)
    assert scorer.protected(torch.tensor([30, 2])).tolist() == [3, 2] and scorer.query_window() == 0


def test_harness_measures_the_pre_rope_query_moments(tmp_path):
    """The statistics of ``make_query_stats``: mean and unbiased covariance of ``q_proj(input_layernorm(h))`` per query
    head over every text's positions past the sinks (recomputed here from the hidden states)."""
    from kvpress_ada.harness.distill import documentation_texts
    from kvpress_ada.harness.query_stats import make_query_stats

    model, tok = build_model("llama", seed=3), build_tokenizer()
    made = make_query_stats(model, tok, n=2, context=70, sinks=4, progress=False)
    Hq = model.config.num_attention_heads
    per_layer = [[] for _ in range(model.config.num_hidden_layers)]
    with torch.no_grad():
        for text in documentation_texts(tok, 2, 70):
            ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            hidden = model(ids, output_hidden_states=True).hidden_states
            for i, layer in enumerate(model.model.layers):
                q = layer.self_attn.q_proj(layer.input_layernorm(hidden[i][0])).view(-1, Hq, D)
                per_layer[i].append(q[4:].double())
    for i, qs in enumerate(per_layer):
        q = torch.cat(qs)  # [N, H_q, D]
        mean = q.mean(0)
        centred = q - mean
        cov = torch.einsum("nhd,nhe->hde", centred, centred) / (q.shape[0] - 1)
        torch.testing.assert_close(made.mean[i].double(), mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(made.cov[i].double(), cov, rtol=1e-3, atol=1e-5)
    assert made.meta.data["positions"] == sum(len(x) for x in per_layer[0])
    assert made.meta.data["sinks"] == 4 and made.meta.data["texts"] == 2


def test_file_keeps_the_statistics_and_refuses_another_model(tmp_path):
    model = build_model("llama")
    path, stats = _stats_file(tmp_path, model.config, seed=2)
    assert stats.mean.shape == (3, 4, D) and stats.cov.shape == (3, 4, D, D)
    torch.testing.assert_close(stats.cov, stats.cov.transpose(-1, -2))
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 4, D, D, generator=g)  # as _stats_file draws them
    want_mean = torch.randn(3, 4, D, generator=g)
    torch.testing.assert_close(stats.mean, want_mean)  # float32, exact
    torch.testing.assert_close(stats.cov, a @ a.transpose(-1, -2) / D, rtol=1e-3, atol=2e-3)  # float16 triangle
    press = Pipeline(scorer=ExpectedAttentionStats(path=path), compression_ratio=0.5)
    press.check_config(model.config)
    other = build_model("qwen2")
    with pytest.raises(ValueError, match="kvpress-ada query-stats") as err:
        press.check_config(other.config)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="kvpress-ada query-stats") as err:  # the shipped (default model's) file
        preset("expected_attention_stats", compression_ratio=0.5).check_config(model.config)
    assert "\n" not in str(err.value)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a file")
    with pytest.raises(QueryStatsError, match="not a kvpress-ada query statistics file"):
        load(str(bad))


def test_on_a_model_padded_batch_ragged_matches_mask_and_fanout(tmp_path):
    from conftest import left_padded_batch

    from kvpress_ada.hosts.transformers.fanout import capture_prefill

    model = build_model("llama")
    path, _ = _stats_file(tmp_path, model.config, seed=4)
    ids, mask = left_padded_batch(seed=3)
    outs = {}
    for evictor in ("topk", "mask"):
        with torch.no_grad(), Pipeline(scorer=ExpectedAttentionStats(path=path), evictor=evictor,
                                       compression_ratio=0.5)(model):
            outs[evictor] = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(outs["topk"], outs["mask"])
    press = Pipeline(scorer=ExpectedAttentionStats(path=path), compression_ratio=0.5)
    with torch.inference_mode():
        kept = capture_prefill(model, ids[:1]).keep_masks(press)
    assert all(int(k.sum(-1).min()) == 45 for k in kept)


def test_command_writes_statistics_the_scorer_accepts(tmp_path, monkeypatch, capsys):
    import kvpress_ada.harness.cli as cli

    model, loads = build_model("llama"), []
    monkeypatch.setattr(cli, "_load_model", lambda name: loads.append(name) or (model, build_tokenizer()))
    assert cli.main(["query-stats", "--model", "tiny", "--n", "0"]) == 2
    assert capsys.readouterr().err.strip() == "kvpress-ada query-stats: error: --n must be >= 1, got 0"
    assert cli.main(["query-stats", "--model", "tiny", "--context", "64", "--sinks", "64"]) == 2
    assert "--sinks must be below --context" in capsys.readouterr().err
    assert loads == []  # refused before the model loads
    out = tmp_path / "qs.safetensors"
    assert cli.main(["query-stats", "--model", "tiny", "--n", "2", "--context", "80", "--out", str(out),
                     "--no-progress"]) == 0
    made = load(str(out))
    assert made.meta.command[:2] == ["kvpress-ada", "query-stats"] and made.meta.data["texts"] == 2
    ExpectedAttentionStats(path=str(out)).check_model(model.config)


def test_shipped_statistics_are_the_default_models():
    from conftest import default_model_config

    from kvpress_ada import query_stats

    shipped = query_stats.load(query_stats.SHIPPED)
    ExpectedAttentionStats().check_model(default_model_config())
    assert shipped.mean.shape == (30, 9, 64) and shipped.cov.shape == (30, 9, 64, 64)
    assert bool(torch.isfinite(shipped.mean).all() and torch.isfinite(shipped.cov).all())
    assert shipped.meta.data["positions"] >= 30_000 and shipped.meta.data["sinks"] == 4
    torch.testing.assert_close(shipped.cov, shipped.cov.transpose(-1, -2))
    eig = torch.linalg.eigvalsh(shipped.cov.double())
    assert bool((eig > -1e-2 * eig.abs().amax(-1, keepdim=True)).all())  # positive semi-definite up to rounding
    press = preset("expected_attention_stats", compression_ratio=0.5)
    assert press.scorer == ExpectedAttentionStats() and not type(press.scorer).comparable_across_heads
