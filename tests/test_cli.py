"""The kvpress-ada command line on a tiny local model: eval end to end, one-line errors, exit 2."""

import json

import pytest
from conftest import ARCHITECTURES, build_model, build_tokenizer

from kvpress_ada.harness.cli import main


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = build_model("llama", max_position_embeddings=4096)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def test_eval_writes_results_and_plot(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["eval", "--model", tiny_model_dir, "--presets", "snapkv,ada_snapkv", "--ratios", "0.5,0.75",
                 "--tasks", "passkey", "--n", "2", "--context", "300", "--max-new-tokens", "3", "--out", str(out),
                 "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ada_snapkv" in printed and "accuracy" in printed
    data = json.loads((out / "results.json").read_text())
    cells = {(r["label"], r["ratio"]) for r in data["summary"]}
    assert cells == {("full", 0.0), ("snapkv", 0.5), ("snapkv", 0.75), ("ada_snapkv", 0.5), ("ada_snapkv", 0.75)}
    assert (out / "accuracy.png").stat().st_size > 1000


def test_eval_with_config_files(tiny_model_dir, tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("scorer: {name: tova}\nallocator: {name: ada, alpha: 0.5}\ncompression_ratio: 0.5\n")
    chunked = tmp_path / "mine_chunked.yaml"
    chunked.write_text("scorer: {name: tova}\ncompression_ratio: 0.5\nprefill_chunk: 64\n")
    out = tmp_path / "run"
    assert main(["eval", "--model", tiny_model_dir, "--presets", "", "--config", str(config), "--config", str(chunked),
                 "--ratios", "0.5", "--tasks", "passkey", "--n", "1", "--context", "200", "--max-new-tokens", "2",
                 "--out", str(out), "--no-progress"]) == 0
    labels = {r["label"] for r in json.loads((out / "results.json").read_text())["summary"]}
    assert labels == {"full", "mine", "mine_chunked"}


def test_eval_config_at_its_own_ratios(tiny_model_dir, tmp_path):
    """FILE@R rows run at R only (the same file at several ratios, one prefill per sample for all); plain configs
    and presets at every --ratios; a row at R equals the same config run with --ratios R."""
    config = tmp_path / "mine.yaml"
    config.write_text("scorer: {name: tova}\nallocator: {name: ada, alpha: 0.5}\ncompression_ratio: 0.5\n")
    other = tmp_path / "other.yaml"
    other.write_text("scorer: {name: knorm}\ncompression_ratio: 0.5\n")
    common = ["eval", "--model", tiny_model_dir, "--tasks", "passkey", "--n", "1", "--context", "200",
              "--max-new-tokens", "2", "--no-progress"]
    out = tmp_path / "run"
    assert main([*common, "--presets", "snapkv", "--config", f"{config}@0.25", "--config", f"{config}@0.75",
                 "--config", str(other), "--ratios", "0.5", "--out", str(out)]) == 0
    records = json.loads((out / "results.json").read_text())["records"]
    cells = {(r["label"], r["ratio"]) for r in records}
    assert cells == {("full", 0.0), ("snapkv", 0.5), ("mine", 0.25), ("mine", 0.75), ("other", 0.5)}
    alone = tmp_path / "alone"
    assert main([*common, "--presets", "", "--config", str(config), "--ratios", "0.75", "--out", str(alone)]) == 0
    single = [r for r in json.loads((alone / "results.json").read_text())["records"] if r["label"] == "mine"]
    at = [r for r in records if r["label"] == "mine" and r["ratio"] == 0.75]
    assert [(r["answer"], r["kv_bytes"]) for r in at] == [(r["answer"], r["kv_bytes"]) for r in single]


@pytest.mark.parametrize("args, message", [
    (["--presets", "snapkv,nope"], "unknown preset 'nope'; valid presets: snapkv"),
    (["--tasks", "passkey,bogus"], "unknown task 'bogus'; valid tasks: passkey"),
    (["--ratios", "0.5,1.0"], "--ratios must be in [0, 1)"),
    (["--ratios", "abc"], "comma-separated numbers"),
    (["--n", "0"], "--n must be >= 1"),
    (["--config", "/no/such/file.json"], "no such file"),
])
def test_eval_bad_input_one_line_exit_2(args, message, capsys):
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_context_longer_than_model_supports(tiny_model_dir, capsys):
    assert main(["eval", "--model", tiny_model_dir, "--context", "5000", "--n", "1"]) == 2
    assert "longer than the model supports (4096" in capsys.readouterr().err


def test_demo_bad_ratio(capsys):
    assert main(["demo", "--ratio", "1.5"]) == 2
    assert "--ratio must be in [0, 1)" in capsys.readouterr().err


def test_bad_config_content(tmp_path, capsys):
    config = tmp_path / "bad.json"
    config.write_text('{"scorer": {"name": "snapkv"}, "compression_ratio": 2}')
    assert main(["eval", "--config", str(config)]) == 2
    assert "compression_ratio" in capsys.readouterr().err


def test_demo_runs_on_a_local_model(tiny_model_dir, capsys):
    assert main(["demo", "--model", tiny_model_dir, "--context", "300", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "full cache" in out and "kvzip @ 75%" in out and "KV bytes" in out
    assert "ada_snapkv @" not in out  # the weaker presses are a flag away, not shown by default


def test_demo_compare_shows_each_preset_once(tiny_model_dir, capsys):
    args = ["demo", "--model", tiny_model_dir, "--context", "300", "--max-new-tokens", "2", "--ratio", "0.5"]
    assert main([*args, "--preset", "snapkv", "--compare", "ada_snapkv,streamingllm"]) == 0
    table = [line.split()[0] for line in capsys.readouterr().out.splitlines() if " @ 50%" in line]
    assert table == ["snapkv", "ada_snapkv", "streamingllm"]
    assert main([*args, "--preset", "snapkv", "--compare", "snapkv"]) == 2
    assert "--compare lists the main --preset 'snapkv' again" in capsys.readouterr().err
    assert main([*args, "--compare", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_bad_threads(capsys):
    assert main(["eval", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_eval_interleaves_the_tasks(tiny_model_dir, tmp_path):
    """Sample i is task i % len(tasks), so a run cut short (its checkpoint) covers every task alike."""
    out = tmp_path / "run"
    assert main(["eval", "--model", tiny_model_dir, "--presets", "streamingllm", "--ratios", "0.5",
                 "--tasks", "passkey,multikey", "--n", "2", "--context", "600", "--max-new-tokens", "2",
                 "--out", str(out), "--no-progress"]) == 0
    records = json.loads((out / "results.json").read_text())["records"]
    order = [(r["sample"], r["task"]) for r in records if r["label"] == "full"]
    assert order == [(0, "passkey"), (1, "multikey"), (2, "passkey"), (3, "multikey")]


def test_resume_refuses_a_checkpoint_of_the_task_by_task_order(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    args = ["eval", "--model", tiny_model_dir, "--presets", "streamingllm", "--ratios", "0.5", "--tasks",
            "passkey,multikey", "--n", "2", "--context", "600", "--max-new-tokens", "2", "--out", str(out),
            "--no-progress", "--resume"]
    from kvpress_ada.harness.cli import _settings, build_parser
    from kvpress_ada.harness.eval.runner import grid

    settings = _settings(build_parser().parse_args(args), ["passkey", "multikey"], grid(["streamingllm"], [0.5]))
    del settings["sample_order"]  # what a checkpoint of the task-by-task order holds
    (out / "partial.json").write_text(json.dumps({"settings": settings, "seconds": 1.0, "records": []}))
    assert main(args) == 2
    assert "was written with another sample_order;" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_eval_runs_every_family_from_a_local_directory(arch, tmp_path):
    """`kvpress-ada eval --model DIR` loads a saved tiny model of each family and evaluates a press on it (a hybrid
    family: the press compresses its global layers and the records count every layer's bytes)."""
    path = tmp_path / arch
    build_model(arch, max_position_embeddings=4096).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    out = tmp_path / "run"
    code = main(["eval", "--model", str(path), "--presets", "snapkv", "--ratios", "0.75", "--tasks", "passkey",
                 "--n", "1", "--context", "300", "--max-new-tokens", "2", "--out", str(out), "--no-progress"])
    assert code == 0
    records = json.loads((out / "results.json").read_text())["records"]
    by = {r["label"]: r for r in records}
    assert set(by) == {"full", "snapkv"}
    assert 0 < by["snapkv"]["kv_bytes"] < by["full"]["kv_bytes"]
