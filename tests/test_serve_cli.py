"""``kvpress-ada serve``: the command line it hands vLLM's OpenAI-compatible server (``--dry-run``, no vLLM
needed), and one-line refusals (exit 2) for what the vLLM host cannot serve."""

from __future__ import annotations

import json
import shlex

import pytest

from kvpress_ada.harness.cli import main


def _dry_run(capsys, *args):
    code = main(["serve", "--dry-run", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_server_command_carries_the_press_and_turns_the_host_on(capsys, tmp_path):
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path), "--preset", "ada_snapkv", "--ratio", "0.75",
                            "--port", "8123")
    assert code == 0
    argv = shlex.split(out.strip())
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    option = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert option["--model"] == str(tmp_path) and option["--host"] == "127.0.0.1" and option["--port"] == "8123"
    assert option["--worker-cls"].endswith("PressWorker") and option["--scheduler-cls"].endswith("PressScheduler")
    assert "--no-enable-prefix-caching" in argv and option["--block-size"] == "32"
    press = json.loads(option["--additional-config"])["kvpress_ada"]["press"]
    assert press["scorer"]["name"] == "snapkv" and press["allocator"]["name"] == "ada"
    assert press["compression_ratio"] == 0.75


def test_a_pipeline_file_is_served(capsys, tmp_path):
    config = tmp_path / "press.yaml"
    config.write_text("scorer: {name: streamingllm}\nbudget: 256\n")
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path), "--config", str(config))
    press = json.loads(shlex.split(out)[shlex.split(out).index("--additional-config") + 1])["kvpress_ada"]["press"]
    assert code == 0 and press["scorer"]["name"] == "streamingllm" and press["budget"] == 256


def test_a_chunked_prefill_chunks_the_engine_and_the_press_alike(capsys, tmp_path):
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path), "--preset", "snapkv", "--ratio", "0.5",
                            "--prefill-chunk", "256")
    argv = shlex.split(out.strip())
    press = json.loads(argv[argv.index("--additional-config") + 1])["kvpress_ada"]["press"]
    assert code == 0 and press["prefill_chunk"] == 256 and press["compression_ratio"] == 0.5
    assert argv[argv.index("--long-prefill-token-threshold") + 1] == "256" and "--enable-chunked-prefill" in argv


def test_a_quantized_storage_is_handed_to_the_server(capsys, tmp_path):
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path), "--preset", "ada_snapkv", "--ratio", "0.75",
                            "--storage", "int4")
    argv = shlex.split(out.strip())
    press = json.loads(argv[argv.index("--additional-config") + 1])["kvpress_ada"]["press"]
    assert code == 0 and press["storage"]["name"] == "int4" and press["compression_ratio"] == 0.75, press


def test_decode_compression_is_handed_to_the_server(capsys, tmp_path):
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path), "--preset", "snapkv", "--ratio", "0.75",
                            "--decode-budget", "256", "--decode-interval", "64", "--storage", "int8")
    argv = shlex.split(out.strip())
    press = json.loads(argv[argv.index("--additional-config") + 1])["kvpress_ada"]["press"]
    assert code == 0 and (press["decode_budget"], press["decode_interval"]) == (256, 64), press
    assert press["compression_ratio"] == 0.75 and press["storage"]["name"] == "int8"


@pytest.mark.parametrize("args, words", [
    (["--decode-budget", "256"], "--decode-interval"),
    (["--decode-budget", "0", "--decode-interval", "8"], "--decode-budget"),
    (["--preset", "h2o", "--decode-budget", "64", "--decode-interval", "8"], "decode compression"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--preset", "kvzip"], "model pass"),
    (["--ratio", "1.2"], "--ratio"),
    (["--model", "/no/such/dir"], "/no/such/dir"),
    (["--preset", "snapkv", "--config", "x.yaml"], "not both"),
    (["--preset", "snapkvv"], "snapkvv"),
    (["--port", "0"], "--port"),
])
def test_what_cannot_be_served_is_refused_in_one_line(capsys, tmp_path, args, words):
    code, out, err = _dry_run(capsys, *(["--model", str(tmp_path)] if "--model" not in args else []), *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err, err


def test_a_press_made_for_another_model_is_refused_in_one_line(capsys, tmp_path):
    from conftest import build_model

    build_model("llama").config.save_pretrained(tmp_path)
    code, out, err = _dry_run(capsys, "--model", str(tmp_path), "--preset", "kvzap")  # the default model's surrogate
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "surrogate" in err, err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, out, err = _dry_run(capsys, "--model", str(tmp_path), "--preset", "snapkv")
    assert code == 2 and "gpt2" in err and len(err.strip().splitlines()) == 1
