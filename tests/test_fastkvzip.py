"""Fast KVzip: the sink-attention gate against its formula written out, the gate surrogate file, its training, and the
scorer's protected tokens, through the press on a tiny model (ragged == Mask, batch rows as alone)."""

import math

import pytest
import torch
from conftest import build_model, default_model_config, generate_ragged_and_mask

from kvpress_ada import Observation, Pipeline, preset
from kvpress_ada import surrogate as sur
from kvpress_ada.calibration import model_identity
from kvpress_ada.harness.distill import fit_gate
from kvpress_ada.hosts.transformers.hf import output_cache
from kvpress_ada.scorers import FastKVzip


def random_gate(config, width=4, sinks=3, seed=0):
    """A Fast KVzip gate surrogate with random weights made for ``config``'s model."""
    g = torch.Generator().manual_seed(seed)
    d, h = int(config.hidden_size), int(config.num_key_value_heads)
    group = int(config.num_attention_heads) // h
    meta = {"model": model_identity(config), "teacher": {"name": "kvzip"}, "kind": "gate", "hidden_size": d,
            "width": width, "sinks": sinks, "dtype": "float32", "target": {"floor": 1e-6}, "training": {}, "fit": {},
            "library_version": "0", "created": "now"}
    layers = [{"q_w": torch.randn(d, h * group * width, generator=g) / d**0.5,
               "q_b": torch.randn(h * group * width, generator=g),
               "k_w": torch.randn(d, h * width, generator=g) / d**0.5,
               "q_norm": 1 + 0.2 * torch.randn(width, generator=g), "k_norm": 1 + 0.2 * torch.randn(width, generator=g),
               "k_base": torch.randn(h, sinks, width, generator=g), "b": torch.randn(h, group, generator=g)}
              for _ in range(config.num_hidden_layers)]
    return sur.Surrogate(layers, meta)


def test_gate_matches_the_formula_written_out():
    model = build_model("llama")
    gate = random_gate(model.config, seed=1)
    hidden = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    got = gate.predict(hidden, 1)  # [B, H, T]
    w = gate.weights(1)
    H, G, d, S = 2, 2, 4, 3
    for b in range(2):
        for t in range(5):
            x = hidden[b, t].double()
            q = (x @ w["q_w"].double() + w["q_b"].double()).view(H, G, d)
            k = (x @ w["k_w"].double()).view(H, d)
            for h in range(H):
                kn = k[h] / math.sqrt(float(k[h].pow(2).mean()) + 1e-6) * w["k_norm"].double()
                gates = []
                for gq in range(G):
                    qn = q[h, gq] / math.sqrt(float(q[h, gq].pow(2).mean()) + 1e-6) * w["q_norm"].double()
                    own = float(qn @ kn) / math.sqrt(d) + float(w["b"][h, gq])
                    sinks = [float(w["k_base"][h, s].double() @ qn) / math.sqrt(d) for s in range(S)]
                    gates.append(1.0 / (1.0 + sum(math.exp(v - own) for v in sinks)))
                want = math.log(sum(gates) / G)
                assert abs(float(got[b, h, t]) - want) < 1e-4, (b, t, h)


def test_gate_file_round_trip_and_meta_checks(tmp_path):
    model = build_model("llama")
    gate = random_gate(model.config)
    path = tmp_path / "gate.safetensors"
    sur.save(gate, path)
    loaded = sur.load(str(path))
    assert loaded.kind == "gate" and loaded.meta.sinks == 3 and loaded.meta.group == 2
    hidden = torch.randn(1, 4, model.config.hidden_size)
    torch.testing.assert_close(loaded.predict(hidden, 0), gate.predict(hidden, 0))
    meta = gate.meta.model_dump()
    with pytest.raises(ValueError, match="sinks is given for kind 'gate'"):
        sur.SurrogateMeta.model_validate({**meta, "sinks": None})
    with pytest.raises(ValueError, match="width is given"):
        sur.SurrogateMeta.model_validate({**meta, "kind": "linear"})
    bad = [dict(layer) for layer in (gate.weights(i) for i in range(3))]
    bad[0]["k_base"] = torch.zeros(2, 4, 4)
    with pytest.raises(ValueError, match="layers.0.k_base has shape"):
        sur.Surrogate(bad, gate.meta)


def test_fit_gate_learns_a_gate_it_can_express():
    """Targets made by a gate: the fitted gate ranks the tokens nearly as the target does."""
    config = build_model("llama").config
    teacher = random_gate(config, width=4, sinks=3, seed=3)
    x = torch.randn(3000, config.hidden_size, generator=torch.Generator().manual_seed(4))
    y = teacher.predict(x[None], 0)[0].T  # [N, H] log gate
    fitted = fit_gate(x[:2000], y[:2000], heads=2, group=2, width=4, sinks=3, epochs=60, batch=256, seed=0)
    pred = sur.gate_log_scores(fitted, x[2000:], 2, 2)  # held-out tokens
    assert pred.shape == y[2000:].shape and bool((pred <= 0).all())  # the log of a gate in (0, 1)
    untrained = fit_gate(x[:2000], y[:2000], heads=2, group=2, width=4, sinks=3, epochs=1, batch=2000, lr=1e-9)
    for h in range(2):
        def rho(p):
            return float(torch.corrcoef(torch.stack([p[:, h].argsort().argsort().double(),
                                                     y[2000:, h].argsort().argsort().double()]))[0, 1])
        assert rho(pred) > 0.6 and rho(pred) > rho(sur.gate_log_scores(untrained, x[2000:], 2, 2)) + 0.3


def test_protected_tokens_follow_each_rows_length():
    scorer = FastKVzip(sinks=2, window_ratio=0.25)
    B, H, L = 2, 2, 12
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, :4] = False  # row 1: 8 tokens -> 2 recent protected; row 0: 12 -> 3
    obs = Observation(keys=torch.zeros(B, H, L, 4), values=torch.zeros(B, H, L, 4), queries=torch.zeros(B, 4, 0, 4),
                      key_mask=mask, layer_idx=0, n_layers=1, scaling=0.5, entry_scores=torch.randn(B, H, L))
    scores = scorer.score(obs)
    inf = torch.isposinf(scores)
    assert inf[0, 0].nonzero().flatten().tolist() == [0, 1, 9, 10, 11]
    assert inf[1, 1].nonzero().flatten().tolist() == [4, 5, 10, 11]
    assert scorer.protected(mask.sum(-1)).tolist() == [5, 4]
    assert FastKVzip(window=5, window_ratio=0.0).protected(torch.tensor([100])).tolist() == [9]


def test_fastkvzip_press_on_a_tiny_model(tmp_path):
    model = build_model("llama")
    path = tmp_path / "gate.safetensors"
    sur.save(random_gate(model.config, seed=5), path)
    ids = torch.randint(5, 100, (2, 40), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ids[1, :9] = 0
    for name in ("fastkvzip", "ada_fastkvzip"):
        press = preset(name, compression_ratio=0.5, scorer=FastKVzip(path=str(path)))
        ragged, masked = generate_ragged_and_mask(model, press, ids, attention_mask=mask, pad_token_id=0)
        assert torch.equal(ragged, masked)
        with torch.no_grad(), press(model):
            cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
        kept = sum(cache.head_lengths(i).sum(-1) for i in range(3))
        assert kept.tolist() == [3 * 2 * 20, 3 * 2 * round(0.5 * 31)]


def test_shipped_gate_fits_the_default_model():
    gate = sur.load(sur.SHIPPED_GATE)
    gate.check_model(default_model_config())
    meta = gate.meta
    assert meta.kind == "gate" and meta.width == 16 and meta.sinks == 16 and meta.teacher["name"] == "kvzip"
    assert meta.training["seeds"]["seed"] >= 10_000 and meta.fit["summary"]["spearman"] > 0.5
    press = preset("fastkvzip", compression_ratio=0.5)
    assert press.scorer.path == sur.SHIPPED_GATE
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    with pytest.raises(sur.SurrogateError, match="kvpress-ada distill"):
        press.scorer.check_model(build_model("llama").config)
