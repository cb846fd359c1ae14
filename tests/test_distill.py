"""``kvpress-ada distill``: training texts, collection of (hidden state, log teacher score) pairs, and the
whole command on a tiny model."""

import pytest
import torch
from conftest import build_model, build_tokenizer

from kvpress_ada import KVzip
from kvpress_ada import surrogate as sur
from kvpress_ada.harness.cli import main
from kvpress_ada.harness.distill import (
    FLOOR,
    collect_pairs,
    distill,
    documentation_texts,
    heldout,
    training_texts,
)
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.tokens import encode

CONTEXT = 300  # the char tokenizer's passkey fits in 300 tokens


@pytest.fixture(scope="module")
def tiny():
    return build_model("llama", max_position_embeddings=4096)


def test_training_texts_never_use_evaluation_seeds():
    tok = build_tokenizer()
    with pytest.raises(ValueError, match="seeds start at 10000"):
        training_texts(tok, 4, CONTEXT, ["passkey"], seed=0)
    texts = training_texts(tok, 8, 600, ["passkey", "multikey"])
    assert [t.source for t in texts] == ["passkey", "multikey", "passkey", "documentation",
                                          "multikey", "passkey", "multikey", "documentation"]
    assert texts == training_texts(tok, 8, 600, ["passkey", "multikey"])  # deterministic
    from kvpress_ada.harness.eval.tasks import make_samples

    evaluation = {s.context for task in ("passkey", "multikey") for s in make_samples(task, tok, 8, 600, seed=0)}
    assert not any(e in t.prompt for t in texts for e in evaluation)


def test_documentation_texts_fit_the_context():
    tok = build_tokenizer()
    texts = documentation_texts(tok, 3, 400)
    assert len(set(texts)) == 3 and texts == documentation_texts(tok, 3, 400)
    for text in texts:
        assert 390 <= len(tok(text, add_special_tokens=False)["input_ids"]) <= 402


def test_heldout_split():
    assert heldout(10) == [False, False, False, False, True] * 2
    assert heldout(3) == [False, False, True]  # at least one held out


def test_pairs_are_the_hidden_states_and_log_teacher_scores(tiny):
    """What is collected is what capture_prefill records and the teacher's pass measures."""
    tok = build_tokenizer()
    texts = training_texts(tok, 2, CONTEXT, ["passkey"])
    teacher = KVzip(chunk=128)
    pairs = collect_pairs(tiny, tok, teacher, texts, [False, True], keep_per_text=50, progress=False)
    ids = encode(tok, texts[1].prompt, "cpu")
    prefill = capture_prefill(tiny, ids, hidden_states=True)
    scores = prefill.pass_scores(teacher)
    skip = teacher.sinks
    for layer in range(3):
        torch.testing.assert_close(pairs.held_x[layer][0].float(), prefill.layers[layer].hidden[0, skip:],
                                   atol=2e-3, rtol=1e-3)  # stored in float16
        torch.testing.assert_close(pairs.held_y[layer][0], scores[layer][0, :, skip:].clamp_min(FLOOR).log())
        assert pairs.fit_x[layer][0].shape == (50, 64) and pairs.fit_y[layer][0].shape == (50, 2)
    first = len(encode(tok, texts[0].prompt, "cpu")[0]) - skip
    assert pairs.stats[0].n == first and pairs.tokens == {"train": first, "fit": 50, "heldout": ids.shape[1] - skip}


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_distill_end_to_end(tiny, tmp_path, kind):
    made = distill(tiny, build_tokenizer(), "kvzip", kind, n=5, context=CONTEXT, tasks=["passkey"], epochs=2,
                   width=8, progress=False)
    path = tmp_path / "tiny.safetensors"
    sur.save(made, path)
    loaded = sur.load(str(path))
    loaded.check_model(tiny.config)
    meta = loaded.meta
    assert meta.kind == kind and meta.teacher["name"] == "kvzip" and meta.target["floor"] == FLOOR
    assert meta.training["n_train"] == 4 and meta.training["n_heldout"] == 1
    assert meta.training["texts"] == {"passkey": 4, "documentation": 1}
    assert meta.dtype == ("float16" if kind == "mlp" else "float32")
    assert len(meta.fit["r2"]) == 3 and set(meta.fit["recall"]) == {"0.5", "0.75"}
    hidden = capture_prefill(tiny, torch.randint(4, 100, (2, 20)), hidden_states=True).layers[2].hidden
    out = loaded.predict(hidden, 2)
    assert out.shape == (2, 2, 20) and bool(torch.isfinite(out).all())


def test_distill_plus_teacher(tiny):
    made = distill(tiny, build_tokenizer(), "kvzip_plus", "linear", n=2, context=CONTEXT, tasks=["passkey"],
                   progress=False)
    assert made.teacher["plus"] is True and made.meta.training["n_heldout"] == 1


# ----------------------------------------------------------------------------- command line
@pytest.fixture(scope="module")
def tiny_model_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tiny.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def test_cli_distill_writes_a_usable_file(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "s.safetensors"
    assert main(["distill", "--model", tiny_model_dir, "--teacher", "kvzip", "--kind", "linear", "--n", "3",
                 "--tasks", "passkey", "--context", str(CONTEXT), "--out", str(out), "--no-progress",
                 "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "held-out" in printed and "R^2" in printed and f"wrote {out}" in printed
    loaded = sur.load(str(out))
    assert loaded.meta.command is not None and loaded.meta.command[:2] == ["kvpress-ada", "distill"]
    assert loaded.meta.training["n"] == 3


@pytest.mark.parametrize("args, message", [
    (["--seed", "0"], "--seed must be >= 10000"),
    (["--n", "1"], "--n must be >= 2"),
    (["--tasks", "bogus"], "unknown task 'bogus'"),
    (["--context", "10"], "--context must be >= 64"),
    (["--width", "0"], "--width must be >= 1"),
    (["--kind", "linear", "--width", "32"], "--width applies to --kind mlp and gate only"),
    (["--kind", "linear", "--epochs", "3"], "--epochs applies to --kind mlp and gate only"),
])
def test_cli_distill_bad_input_exit_2(args, message, capsys):
    assert main(["distill", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_distill_out_is_a_directory(tmp_path, capsys):
    assert main(["distill", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
