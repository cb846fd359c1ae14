"""Evaluation data: seeded RULER-style synthetic tasks on real text, loaders for the
published RULER and LongBench datasets, and their scoring rules.

>>> from kvpress_ada.harness.eval import make_samples, score_sample
>>> samples = make_samples("passkey", tokenizer, n=10, context_tokens=1024, seed=0)
>>> score_sample(samples[0], "The pass key is 71432.")
"""

from kvpress_ada.harness.eval.datasets import load_longbench, load_ruler, split_ruler_input
from kvpress_ada.harness.eval.scoring import (
    LONGBENCH_METRICS,
    METRICS,
    score,
    score_sample,
    string_match_all,
    string_match_part,
)
from kvpress_ada.harness.eval.tasks import TASKS, ContextTooSmall, Sample, TaskSpec, make_samples

__all__ = [
    "Sample", "TaskSpec", "TASKS", "ContextTooSmall", "make_samples",
    "METRICS", "LONGBENCH_METRICS", "score", "score_sample", "string_match_all",
    "string_match_part",
    "load_longbench", "load_ruler", "split_ruler_input",
]
