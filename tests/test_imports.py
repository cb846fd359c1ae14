"""What importing costs: ``import kvpress_ada`` and the command line's ``--help`` and argument errors import
nothing heavy, the transformers host loads (and registers its attention with transformers) only when a press
is applied, and the CLI's light name lists agree with the registries. Each check runs in a fresh interpreter
and reads its ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import kvpress_ada
from kvpress_ada.harness import choices
from kvpress_ada.harness.cli import main

HEAVY = ("torch", "pydantic", "transformers", "triton", "vllm")


def fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter; it fills the dict ``out``, returned here with ``heavy``: the heavy
    packages imported by then."""
    script = ("import json, sys\nout = {}\n" + textwrap.dedent(code)
              + f"\nout['heavy'] = [m for m in {HEAVY!r} if m in sys.modules]\nprint(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_the_package_imports_nothing_heavy():
    out = fresh("import kvpress_ada")
    assert out["heavy"] == []


def test_the_kernels_import_torch_but_not_triton():
    assert fresh("import kvpress_ada.kernels")["heavy"] == ["torch"]


def test_the_policy_imports_torch_and_pydantic_but_no_engine():
    out = fresh("""
        import kvpress_ada
        press = kvpress_ada.preset("ada_snapkv", compression_ratio=0.5)
        from kvpress_ada import Int4, Pipeline, SnapKV
        Pipeline(scorer=SnapKV(), compression_ratio=0.5, storage=Int4())
    """)
    assert out["heavy"] == ["torch", "pydantic"]


def test_the_host_registers_its_attention_when_a_press_is_applied_not_at_import():
    out = fresh("""
        import torch
        from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
        from transformers.masking_utils import AttentionMaskInterface
        import kvpress_ada
        out["at_import"] = "kvpress_ada" in AttentionInterface() or "kvpress_ada" in AttentionMaskInterface()
        import kvpress_ada.hosts.transformers
        out["host_imported"] = "kvpress_ada" in AttentionInterface()
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=256)).eval()
        with torch.inference_mode(), kvpress_ada.preset("snapkv", compression_ratio=0.5)(model):
            out["cache"] = type(model(torch.arange(1, 81)[None] % 64).past_key_values).__name__
        out["applied"] = ["kvpress_ada" in AttentionInterface(), "kvpress_ada" in AttentionMaskInterface()]
    """)
    assert out["at_import"] is False and out["host_imported"] is False
    assert out["cache"] == "RaggedCache" and out["applied"] == [True, True]


def test_press_finds_the_transformers_host_without_importing_it_first():
    out = fresh("""
        import torch
        from kvpress_ada.hosts.base import host_for
        out["loaded_before"] = "kvpress_ada.hosts.transformers" in sys.modules
        model = torch.nn.Module()
        model.config = object()
        out["host"] = host_for(model).name
    """)
    assert out["loaded_before"] is False and out["host"] == "transformers"
    assert "transformers" in out["heavy"]


def test_every_public_name_is_still_there():
    assert sorted(kvpress_ada._EXPORTS) == sorted(kvpress_ada.__all__)  # each listed name says where it lives
    assert set(kvpress_ada.__all__) <= set(dir(kvpress_ada))
    for name in kvpress_ada.__all__:
        assert getattr(kvpress_ada, name) is not None, name
    from kvpress_ada import RaggedCache, generate
    from kvpress_ada.hosts import transformers as host

    assert RaggedCache is host.RaggedCache and generate.__module__ == "kvpress_ada.hosts.transformers.generation"
    assert kvpress_ada.hosts.base.host_names()[0] == "transformers"
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        kvpress_ada.nothing_here  # noqa: B018


HELP_AND_BAD_ARGUMENTS = [
    ["--help"], ["demo", "--help"], ["eval", "--help"], ["serve", "--help"], ["calibrate", "--help"],
    ["distill", "--help"], [], ["nope"], ["eval", "--storage", "int3"], ["eval", "--presets", "nope"],
    ["eval", "--tasks", "nope"], ["eval", "--ratios", "2"], ["eval", "--n", "0"], ["eval", "--workers", "0"],
    ["eval", "--prefill-chunk", "0"], ["eval", "--decode-budget", "4"], ["eval", "--threads", "0"],
    ["demo", "--preset", "nope"], ["demo", "--compare", "snapkv,snapkv"], ["demo", "--ratio", "1.5"],
    ["demo", "--context", "10"], ["serve", "--ratio", "2"], ["serve", "--port", "0"],
    ["serve", "--model", "/no/such/dir", "--dry-run"], ["calibrate", "--scorer", "nope"],
    ["calibrate", "--seed", "3"], ["calibrate", "--ratios", "0"], ["distill", "--kind", "linear", "--width", "8"],
    ["distill", "--n", "1"], ["distill", "--epochs", "0"],
]


def test_help_and_argument_errors_answer_before_torch_is_imported():
    out = fresh(f"""
        import contextlib, io
        from kvpress_ada.harness.cli import main
        out["runs"] = []
        for argv in {HELP_AND_BAD_ARGUMENTS!r}:
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as exit:
                    code = exit.code
            out["runs"].append([argv, code, err.getvalue().strip().splitlines()[-1:],
                                [m for m in {HEAVY!r} if m in sys.modules]])
    """)
    assert out["heavy"] == []
    for argv, code, last, heavy in out["runs"]:
        assert heavy == [], argv
        assert code == (0 if "--help" in argv else 2), (argv, code, last)
        assert "--help" in argv or "error" in last[0], (argv, last)


def test_the_light_name_lists_equal_the_registries():
    out = fresh("""
        from kvpress_ada.harness import choices
        out["light"] = [choices.preset_names(), choices.scorer_names(), choices.storage_names()]
        from kvpress_ada.calibration import CALIBRATION_SEED
        from kvpress_ada.presets import preset_names
        from kvpress_ada.scorers import SCORERS
        from kvpress_ada.storage import STORAGES
        out["registries"] = [preset_names(), SCORERS.names(), ["full", *(n for n in STORAGES.names() if n != "full")]]
        out["answers"] = [choices.preset_names(), choices.scorer_names(), choices.storage_names()]
        out["aliases"] = sorted(SCORERS.aliases())
        out["seed"] = CALIBRATION_SEED
    """)
    assert out["light"] == out["registries"] == out["answers"]
    assert out["aliases"] == sorted(choices.SCORER_ALIASES) and out["seed"] == choices.CALIBRATION_SEED


def test_a_registered_preset_is_accepted_once_the_registry_is_loaded(capsys):
    from kvpress_ada.presets import register_preset, unregister_preset
    from kvpress_ada.scorers import SnapKV

    assert "mine" not in choices.PRESETS
    register_preset("mine", lambda: dict(scorer=SnapKV()))
    try:
        assert "mine" in choices.preset_names()
        assert main(["eval", "--presets", "mine", "--ratios", "0.5", "--tasks", "nope"]) == 2
        assert "unknown task 'nope'" in capsys.readouterr().err  # the preset passed
    finally:
        unregister_preset("mine")
    assert "mine" not in choices.preset_names()
