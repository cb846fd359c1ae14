"""The golden kept sets (``benchmarks/results/selection_golden.json``): every registered preset, in
every mode, on the tiny Llama keeps exactly the recorded entries and generates the recorded tokens.
Recorded with one torch/transformers pair; other versions may round differently (skipped there)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import selection_golden  # noqa: E402

GOLDEN = json.loads(selection_golden.GOLDEN.read_text())


@pytest.mark.skipif(GOLDEN["versions"] != {"torch": torch.__version__, "transformers": transformers.__version__},
                    reason=f"golden kept sets recorded with {GOLDEN['versions']}")
def test_every_preset_keeps_the_golden_entries():
    now = selection_golden.collect(default_model=False, archs=("llama",))
    recorded = {k: v for k, v in GOLDEN.items() if k.startswith("llama/")}
    assert len(recorded) > 100 and selection_golden.compare(recorded, now) == []
