"""The golden kept sets (``tests/fixtures/selection_golden.json``, written by ``benchmarks/selection_golden.py``).

Two comparisons, both exact:

- **policy**: ``Pipeline.keep`` of every preset on fixed random tensors (uniform, per-head ragged and capped views of
  a left-padded batch of two rows, three layers): no model and no transformers, so one set of records serves every
  transformers release;
- **end to end**: every preset in every mode (one-shot, chunked prefill, decode compression after a compressed or a
  full prefill, fan-out, the mask evictor, each again with int4 storage) on a left-padded batch of two rows, on the
  tiny model of each supported family: the positions each (layer, row, kv head) keeps and the generated tokens.
  These records are filed under a digest of what the model computes without a press (prefill and greedy steps, bit
  for bit): where it equals a recorded one only the selection code can differ. A transformers release (or machine)
  that rounds differently has no records yet and fails in one line naming the command below.

Regenerate, at a commit whose kept sets you trust, once per environment (CI's: the newest transformers and 5.18.0)::

    python benchmarks/selection_golden.py --record
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import selection_golden  # noqa: E402

GOLDEN = selection_golden.load()


def _run_golden(*args: str) -> subprocess.CompletedProcess:
    """``benchmarks/selection_golden.py ARGS`` in a subprocess (its exit code and one-line errors are the contract)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "selection_golden.py"), *args],
                          capture_output=True, text=True)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_preset_keeps_the_golden_entries(arch):
    [(variant, now)] = selection_golden.collect(default_model=False, archs=(arch,)).items()
    if variant not in GOLDEN["variants"]:
        pytest.fail(selection_golden.missing_message(variant, GOLDEN), pytrace=False)
    recorded = GOLDEN["variants"][variant]["records"]
    assert len(recorded) > 200 and sum("refused" not in r for r in recorded.values()) > 150
    assert selection_golden.compare(recorded, now["records"]) == []


def test_every_preset_keeps_the_golden_entries_from_fixed_tensors():
    recorded = GOLDEN["policy"]["records"]
    assert set(recorded) == {f"{n}/{c}" for n in selection_golden.preset_names() for c in selection_golden.POLICY_CASES}
    # refused on fixed tensors: only presets tied to one model's files (calibrated budgets, Q-filters, query statistics)
    refused = {key.split("/")[0] for key, r in recorded.items() if "refused" in r}
    assert refused <= {"calibrated_streamingllm", "lukv", "qfilter", "expected_attention_stats"}, refused
    assert selection_golden.compare(recorded, selection_golden.policy_records()) == []


def test_every_mode_and_storage_is_recorded_and_some_of_each_run():
    for variant, entry in GOLDEN["variants"].items():
        ran = {key.split("/", 2)[2] for key, r in entry["records"].items() if "refused" not in r}
        modes = {*selection_golden.MODES, "one_shot_mask", *(f"{m}_int4" for m in selection_golden.STORAGE_MODES)}
        assert ran == modes, (variant, modes - ran)
    assert {v.split("@")[0] for v in GOLDEN["variants"]} >= set(ARCHITECTURES)


def _golden_here(tmp_path) -> tuple[Path, str]:
    """A copy of the golden file and the variant key of the tiny Llama in this environment (its records copied
    from a recorded variant when this environment's numerics have none: the tests below only move records)."""
    out = tmp_path / "golden.json"
    model, tokenizer = selection_golden.tiny_model("llama")
    with torch.no_grad():
        variant = f"llama@{selection_golden.numerics(model, tokenizer, selection_golden.TINY_LENGTHS, 10)}"
    variants = dict(GOLDEN["variants"])
    if variant not in variants:
        variants[variant] = next(v for k, v in variants.items() if k.startswith("llama@"))
    out.write_text(json.dumps({"variants": variants}))
    return out, variant


def test_recording_one_preset_keeps_every_other_record(tmp_path):
    out, variant = _golden_here(tmp_path)
    before = selection_golden.load(out)["variants"]
    _run_golden("--record", "--archs", "llama", "--presets", "streamingllm", "--out", str(out)).check_returncode()
    written = selection_golden.load(out)["variants"]
    assert {k: v for k, v in written.items() if k != variant} == {k: v for k, v in before.items() if k != variant}
    records = written[variant]["records"]
    assert {k: v for k, v in records.items() if "/streamingllm/" not in k} == \
        {k: v for k, v in before[variant]["records"].items() if "/streamingllm/" not in k}
    [(_, fresh)] = selection_golden.collect(default_model=False, names=["streamingllm"], archs=("llama",)).items()
    assert {k: v for k, v in records.items() if "/streamingllm/" in k} == fresh["records"] != {}


def test_the_file_round_trips_and_stores_a_variant_with_its_base_records_once(tmp_path):
    out = tmp_path / "golden.json"
    out.write_text(selection_golden.dumps(GOLDEN))
    assert selection_golden.load(out) == GOLDEN
    base = {"versions": [{"torch": "a"}], "records": {"llama/x/a": {"kept": 1}, "llama/y/a": {"kept": 2}}}
    other = {"versions": [{"torch": "b"}], "records": {"llama/x/a": {"kept": 1}, "llama/y/a": {"kept": 3}}}
    out.write_text(selection_golden.dumps({"variants": {"llama@a": base, "llama@b": other}}))
    assert json.loads(out.read_text())["variants"]["llama@b"] == \
        {"versions": [{"torch": "b"}], "base": "llama@a", "records": {"llama/y/a": {"kept": 3}}}
    assert selection_golden.load(out) == {"variants": {"llama@a": base, "llama@b": other}}


def test_an_unknown_preset_is_refused_in_one_line():
    done = _run_golden("--check", "--presets", "snapkv,nope")
    assert done.returncode == 2 and "unknown preset(s) nope; known: snapkv" in done.stderr
    assert "Traceback" not in done.stderr


def test_numerics_without_records_fail_the_check_in_one_line_naming_the_record_command(tmp_path):
    out = tmp_path / "golden.json"
    out.write_text(json.dumps({"variants": {k: v for k, v in GOLDEN["variants"].items()
                                            if not k.startswith("llama@")}}))
    done = _run_golden("--check", "--archs", "llama", "--presets", "knorm", "--out", str(out))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stdout.strip().splitlines()
    assert line.startswith("no golden kept sets for llama@") and \
        line.endswith("python benchmarks/selection_golden.py --record")


def test_recording_one_preset_for_numerics_without_records_is_refused(tmp_path):
    out = tmp_path / "golden.json"
    out.write_text(json.dumps({"variants": {}}))
    done = _run_golden("--record", "--archs", "llama", "--presets", "streamingllm", "--out", str(out))
    assert done.returncode == 2 and "record every preset first" in done.stderr and "Traceback" not in done.stderr
    assert json.loads(out.read_text()) == {"variants": {}}
