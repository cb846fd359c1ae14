"""Offline calibration (``kvpress-ada calibrate``) and the ``Calibrated`` / ``CalibratedLayer`` budgets."""

import json

import pytest
import torch
from conftest import (
    _COMMON,
    build_model,
    build_tokenizer,
    default_model_config,
    left_padded_batch,
    qwen_coder_0_5b_config,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lagkv_keydiff import _generate
from transformers import LlamaConfig

from kvpress_ada import Calibrated, CalibratedLayer, Mask, Pipeline, SnapKV, StreamingLLM, preset
from kvpress_ada import calibration as cal
from kvpress_ada.harness.calibrate import calibrate, calibration_samples
from kvpress_ada.harness.cli import main
from kvpress_ada.hosts.transformers.hf import output_cache

CONTEXT = 300  # the char tokenizer's passkey fits in 300 tokens


@pytest.fixture(scope="module")
def tiny():
    return build_model("llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def tiny_calibration(tiny, tmp_path_factory):
    """A calibration of the tiny model made by the real ``calibrate`` (KVzip), saved to a file."""
    result = calibrate(tiny, build_tokenizer(), "kvzip", n=2, tasks=["passkey"], context=CONTEXT, progress=False)
    path = tmp_path_factory.mktemp("cal") / "tiny.json"
    result.save(path)
    return str(path)


def _write(path, shares, config=None) -> str:
    """A calibration file with the given ``shares [layers][heads]`` for ``config`` (tiny llama by default)."""
    config = config or LlamaConfig(**_COMMON)
    c = cal.Calibration(model=cal.model_identity(config), scorer={"name": "kvzip"}, reference={}, ratios=[0.5],
                        tasks=["passkey"], n=1, seeds={"seed": cal.CALIBRATION_SEED}, context=CONTEXT,
                        library_version="test", created="now", shares=shares)
    c.save(path)
    return str(path)


# ----------------------------------------------------------------------------- the file
def test_file_round_trip(tiny, tiny_calibration):
    loaded = cal.load(tiny_calibration)
    assert cal.Calibration.model_validate_json(json.dumps(loaded.model_dump(mode="json"))) == loaded
    assert cal.load(tiny_calibration) is loaded  # read once, cached
    assert loaded.model.fingerprint == cal.model_identity(tiny.config).fingerprint
    assert len(loaded.shares) == 3 and all(len(row) == 2 for row in loaded.shares)
    assert abs(sum(map(sum, loaded.shares)) - 1.0) < 1e-9
    assert loaded.scorer["name"] == "kvzip" and loaded.n == 2 and loaded.seeds["seed"] >= 10_000
    assert loaded.context == CONTEXT and loaded.ratios == [0.5, 0.75] and loaded.tasks == ["passkey"]


def test_calibration_never_uses_evaluation_seeds():
    tok = build_tokenizer()
    with pytest.raises(ValueError, match="calibration seeds start at 10000"):
        calibration_samples(tok, ["passkey"], 2, CONTEXT, seed=0)
    from kvpress_ada.harness.eval.tasks import make_samples

    evaluation = make_samples("passkey", tok, 4, CONTEXT, seed=0)
    calibration = calibration_samples(tok, ["passkey"], 4, CONTEXT)
    assert not {s.context for s in evaluation} & {s.context for s in calibration}


def test_shares_measure_the_reference_allocation(tiny):
    """One sample, one ratio: the shares are the kvzip preset's kept counts over their total."""
    from kvpress_ada.hosts.transformers.fanout import capture_prefill
    from kvpress_ada.hosts.transformers.generation import split_prompt
    from kvpress_ada.tokens import encode

    tok = build_tokenizer()
    result = calibrate(tiny, tok, "kvzip", n=1, tasks=["passkey"], context=CONTEXT, ratios=[0.5], progress=False)
    sample = calibration_samples(tok, ["passkey"], 1, CONTEXT)[0]
    prefill = capture_prefill(tiny, encode(tok, split_prompt(tok, sample.context, sample.question)[0], "cpu"))
    kept = torch.stack([k[0].sum(-1) for k in prefill.keep_masks(preset("kvzip", compression_ratio=0.5))]).double()
    assert torch.allclose(torch.tensor(result.shares, dtype=torch.float64), kept / kept.sum())


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not a kvpress-ada calibration"),
    ('{"format": "kvpress_ada.calibration/1"}', "is not a kvpress-ada calibration (model: Field required)"),
])
def test_malformed_file_refused(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(cal.CalibrationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cal.load(str(path))


def test_shares_must_sum_to_one(tmp_path):
    with pytest.raises(ValueError, match="summing to 1"):
        _write(tmp_path / "x.json", [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])


def test_missing_file_refused(tmp_path):
    with pytest.raises(cal.CalibrationError, match="not found.*kvpress-ada calibrate"):
        cal.load(str(tmp_path / "nope.json"))


# ----------------------------------------------------------------------------- allocation
def test_split_proportional_where_no_cap_binds(tmp_path):
    """Hand-computed: layer shares 0.6/0.2/0.2, head shares 3:1 in layer 0."""
    path = _write(tmp_path / "c.json", [[0.45, 0.15], [0.1, 0.1], [0.1, 0.1]])
    lengths = torch.tensor([1000])
    assert CalibratedLayer(path=path).budgets(torch.tensor([10]), 3, lengths).tolist() == [[18, 6, 6]]
    # layer 0 capped at 15 tokens: its 3 extra go to the others in proportion (7.5 each: tie to the lower index)
    assert CalibratedLayer(path=path).budgets(torch.tensor([10]), 3, torch.tensor([15])).tolist() == [[15, 8, 7]]
    scores = torch.rand(1, 2, 1000)
    assert Calibrated(path=path).allocate_layer(scores, torch.tensor([10]), 0).tolist() == [[15, 5]]
    assert Calibrated(path=path).allocate_layer(scores, torch.tensor([10]), 1).tolist() == [[10, 10]]
    # alpha mixes in the uniform share: 0.5 * 1/2 + 0.5 * 3/4 = 5/8 of 20 entries
    assert Calibrated(path=path, alpha=0.5).allocate_layer(scores, torch.tensor([10]), 0).tolist() == [[13, 7]]


def test_protected_tokens_are_a_floor(tmp_path):
    path = _write(tmp_path / "c.json", [[0.98, 0.01], [0.005, 0.005], [0.0, 0.0]])
    scores = torch.rand(1, 2, 50)
    scores[:, :, :4] = float("inf")  # 4 sinks in each head
    assert Calibrated(path=path).allocate_layer(scores, torch.tensor([5]), 0).tolist() == [[6, 4]]
    # floors that do not fit (2 x 4 > 2 x 3): each head keeps at least min(protected, budget)
    assert Calibrated(path=path).allocate_layer(scores, torch.tensor([3]), 0).tolist() == [[3, 3]]
    # a zero share gets its floor only, until the others are full
    assert Calibrated(path=path).allocate_layer(scores, torch.tensor([30]), 2).tolist() == [[30, 30]]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), H=st.integers(1, 5), n_layers=st.integers(1, 4), B=st.integers(1, 3),
       L=st.integers(1, 40), alpha=st.sampled_from([0.0, 0.2, 1.0]))
def test_exact_totals_and_bounds(tmp_path_factory, data, H, n_layers, B, L, alpha):
    raw = data.draw(st.lists(st.lists(st.floats(0.0, 1.0), min_size=H, max_size=H), min_size=n_layers,
                             max_size=n_layers))
    total = sum(map(sum, raw))
    shares = [[1.0 / (H * n_layers)] * H] * n_layers if total == 0 else [[x / total for x in r] for r in raw]
    shares[0][0] += 1.0 - sum(map(sum, shares))  # exact sum 1 after float noise
    shares[0][0] = max(shares[0][0], 0.0)
    config = LlamaConfig(**{**_COMMON, "num_hidden_layers": n_layers, "num_key_value_heads": H,
                            "num_attention_heads": H, "hidden_size": 16 * H})
    path = _write(tmp_path_factory.mktemp("h") / "c.json", shares, config)
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, L), min_size=B, max_size=B)))
    avg = torch.minimum(torch.tensor(data.draw(st.lists(st.integers(1, L), min_size=B, max_size=B))), lengths)
    budgets = CalibratedLayer(path=path, alpha=alpha).budgets(avg, n_layers, lengths)
    assert torch.equal(budgets.sum(-1), n_layers * avg)
    assert (budgets >= 1).all() and (budgets <= lengths[:, None]).all()
    for layer in range(n_layers):
        scores = torch.rand(B, H, L)
        protected = torch.tensor(data.draw(st.lists(st.integers(0, L), min_size=B * H, max_size=B * H))).view(B, H)
        for b in range(B):
            scores[b, :, : L - int(lengths[b])] = float("-inf")  # left padding
            for h in range(H):
                p = min(int(protected[b, h]), int(lengths[b]))
                scores[b, h, L - p:] = float("inf")
        budget = budgets[:, layer]
        counts = Calibrated(path=path, alpha=alpha).allocate_layer(scores, budget, layer)
        assert torch.equal(counts.sum(-1), H * budget)
        assert (counts >= 0).all() and (counts <= lengths[:, None]).all()
        kept_protected = torch.minimum(protected, lengths[:, None])
        fits = kept_protected.sum(-1) <= H * budget
        floor = torch.where(fits[:, None], kept_protected, torch.minimum(kept_protected, budget[:, None]))
        assert (counts >= floor).all()


# ----------------------------------------------------------------------------- models
def test_refused_for_another_model(tiny_calibration):
    other = build_model("llama", num_hidden_layers=2)
    press = Pipeline(scorer=StreamingLLM(), layers=CalibratedLayer(path=tiny_calibration),
                     allocator=Calibrated(path=tiny_calibration), compression_ratio=0.5)
    with pytest.raises(cal.CalibrationError) as err:
        with press(other):
            pass
    message = str(err.value)
    assert "\n" not in message and "3 layers x 2 kv heads" in message and "2 layers x 2 kv heads" in message
    assert "kvpress-ada calibrate" in message


def test_shipped_preset_refused_on_a_model_without_calibration(llama):
    press = preset("calibrated_streamingllm", compression_ratio=0.5)
    with pytest.raises(cal.CalibrationError, match="smollm2-135m-instruct.*not for 'llama'.*kvpress-ada calibrate"):
        with press(llama):
            pass


def test_shipped_calibration_fits_the_default_model():
    """The shipped file loads and matches the default model's architecture (a config, no weights)."""
    shipped = cal.load(cal.SHIPPED)
    config = default_model_config()
    shipped.check_model(config)
    assert shipped.scorer["name"] == "kvzip" and shipped.seeds["seed"] >= cal.CALIBRATION_SEED
    assert shipped.n == sum(shipped.seeds["samples_per_task"].values()) >= 16 and len(shipped.shares) == 30
    press = preset("calibrated_streamingllm", compression_ratio=0.75)
    assert Pipeline.model_validate_json(press.model_dump_json()) == press
    budgets = press.layers.budgets(torch.tensor([250]), 30, torch.tensor([1000]))
    assert int(budgets.sum()) == 30 * 250


def test_shipped_calibration_fits_qwen_coder_0_5b():
    """The 0.5B model's shipped file and the benchmark config using it fit that architecture only."""
    from pathlib import Path

    import yaml
    shipped = cal.load("builtin:qwen2_5_coder_0_5b_kvzip")
    config = qwen_coder_0_5b_config()
    shipped.check_model(config)
    assert shipped.scorer["name"] == "kvzip" and shipped.seeds["seed"] >= cal.CALIBRATION_SEED
    assert shipped.n == 16 and len(shipped.shares) == 24 and all(len(row) == 2 for row in shipped.shares)
    assert abs(sum(map(sum, shipped.shares)) - 1.0) < 1e-6
    path = Path(__file__).resolve().parents[1] / "benchmarks/configs/qwen2.5-coder-0.5b/calibrated_streamingllm.yaml"
    press = Pipeline.model_validate(yaml.safe_load(path.read_text()))
    press.layers.check_model(config)
    press.allocator.check_model(config)
    default = default_model_config()
    with pytest.raises(cal.CalibrationError, match="qwen2.5-coder-0.5b-instruct") as err:
        press.allocator.check_model(default)
    assert f"this package ships {cal.SHIPPED}" in str(err.value) and " for it " in str(err.value)
    with pytest.raises(cal.CalibrationError) as err:
        cal.load(cal.SHIPPED).check_model(config)
    assert ("this package ships builtin:qwen2_5_coder_0_5b_kvzip and builtin:qwen2_5_coder_0_5b_lukv for it"
            in str(err.value))


@pytest.mark.parametrize("scorer", [StreamingLLM(), SnapKV(window=8)])
def test_ragged_equals_mask_and_batch_equals_rows(tiny, tiny_calibration, scorer):
    def press(**kw):
        return Pipeline(scorer=scorer, layers=CalibratedLayer(path=tiny_calibration),
                        allocator=Calibrated(path=tiny_calibration, alpha=0.2), compression_ratio=0.6, **kw)

    ids, mask = left_padded_batch(seed=4)
    topk = _generate(tiny, press(), ids, mask)
    masked = _generate(tiny, press(evictor=Mask()), ids, mask)
    assert torch.equal(topk.sequences, masked.sequences)
    for a, b in zip(topk.scores, masked.scores):
        assert torch.allclose(a, b, atol=1e-4, rtol=0)
    L = ids.shape[1]
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        alone = _generate(tiny, press(), ids[b:b + 1, L - n:], mask[b:b + 1, L - n:])
        assert torch.equal(alone.sequences[0, n:], topk.sequences[b, L:])


def test_kept_counts_follow_the_calibration(tiny, tiny_calibration):
    """In the real cache, each (layer, head) keeps what the calibrated split gives it."""
    ids, mask = left_padded_batch(seed=5, lengths=(90,))
    press = Pipeline(scorer=StreamingLLM(), layers=CalibratedLayer(path=tiny_calibration),
                     allocator=Calibrated(path=tiny_calibration), compression_ratio=0.5)
    with press(tiny):
        out = tiny(ids, attention_mask=mask, use_cache=True)
    cache = output_cache(out)
    kept = torch.stack([cache.head_lengths(i)[0] for i in range(3)]).double()
    shares = torch.tensor(cal.load(tiny_calibration).shares, dtype=torch.float64)
    assert int(kept.sum()) == 3 * 2 * 45
    # rounding moves a layer's total by < H entries and a head's count by < 1 more
    assert (kept - shares * 3 * 2 * 45).abs().max() < 2.0 + 1e-9


# ----------------------------------------------------------------------------- command line
@pytest.fixture(scope="module")
def tiny_model_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tiny.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def test_cli_calibrate_writes_a_usable_file(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "heads.json"
    assert main(["calibrate", "--model", tiny_model_dir, "--n", "2", "--tasks", "passkey", "--context", str(CONTEXT),
                 "--out", str(out), "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    written = cal.load(str(out))
    assert written.command is not None and written.command[:2] == ["kvpress-ada", "calibrate"]
    config = tmp_path / "calibrated.json"
    config.write_text(json.dumps({"scorer": "streamingllm", "layers": {"name": "calibrated", "path": str(out)},
                                  "allocator": {"name": "calibrated", "path": str(out)}, "compression_ratio": 0.5}))
    assert main(["eval", "--model", tiny_model_dir, "--presets", "", "--config", str(config), "--ratios", "0.5",
                 "--tasks", "passkey", "--n", "1", "--context", str(CONTEXT), "--max-new-tokens", "2",
                 "--out", str(tmp_path / "run"), "--no-progress"]) == 0


@pytest.mark.parametrize("args, message", [
    (["--seed", "0"], "--seed must be >= 10000"),
    (["--ratios", "0,0.5"], "must be in (0, 1)"),
    (["--scorer", "nope"], "unknown scorer 'nope'"),
    (["--tasks", "bogus"], "unknown task 'bogus'"),
    (["--n", "0"], "--n must be >= 1"),
])
def test_cli_calibrate_bad_input_exit_2(args, message, capsys):
    assert main(["calibrate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_eval_refuses_a_calibration_of_another_model(tiny_model_dir, tmp_path, capsys):
    code = main(["eval", "--model", tiny_model_dir, "--presets", "calibrated_streamingllm", "--ratios", "0.5",
                 "--tasks", "passkey", "--n", "1", "--context", str(CONTEXT), "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the model-loading lines: one line
    assert code == 2 and err.startswith("kvpress-ada eval: error: calibrated_streamingllm: calibration")
    assert "calibrated_streamingllm" in err and "smollm2-135m-instruct" in err and "kvpress-ada calibrate" in err
