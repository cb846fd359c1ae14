"""The golden kept sets (``benchmarks/results/selection_golden.json``): every registered preset, in
every mode, on the tiny Llama keeps exactly the recorded entries and generates the recorded tokens.
Recorded with one torch/transformers pair; other versions may round differently (skipped there)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import selection_golden  # noqa: E402

GOLDEN = json.loads(selection_golden.GOLDEN.read_text())


def _run_golden(*args: str) -> subprocess.CompletedProcess:
    """``benchmarks/selection_golden.py ARGS`` in a subprocess (its exit code and one-line errors are the contract)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "selection_golden.py"), *args],
                          capture_output=True, text=True)


@pytest.mark.skipif(GOLDEN["versions"] != selection_golden._versions(),
                    reason=f"golden kept sets recorded with {GOLDEN['versions']}")
def test_every_preset_keeps_the_golden_entries():
    now = selection_golden.collect(default_model=False, archs=("llama",))
    recorded = {k: v for k, v in GOLDEN.items() if k.startswith("llama/")}
    assert len(recorded) > 100 and selection_golden.compare(recorded, now) == []


def test_recording_one_preset_keeps_every_other_record(tmp_path):
    out = tmp_path / "golden.json"
    # the golden file relabelled with this environment's versions (a file of other versions is refused: next test)
    out.write_text(json.dumps({**GOLDEN, "versions": selection_golden._versions()}))
    _run_golden("--record", "--presets", "streamingllm", "--out", str(out)).check_returncode()
    written = json.loads(out.read_text())
    assert {k: v for k, v in written.items() if "/streamingllm/" not in k and k != "versions"} == \
        {k: v for k, v in GOLDEN.items() if "/streamingllm/" not in k and k != "versions"}
    fresh = selection_golden.collect(default_model=False, names=["streamingllm"], archs=("llama",))
    assert {k: v for k, v in written.items() if k.startswith("llama/streamingllm/")} == \
        {k: v for k, v in fresh.items() if k != "versions"} != {}


def test_an_unknown_preset_is_refused_in_one_line():
    done = _run_golden("--check", "--presets", "snapkv,nope")
    assert done.returncode == 2 and "unknown preset(s) nope; known: snapkv" in done.stderr
    assert "Traceback" not in done.stderr


def test_recording_one_preset_into_a_file_of_other_versions_is_refused(tmp_path):
    out = tmp_path / "golden.json"
    out.write_text(json.dumps({**GOLDEN, "versions": {"torch": "0.0", "transformers": "0.0"}}))
    done = _run_golden("--record", "--presets", "streamingllm", "--out", str(out))
    assert done.returncode == 2 and "would mix versions" in done.stderr and "Traceback" not in done.stderr
    assert json.loads(out.read_text())["versions"] == {"torch": "0.0", "transformers": "0.0"}
