"""Score surrogates (``kvpress_ada.surrogate``): the fits recover planted maps, files round-trip, are
refused for another model or when malformed, and the shipped files fit the default model."""

import json

import pytest
import torch
from conftest import build_model, default_model_config, qwen_coder_0_5b_config, random_surrogate

from kvpress_ada import surrogate as sur
from kvpress_ada.harness.distill import LinearStats, fit_linear, fit_mlp, fit_quality, kept_recall, spearman

DEFAULT_CONFIG = default_model_config()


def _inputs(n: int, d: int, seed: int) -> torch.Tensor:
    """Inputs with per-dimension offsets and scales far from standard (as hidden states are)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * (torch.rand(d, generator=g) * 3 + 0.2) + torch.randn(d, generator=g) * 4


def _stats(x: torch.Tensor, y: torch.Tensor, parts: int = 4) -> LinearStats:
    stats = LinearStats(x.shape[1], y.shape[1])
    for xs, ys in zip(x.chunk(parts), y.chunk(parts)):  # streamed in parts: the sums must add up
        stats.add(xs, ys)
    return stats


def test_ridge_recovers_a_planted_linear_map():
    d, h = 24, 3
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(d, h, generator=g, dtype=torch.float64), torch.randn(h, generator=g, dtype=torch.float64)
    x_all = _inputs(4500, d, 2)
    x, held = x_all[:4000].double(), x_all[4000:]
    y = x @ weight + bias + 0.003 * torch.randn(4000, h, generator=g, dtype=torch.float64)
    w, b = _stats(x, y).solve(1e-9)
    assert torch.allclose(w, weight, atol=2e-3) and torch.allclose(b, bias, atol=2e-2)
    # the held-out choice of the strength keeps it: a strong ridge would shrink W
    w32, b32, lam = fit_linear(_stats(x, y), [held], [(held.double() @ weight + bias).float()])
    assert lam <= 1e-3 and torch.allclose(w32.double(), weight, atol=5e-3)
    assert not torch.allclose(_stats(x, y).solve(10.0)[0], weight, atol=5e-3)


def test_ridge_statistics_add_up():
    x, y = _inputs(300, 8, 4).double(), _inputs(300, 2, 5).double()
    one, four = _stats(x, y, 1), _stats(x, y, 4)
    assert one.n == four.n == 300
    for a, b in zip((one.sx, one.sxx, one.sxy, one.sy, one.syy), (four.sx, four.sxx, four.sxy, four.sy, four.syy)):
        assert torch.allclose(a, b)


def _mlp_vs_linear(x, y, held_x, held_y):
    stats = _stats(x, y)
    w, b, _ = fit_linear(stats, [held_x], [held_y])
    mlp = fit_mlp(x, y, stats.x_moments(), stats.y_moments(), width=32, epochs=25, seed=0, batch=256)
    linear_err = ((held_x @ w + b - held_y) ** 2).mean()
    mlp_err = ((torch.nn.functional.gelu(held_x @ mlp["w1"] + mlp["b1"]) @ mlp["w2"] + mlp["b2"] - held_y) ** 2).mean()
    return float(linear_err), float(mlp_err)


def test_mlp_beats_linear_on_a_planted_nonlinear_map():
    d = 8
    g = torch.Generator().manual_seed(6)
    a = torch.randn(d, 2, generator=g)

    def target(x):
        z = (x - x.mean(0)) / x.std(0) @ a / d ** 0.5
        return torch.stack([z[:, 0].abs(), torch.sin(2 * z[:, 1])], dim=1)

    x_all = _inputs(4000, d, 7)
    x, held = x_all[:3000], x_all[3000:]
    y_all = target(x_all)
    linear_err, mlp_err = _mlp_vs_linear(x, y_all[:3000], held, y_all[3000:])
    assert mlp_err < 0.6 * linear_err  # measured: 0.21 vs 0.50


def test_mlp_folds_standardisation_and_leaves_the_global_rng_alone():
    x = _inputs(2000, 6, 9)
    y = x[:, :2] * 0.5 + 3.0
    stats = _stats(x, y)
    state = torch.random.get_rng_state()
    first = fit_mlp(x, y, stats.x_moments(), stats.y_moments(), width=8, epochs=20, seed=3, batch=128)
    assert torch.equal(torch.random.get_rng_state(), state)
    again = [fit_mlp(x, y, stats.x_moments(), stats.y_moments(), width=8, epochs=1, seed=3) for _ in range(2)]
    assert all(torch.equal(again[0][k], again[1][k]) for k in first)  # seeded: the same weights
    pred = torch.nn.functional.gelu(x @ first["w1"] + first["b1"]) @ first["w2"] + first["b2"]
    assert float(((pred - y) ** 2).mean()) < 0.1 * float(y.var(0).mean())  # raw inputs in, raw targets out


def test_fit_quality_measures():
    t = torch.randn(3, 50)
    assert torch.allclose(spearman(t, t * 2 + 1), torch.ones(3, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(spearman(t, -t), -torch.ones(3, dtype=torch.float64), atol=1e-9)
    assert torch.equal(kept_recall(t, t, 0.5), torch.ones(3, dtype=torch.float64))
    assert torch.equal(kept_recall(-t, t, 0.5), torch.zeros(3, dtype=torch.float64))
    fit = fit_quality([[t, t]], [[t, t]])
    assert fit["r2"] == [1.0] and fit["summary"]["global_recall@0.75"] == 1.0
    fit = fit_quality([[torch.zeros(3, 50)]], [[t]])
    assert fit["r2"][0] <= 0.0


# ----------------------------------------------------------------------------- files
@pytest.fixture(scope="module")
def tiny():
    return build_model("llama")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_round_trip_gives_identical_predictions(tiny, tmp_path, kind):
    made = random_surrogate(tiny.config, kind)
    path = tmp_path / f"{kind}.safetensors"
    sur.save(made, path)
    loaded = sur.load(str(path))
    assert loaded.kind == kind and loaded.n_layers == 3 and loaded.n_kv_heads == 2 and loaded.hidden_size == 64
    assert loaded.meta == made.meta and loaded.teacher == {"name": "kvzip"}
    hidden = torch.randn(2, 9, 64)
    for layer in range(3):
        out = loaded.predict(hidden, layer)
        assert out.shape == (2, 2, 9) and out.dtype == torch.float32
        assert torch.equal(out, made.predict(hidden, layer))
    assert sur.load(str(path)) is loaded  # cached per file version
    w = made.weights(1)
    expected = hidden @ w["weight"] + w["bias"] if kind == "linear" else \
        torch.nn.functional.gelu(hidden @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]
    assert torch.allclose(made.predict(hidden, 1), expected.transpose(1, 2), atol=1e-5)


def test_predict_any_dtype_and_mode(tiny):
    made = random_surrogate(tiny.config, "mlp")
    hidden = torch.randn(1, 4, 64)
    ref = made.predict(hidden, 0)
    with torch.inference_mode():
        assert torch.allclose(made.predict(hidden.to(torch.bfloat16), 0), ref, atol=0.5, rtol=0.05)
    grad = hidden.clone().requires_grad_()
    assert torch.equal(made.predict(grad, 0).detach(), ref)  # weights cached under inference_mode still work
    with pytest.raises(ValueError, match=r"hidden must be \[B, T, 64\]"):
        made.predict(torch.randn(1, 4, 32), 0)
    with pytest.raises(IndexError, match="layer_idx 3"):
        made.predict(hidden, 3)


def test_refused_for_another_model_in_one_line(tiny, tmp_path):
    path = tmp_path / "tiny.safetensors"
    sur.save(random_surrogate(tiny.config), path)
    other = build_model("qwen2")
    with pytest.raises(sur.SurrogateError) as err:
        sur.load(str(path)).check_model(other.config, source="tiny.safetensors")
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert "tiny.safetensors was trained for model 'llama'" in message and "not for 'qwen2'" in message
    assert "kvpress-ada distill" in message
    sur.load(str(path)).check_model(tiny.config)  # its own model passes


@pytest.mark.parametrize("content, why", [
    (b"not a safetensors file", "not a kvpress-ada surrogate"),
    (None, "no 'kvpress_ada.surrogate' metadata"),
    ("bad-json", "not a kvpress-ada surrogate"),
    ("wrong-shape", "layers.0.weight has shape (64, 3), expected (64, 2)"),
])
def test_malformed_file_one_line(tmp_path, tiny, content, why):
    from safetensors.torch import save_file

    path = tmp_path / "bad.safetensors"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is None:
        save_file({"layers.0.weight": torch.zeros(2, 2)}, str(path))
    elif content == "bad-json":
        save_file({"layers.0.weight": torch.zeros(2, 2)}, str(path), metadata={sur.METADATA_KEY: "{nope"})
    else:
        made = random_surrogate(tiny.config)
        tensors = {f"layers.{i}.{k}": v for i in range(3) for k, v in made.weights(i).items()}
        tensors["layers.0.weight"] = torch.zeros(64, 3)
        save_file(tensors, str(path), metadata={sur.METADATA_KEY: made.meta.model_dump_json()})
    with pytest.raises(sur.SurrogateError) as err:
        sur.load(str(path))
    assert len(str(err.value).splitlines()) == 1 and why in str(err.value) and "bad.safetensors" in str(err.value)


def test_missing_file_one_line():
    with pytest.raises(sur.SurrogateError, match=r"surrogate file 'nowhere.safetensors' not found .*distill"):
        sur.load("nowhere.safetensors")
    with pytest.raises(sur.SurrogateError, match="builtin:nope"):
        sur.load("builtin:nope")


def test_a_directory_as_surrogate_path_is_said_so(tmp_path):
    with pytest.raises(sur.SurrogateError, match=r"surrogate path '.*' is a directory"):
        sur.load(str(tmp_path))


# ----------------------------------------------------------------------------- shipped files
@pytest.mark.parametrize("path, kind", [(sur.SHIPPED_MLP, "mlp"), (sur.SHIPPED_LINEAR, "linear")])
def test_shipped_surrogates_fit_the_default_model(path, kind):
    """The shipped files load, match the default model's architecture (a config, no weights) and predict."""
    shipped = sur.load(path)
    shipped.check_model(DEFAULT_CONFIG)
    assert shipped.kind == kind and shipped.teacher["name"] == "kvzip" and not shipped.teacher["plus"]
    assert (shipped.n_layers, shipped.n_kv_heads, shipped.hidden_size) == (30, 3, 576)
    training = shipped.meta.training
    assert training["seeds"]["seed"] >= 10_000 and training["n_heldout"] >= 1 and training["context"] >= 500
    assert training["texts"]["documentation"] >= 1
    fit = shipped.meta.fit
    assert len(fit["r2"]) == 30 and all(len(h) == 3 for h in fit["spearman"])
    assert 0.0 < fit["summary"]["recall@0.5"] <= 1.0 and json.dumps(fit)
    assert sur.resolve(path).stat().st_size <= 2.6e6
    hidden = torch.randn(2, 5, 576)
    for layer in (0, 29):
        out = shipped.predict(hidden, layer)
        assert out.shape == (2, 3, 5) and bool(torch.isfinite(out).all())
    with pytest.raises(sur.SurrogateError, match="smollm2-135m-instruct"):
        shipped.check_model(build_model("llama").config)


def test_shipped_surrogate_fits_qwen_coder_0_5b():
    """The 0.5B model's shipped surrogate and the benchmark configs using it fit that architecture only."""
    from pathlib import Path

    import yaml

    from kvpress_ada import Pipeline

    config = qwen_coder_0_5b_config()
    shipped = sur.load("builtin:qwen2_5_coder_0_5b_kvzip_mlp")
    shipped.check_model(config)
    assert shipped.kind == "mlp" and shipped.teacher["name"] == "kvzip"
    assert (shipped.n_layers, shipped.n_kv_heads, shipped.hidden_size) == (24, 2, 896)
    assert shipped.meta.training["seeds"]["seed"] >= 10_000 and len(shipped.meta.fit["r2"]) == 24
    out = shipped.predict(torch.randn(1, 3, 896), 23)
    assert out.shape == (1, 2, 3) and bool(torch.isfinite(out).all())
    with pytest.raises(sur.SurrogateError, match="qwen2.5-coder-0.5b-instruct") as err:
        shipped.check_model(DEFAULT_CONFIG)  # the refusal offers the files shipped for the model in hand
    shipped_here = f"{sur.SHIPPED_GATE} and {sur.SHIPPED_LINEAR} and {sur.SHIPPED_MLP}"
    assert str(err.value).endswith(f"this package ships {shipped_here} for it")
    with pytest.raises(sur.SurrogateError) as err:
        sur.load(sur.SHIPPED_MLP).check_model(config)
    assert str(err.value).endswith("this package ships builtin:qwen2_5_coder_0_5b_kvzip_mlp for it")
    with pytest.raises(sur.SurrogateError) as err:  # nothing shipped for this one: how to make one
        shipped.check_model(build_model("llama").config)
    assert "kvpress-ada distill --model <that model>" in str(err.value)
    folder = Path(__file__).resolve().parents[1] / "benchmarks/configs/qwen2.5-coder-0.5b"
    for name, chunk in (("kvzap.yaml", None), ("kvzap_chunk512.yaml", 512)):
        press = Pipeline.model_validate(yaml.safe_load((folder / name).read_text()))
        press.scorer.check_model(config)
        assert press.prefill_chunk == chunk and press.scorer.path == "builtin:qwen2_5_coder_0_5b_kvzip_mlp"
