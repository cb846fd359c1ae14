"""Measure per-(layer, kv head) budget shares of a scorer on calibration samples.

For each sample (question-agnostic: the context part of the chat prompt, as ``eval`` compresses it)
the model is prefilled once; at each reference ratio the scorer's model-scope top-k (``AdaLayer``
and ``AdaHead`` with ``alpha=0``: KVzip's own selection, the ``kvzip`` preset) decides which entries
are kept, and a (layer, kv head)'s share is the fraction of the kept entries that fall in it. Shares
are averaged over ratios and samples.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from kvpress_ada.allocators import AdaHead, AdaLayer
from kvpress_ada.calibration import CALIBRATION_SEED, Calibration, model_identity
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.generation import split_prompt
from kvpress_ada.pipeline import Pipeline
from kvpress_ada.scorers import SCORERS, Scorer
from kvpress_ada.tokens import encode

DEFAULT_RATIOS = (0.5, 0.75)


def calibration_samples(tokenizer: Any, tasks: Sequence[str], n: int, context: int,
                        seed: int = CALIBRATION_SEED) -> list:
    """``n`` samples in all, spread round-robin over ``tasks`` (the first tasks get one more when
    ``n`` does not divide evenly), from seed ``seed`` (``>= CALIBRATION_SEED``: never evaluation's)."""
    from kvpress_ada.harness.eval.tasks import make_samples

    if seed < CALIBRATION_SEED:
        raise ValueError(f"calibration seeds start at {CALIBRATION_SEED} (evaluation uses seed 0); got seed={seed}")
    counts = [n // len(tasks) + (i < n % len(tasks)) for i in range(len(tasks))]
    per_task = [make_samples(t, tokenizer, c, context, seed=seed) if c else [] for t, c in zip(tasks, counts)]
    return [s for i in range(max(counts)) for samples in per_task if i < len(samples) for s in [samples[i]]]


def reference_pipeline(scorer: Scorer, ratio: float) -> Pipeline:
    """The allocation whose shares are measured: one top-k over every layer and head."""
    return Pipeline(scorer=scorer, layers=AdaLayer(alpha=0.0), allocator=AdaHead(alpha=0.0), compression_ratio=ratio)


@torch.no_grad()
def calibrate(model: Any, tokenizer: Any, scorer: Scorer | str = "kvzip", n: int = 32,
              tasks: Sequence[str] | None = None, context: int = 1000, ratios: Sequence[float] = DEFAULT_RATIOS,
              seed: int = CALIBRATION_SEED, model_name: str | None = None, progress: bool = True,
              on_sample: Callable[[int], None] | None = None) -> Calibration:
    """Measure ``scorer``'s per-(layer, kv head) shares on ``n`` calibration samples of ``tasks``
    (default: every task of the suite) at ``context`` tokens; see the module docstring."""
    from kvpress_ada import __version__
    from kvpress_ada.harness.eval.tasks import TASKS

    scorer = SCORERS.build(scorer)  # type: ignore[assignment]
    assert isinstance(scorer, Scorer)
    tasks = list(tasks) if tasks else list(TASKS)
    ratios = list(ratios)
    if not ratios or any(not 0.0 < r < 1.0 for r in ratios):
        raise ValueError(f"reference ratios must be in (0, 1), got {ratios}")
    samples = calibration_samples(tokenizer, tasks, n, context, seed)
    device = next(model.parameters()).device
    start = time.perf_counter()
    per_sample = []
    for i, sample in enumerate(tqdm(samples, disable=not progress, desc="calibrating", unit="sample")):
        head, _ = split_prompt(tokenizer, sample.context, sample.question)
        prefill = capture_prefill(model, encode(tokenizer, head, device))
        shares = torch.zeros(len(prefill.layers), prefill.layers[0].keys.shape[1], dtype=torch.float64)
        for ratio in ratios:
            keep = prefill.keep_masks(reference_pipeline(scorer, ratio))
            kept = torch.stack([k[0].sum(-1) for k in keep]).double().cpu()  # [layers, kv heads]
            shares += kept / kept.sum() / len(ratios)
        per_sample.append(shares)
        del prefill
        if on_sample is not None:
            on_sample(i)
    stacked = torch.stack(per_sample)
    mean = stacked.mean(0)
    mean = mean / mean.sum()
    spread = stacked.std(0, unbiased=False)
    counts = {t: sum(s.task == t for s in samples) for t in tasks}
    return Calibration(
        model=model_identity(model.config, model_name), scorer=scorer.model_dump(mode="json"),
        reference={"layers": AdaLayer(alpha=0.0).model_dump(mode="json"),
                   "allocator": AdaHead(alpha=0.0).model_dump(mode="json")},
        ratios=ratios, tasks=tasks, n=len(samples),
        seeds={"seed": seed, "samples_per_task": counts,
               "note": f"make_samples(task, tokenizer, k, context, seed={seed}); evaluation uses seed 0"},
        context=context, library_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seconds=round(time.perf_counter() - start, 1), shares=mean.tolist(), spread=spread.tolist())
