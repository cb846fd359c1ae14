"""The command line under hostile input: one-line errors, exit codes, Ctrl-C and --resume.

The model loader is replaced by a tiny random Llama and the char tokenizer; ``loads`` records every
load, so a test can check that bad input is refused before the model is loaded.
"""

import json
import os

import pytest
from conftest import build_model, build_tokenizer

import kvpress_ada.harness.cli as cli
from kvpress_ada.harness.cli import main
from kvpress_ada.harness.eval import runner
from kvpress_ada.harness.eval.tasks import TASKS

SMALL = ["--presets", "snapkv", "--ratios", "0.5", "--tasks", "passkey", "--n", "1", "--context", "300",
         "--max-new-tokens", "2", "--no-progress"]


@pytest.fixture(scope="module")
def tiny():
    return build_model("llama", max_position_embeddings=4096), build_tokenizer()


@pytest.fixture
def loads(tiny, monkeypatch):
    calls = []

    def load(name):
        calls.append(name)
        return tiny

    monkeypatch.setattr(cli, "_load_model", load)
    return calls


def run(argv, capsys):
    """``main(argv)``'s exit code and stderr; a KeyboardInterrupt escaping main fails the test (not pytest)."""
    try:
        code = main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main()")
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------- config errors


@pytest.mark.parametrize("name, text, message", [
    ("broken.yaml", "scorer: [\n", "not valid YAML: expected the node content, but found '<stream end>' (line 2"),
    ("broken.yaml", "scorer: {name: snapkv\ncompression_ratio: 0.5\n", "not valid YAML: "),
    ("five.yaml", "scorer: 5\ncompression_ratio: 0.5\n", "invalid pipeline: cannot build a scorer from int: 5"),
    ("list.yaml", "- scorer\n", "invalid pipeline: top level: Input should be a valid dictionary"),
    ("empty.yaml", "", "invalid pipeline: top level: Input should be a valid dictionary"),
    ("cut.json", '{"scorer": ', "not valid JSON: EOF while parsing a value at line 1 column 11"),
    ("ratio.json", '{"scorer": {"name": "snapkv"}, "compression_ratio": 2}',
     "invalid pipeline: compression_ratio: Input should be less than 1"),
    ("nan.yaml", "scorer: snapkv\nallocator: {name: threshold, tau: .nan}\n",
     "invalid pipeline: allocator.tau: Input should be a finite number"),
])
def test_bad_config_one_line_exit_2(tmp_path, loads, capsys, name, text, message):
    config = tmp_path / name
    config.write_text(text)
    code, err = run(["eval", "--config", str(config), "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert one_line(err).startswith(f"kvpress-ada eval: error: --config {config}: {message}")
    assert loads == []


# ----------------------------------------------------------------- --out checked first


def test_out_under_a_file_refused_before_any_work(tmp_path, loads, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "run"
    code, err = run(["eval", "--model", "tiny", *SMALL, "--out", str(out)], capsys)
    assert code == 2
    assert one_line(err) == f"kvpress-ada eval: error: --out {out}: cannot write results there: Not a directory"
    assert loads == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write to read-only dirs")
def test_read_only_out_refused_before_any_work(tmp_path, loads, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    code, err = run(["eval", "--model", "tiny", *SMALL, "--out", str(out)], capsys)
    assert code == 2
    assert one_line(err) == f"kvpress-ada eval: error: --out {out}: cannot write results there: Permission denied"
    assert loads == []


def test_out_created_before_the_model_loads(tmp_path, tiny, monkeypatch, capsys):
    out = tmp_path / "a" / "b"
    seen = []
    monkeypatch.setattr(cli, "_load_model", lambda name: seen.append(out.is_dir()) or tiny)
    code, _ = run(["eval", "--model", "tiny", *SMALL, "--out", str(out)], capsys)
    assert code == 0 and seen == [True]
    assert [p.name for p in out.iterdir() if p.name.startswith(".write-probe")] == []


# ----------------------------------------------------------------- consistency


def test_demo_unknown_preset_exit_2(loads, capsys):
    code, err = run(["demo", "--preset", "nope"], capsys)
    assert code == 2
    assert one_line(err).startswith("kvpress-ada demo: error: unknown preset 'nope'; valid presets: snapkv, ")
    assert loads == []


@pytest.mark.parametrize("command", [["demo"], ["eval", *SMALL]])
def test_max_new_tokens_0_refused(command, loads, capsys):
    code, err = run([*command, "--model", "tiny", "--max-new-tokens", "0"], capsys)
    assert code == 2
    assert one_line(err) == f"kvpress-ada {command[0]}: error: --max-new-tokens must be >= 1, got 0"
    assert loads == []


@pytest.mark.parametrize("argv, message", [
    (["eval", *SMALL, "--tasks", "multikey"],
     "kvpress-ada eval: error: --context 300 is too small for task 'multikey' with this tokenizer; "
     "use --context >= 541"),
    (["demo", "--context", "100"],
     "kvpress-ada demo: error: --context 100 is too small for task 'passkey' with this tokenizer; "
     "use --context >= 236"),
    (["eval", *SMALL[:4], "--tasks", "passkey,multikey", "--n", "1", "--context", "100"],
     "kvpress-ada eval: error: --context 100 is too small for tasks 'passkey', 'multikey' with this tokenizer; "
     "use --context >= 541"),
    (["distill", "--tasks", "passkey,multikey", "--context", "100"],
     "kvpress-ada distill: error: --context 100 is too small for tasks 'passkey', 'multikey' with this tokenizer; "
     "use --context >= 542"),
])
def test_context_too_small_for_task_exit_2(argv, message, loads, tmp_path, capsys):
    code, err = run([*argv, "--model", "tiny"] + (["--out", str(tmp_path)] if argv[0] == "eval" else []), capsys)
    assert code == 2
    assert one_line(err) == message


@pytest.mark.parametrize("option, value, shown", [
    ("--presets", "snapkv,ada_snapkv,snapkv", "'snapkv'"),
    ("--ratios", "0.5,0.50", "0.5"),
    ("--tasks", "passkey,passkey", "'passkey'"),
])
def test_duplicates_refused(option, value, shown, loads, tmp_path, capsys):
    code, err = run(["eval", "--model", "tiny", *SMALL, option, value, "--out", str(tmp_path)], capsys)
    assert code == 2
    assert one_line(err) == f"kvpress-ada eval: error: {option} lists {shown} twice; give each value once"
    assert loads == []


@pytest.mark.parametrize("suffix, message", [
    ("@0.5x", "the ratio after @ must be a number in [0, 1), got '0.5x'"),
    ("@1", "the ratio after @ must be a number in [0, 1), got '1'"),
    ("@-0.1", "the ratio after @ must be a number in [0, 1), got '-0.1'"),
])
def test_config_at_bad_ratio_refused(suffix, message, loads, tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("scorer: {name: tova}\ncompression_ratio: 0.5\n")
    code, err = run(["eval", "--model", "tiny", *SMALL, "--config", f"{config}{suffix}", "--out", str(tmp_path)],
                    capsys)
    assert code == 2
    assert one_line(err) == f"kvpress-ada eval: error: --config {config}{suffix}: {message}"
    assert loads == []


@pytest.mark.parametrize("first, second, message", [
    ("@0.25", "@0.25", "--config {config}@0.25: given twice; give each file@ratio once"),
    # a file at every --ratios and the same file at its own ratio would give two rows of one label and ratio
    ("", "@0.25", "--config {config}: its label 'mine' (the file name) is also another row's label (a preset or an "
                  "earlier --config); rename the file so every row has its own label"),
])
def test_config_at_ratio_given_twice_refused(first, second, message, loads, tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("scorer: {name: tova}\ncompression_ratio: 0.5\n")
    code, err = run(["eval", "--model", "tiny", *SMALL, "--config", f"{config}{first}", "--config",
                     f"{config}{second}", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert one_line(err) == "kvpress-ada eval: error: " + message.format(config=config)
    assert loads == []


@pytest.mark.parametrize("stem, taken, earlier", [
    ("snapkv", "another row's label (a preset or an earlier --config)", False),
    ("full", "the full-cache row", False),
    ("mine", "another row's label (a preset or an earlier --config)", True),
])
def test_config_label_collision_refused(stem, taken, earlier, loads, tmp_path, capsys):
    config = tmp_path / f"{stem}.yaml"
    config.write_text("scorer: {name: tova}\ncompression_ratio: 0.5\n")
    first = []
    if earlier:  # the same file name in another folder, given first
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / f"{stem}.yaml").write_text("scorer: {name: knorm}\ncompression_ratio: 0.5\n")
        first = ["--config", str(tmp_path / "other" / f"{stem}.yaml")]
    code, err = run(["eval", "--model", "tiny", *SMALL, *first, "--config", str(config), "--out", str(tmp_path)],
                    capsys)
    assert code == 2
    assert one_line(err) == (f"kvpress-ada eval: error: --config {config}: its label {stem!r} (the file name) is "
                             f"also {taken}; rename the file so every row has its own label")
    assert loads == []


def test_model_load_failure_is_one_line_exit_1(monkeypatch, tmp_path, capsys):
    from kvpress_ada.models import ModelLoadError

    def fail(name):
        raise ModelLoadError(f"cannot load {name!r}:\nno such directory")

    monkeypatch.setattr(cli, "_load_model", fail)
    code, err = run(["eval", "--model", "nowhere", *SMALL, "--out", str(tmp_path)], capsys)
    assert code == 1
    assert one_line(err) == "kvpress-ada eval: error: cannot load 'nowhere': no such directory"


def test_eval_help_lists_tasks_with_descriptions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for spec in TASKS.values():
        assert any(line.split() == [spec.name, *spec.description.split()] for line in lines), spec.name


# ----------------------------------------------------------------- Ctrl-C and --resume


def interrupt_at(monkeypatch, index, partial, seen):
    """Make the runner raise KeyboardInterrupt when it starts sample ``index``; record what is on disk then."""
    original = runner.evaluate_sample

    def evaluate_sample(model, tok, sample, entries, i, *args, **kwargs):
        if i == index:
            seen.append(json.loads(partial.read_text())["samples_done"] if partial.exists() else None)
            raise KeyboardInterrupt
        return original(model, tok, sample, entries, i, *args, **kwargs)

    monkeypatch.setattr(runner, "evaluate_sample", evaluate_sample)
    return original


def test_ctrl_c_keeps_partial_results_and_resume_equals_uninterrupted(tmp_path, loads, monkeypatch, capsys):
    argv = ["eval", "--model", "tiny", *SMALL, "--n", "3", "--ratios", "0.5,0.75"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run([*argv, "--out", str(whole)], capsys)[0] == 0

    partial, seen = part / "partial.json", []
    original = interrupt_at(monkeypatch, 2, partial, seen)
    code, err = run([*argv, "--out", str(part)], capsys)
    assert code == 130
    assert seen == [2]  # checkpointed after every sample, before the interrupt
    resume = " ".join(["kvpress-ada", *argv, "--out", str(part), "--resume"])
    assert one_line(err) == (f"kvpress-ada eval: interrupted after 2 of 3 samples, kept in {partial}; "
                             f"continue with: {resume}")
    assert not (part / "results.json").exists()
    kept = json.loads(partial.read_text())
    assert kept["samples_done"] == 2 and sorted({r["sample"] for r in kept["records"]}) == [0, 1]

    code, err = run([*argv, "--out", str(part), "--resume", "--max-new-tokens", "3"], capsys)
    assert code == 2
    assert one_line(err) == (f"kvpress-ada eval: error: --resume: {partial} was written with another max_new_tokens; "
                             "rerun with the same arguments, or without --resume to start over")

    ran = []
    monkeypatch.setattr(runner, "evaluate_sample", lambda *a, **k: ran.append(a[4]) or original(*a, **k))
    assert run([*argv, "--out", str(part), "--resume"], capsys)[0] == 0
    assert ran == [2] and not partial.exists()
    expected, resumed = (json.loads((d / "results.json").read_text()) for d in (whole, part))
    assert json.dumps(resumed["summary"]) == json.dumps(expected["summary"])
    assert resumed["records"] == expected["records"]


def test_ctrl_c_before_the_first_sample_keeps_an_older_partial(tmp_path, loads, monkeypatch, capsys):
    partial = tmp_path / "partial.json"
    partial.write_text("older")
    interrupt_at(monkeypatch, 0, tmp_path / "none", [])
    code, err = run(["eval", "--model", "tiny", *SMALL, "--out", str(tmp_path)], capsys)
    assert code == 130
    note, last = err.strip().splitlines()
    assert note == (f"kvpress-ada eval: note: {partial} (an interrupted run) will be replaced; stop now and pass "
                    "--resume to continue it instead")
    assert last == "kvpress-ada eval: interrupted before the first sample finished; nothing to keep"
    assert partial.read_text() == "older"


def test_resume_without_partial_runs_everything(tmp_path, loads, capsys):
    code, err = run(["eval", "--model", "tiny", *SMALL, "--out", str(tmp_path), "--resume"], capsys)
    assert code == 0
    assert f"note: nothing to resume ({tmp_path / 'partial.json'} does not exist)" in err
    assert json.loads((tmp_path / "results.json").read_text())["summary"][0]["n"] == 1


def test_resume_from_a_foreign_file_refused(tmp_path, loads, capsys):
    (tmp_path / "partial.json").write_text('{"something": "else"}')
    code, err = run(["eval", "--model", "tiny", *SMALL, "--out", str(tmp_path), "--resume"], capsys)
    assert code == 2
    assert one_line(err).startswith(f"kvpress-ada eval: error: --resume: {tmp_path / 'partial.json'} is not a "
                                    "partial-results file of kvpress-ada eval")
    assert loads == []


def test_ctrl_c_while_loading_the_model_exit_130(monkeypatch, tmp_path, capsys):
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load_model", interrupted)
    code, err = run(["eval", *SMALL, "--out", str(tmp_path)], capsys)
    assert code == 130
    assert one_line(err) == "kvpress-ada eval: interrupted"
