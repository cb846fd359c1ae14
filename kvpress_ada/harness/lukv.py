"""LU-KV's offline profiling (Tang et al., 2026, arXiv 2602.08585, "Predicting Future Utility: Global Combinatorial
Optimization for Task-Agnostic KV Cache Eviction"): per-(layer, kv head) budgets at every compression ratio, from
how well a heuristic scorer's ranking in each head captures the attention the context receives later.

For each calibration sample (the context part of the chat prompt, then the question and the reference answer,
teacher-forced):

* **oracle importance** ``o_h(i)``: the attention context entry ``i`` receives in kv head ``h`` from the tokens
  after the context (the question and the answer: its long-horizon utility), summed over those tokens and averaged
  over the query heads of the group;
* **utility curve** ``U_h(k)``: the oracle mass of the ``k`` entries the scorer ranks first in head ``h`` (the
  scorer sees the context alone, as a question-agnostic press does);
* **allocation at ratio r**: ``K = n_layers * H * round((1 - r) * L)`` entries split across every (layer, head) by
  the greedy on marginal utility over each curve's upper concave envelope (the convex-hull relaxation: with concave
  curves the greedy's top-``K`` unit gains are optimal); ``keep[r][l][h]`` is the fraction of the context that
  head keeps.

The keep fractions are averaged over the samples and stored as the keep curve of a calibration file
(:class:`~kvpress_ada.calibration.Calibration`, ``keep``), which ``CalibratedLayer`` and ``Calibrated`` read at the
pipeline's own ratio (the ``lukv`` preset). NVIDIA kvpress's ``LUKVPress`` downloads such a curve (made by the
authors' scripts for Llama-3.1-8B with ``ExpectedAttentionPress``, 99 ratios); this module computes one for any
model with the library: ``kvpress-ada calibrate --method lukv``.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from kvpress_ada.calibration import CALIBRATION_SEED, Calibration, model_identity
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.generation import split_prompt
from kvpress_ada.scorers import SCORERS, Scorer
from kvpress_ada.tokens import encode

LUKV_RATIOS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05, 0.10, ..., 0.95


def oracle_importance(queries: torch.Tensor, keys: torch.Tensor, context: int, scaling: float) -> torch.Tensor:
    """``[H_kv, context]``: the causal softmax attention the first ``context`` keys receive from the queries after
    them, summed over those queries and averaged over each kv head's query group (one row: ``queries [1, H_q, T,
    D]``, ``keys [1, H_kv, T, D]``)."""
    _, Hq, T, D = queries.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    q = queries[0, :, context:].float().reshape(Hkv, G, T - context, D)
    k = keys[0].float()
    logits = torch.einsum("hgtd,hsd->hgts", q, k) * scaling
    position = torch.arange(context, T, device=k.device)[:, None]
    logits = logits.masked_fill(torch.arange(T, device=k.device)[None, :] > position, float("-inf"))
    attention = torch.softmax(logits, dim=-1)[..., :context]
    return attention.sum(dim=2).mean(dim=1)


def utility_curves(oracle: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``[N, L + 1]``: ``U(k)``, the oracle mass of the ``k`` entries ranked first by ``scores`` (``[N, L]`` each;
    equal scores by position), ``U(0) = 0``."""
    order = torch.argsort(-scores.double(), dim=-1, stable=True)
    gained = oracle.double().gather(-1, order).cumsum(-1)
    return torch.cat([torch.zeros_like(gained[:, :1]), gained], dim=-1)


def envelope_gains(curve: torch.Tensor) -> torch.Tensor:
    """``[L]``: the unit gains of the upper concave envelope of the points ``(k, curve[k])``, ``k = 0..L``
    (non-increasing: one budget unit after another along the envelope's segments)."""
    values = curve.double().tolist()
    hull: list[int] = []
    for k in range(len(values)):  # monotone chain, upper hull
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (values[b] - values[a]) * (k - a) <= (values[k] - values[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(k)
    gains: list[float] = []
    for a, b in zip(hull, hull[1:]):
        gains.extend([(values[b] - values[a]) / (b - a)] * (b - a))
    return torch.tensor(gains, dtype=torch.float64)


def greedy_counts(gains: torch.Tensor, total: int) -> torch.Tensor:
    """``[N]``: how many of the ``total`` largest unit gains over ``gains [N, L]`` (each row non-increasing) fall
    in each row: the greedy on marginal utility (ties go to the lower row, then the earlier unit)."""
    N, L = gains.shape
    total = max(0, min(int(total), N * L))
    order = torch.argsort(-gains.reshape(-1), stable=True)[:total]
    return torch.bincount(order // L, minlength=N)


def keep_fractions(oracle: torch.Tensor, scores: torch.Tensor, ratios: Sequence[float]) -> torch.Tensor:
    """``[R, n_layers, H]``: each (layer, kv head)'s kept fraction of the ``L`` context entries at each ratio, from
    ``oracle`` and ``scores`` ``[n_layers, H, L]`` (module docstring)."""
    n, H, L = scores.shape
    curves = utility_curves(oracle.reshape(n * H, L), scores.reshape(n * H, L))
    gains = torch.stack([envelope_gains(c) for c in curves])
    rows = [greedy_counts(gains, n * H * max(1, round((1.0 - r) * L))).view(n, H).double() / L for r in ratios]
    return torch.stack(rows)


@torch.no_grad()
def sample_keep(model: Any, tokenizer: Any, scorer: Scorer, sample: Any, ratios: Sequence[float]) -> torch.Tensor:
    """``[R, n_layers, H]`` keep fractions of one calibration sample (module docstring)."""
    device = next(model.parameters()).device
    head, tail = split_prompt(tokenizer, sample.context, sample.question)
    context_ids = encode(tokenizer, head, device)
    after = encode(tokenizer, tail + sample.answers[0], device)
    L = context_ids.shape[1]
    prefill = capture_prefill(model, context_ids)
    scores = torch.stack([scorer.score(prefill.view(scorer, i).observations()[0])[0].float()
                          for i in range(len(prefill.layers))])
    del prefill
    whole = capture_prefill(model, torch.cat([context_ids, after], dim=1))
    oracle = torch.stack([oracle_importance(c.queries, c.keys, L, c.scaling) for c in whole.layers])
    del whole
    return keep_fractions(oracle.cpu(), scores.cpu(), ratios)


def profile_lukv(model: Any, tokenizer: Any, scorer: Scorer | str = "expected_attention", n: int = 16,
                 tasks: Sequence[str] | None = None, context: int = 1000, ratios: Sequence[float] = LUKV_RATIOS,
                 seed: int = CALIBRATION_SEED, model_name: str | None = None, progress: bool = True,
                 on_sample: Callable[[int], None] | None = None) -> Calibration:
    """LU-KV's keep curve of ``scorer`` on ``n`` calibration samples of ``tasks`` (default: every task of the
    suite) at ``context`` tokens, as a calibration file (module docstring)."""
    from kvpress_ada import __version__
    from kvpress_ada.harness.calibrate import calibration_samples
    from kvpress_ada.harness.eval.tasks import TASKS

    scorer = SCORERS.build(scorer)  # type: ignore[assignment]
    assert isinstance(scorer, Scorer)
    if scorer.needs_model_pass or scorer.reads_hidden_states:
        raise ValueError(f"LU-KV profiles a one-pass scorer over a captured prefill; {type(scorer).__name__} needs "
                         "a model pass or hidden states: use e.g. expected_attention or snapkv")
    ratios = sorted(float(r) for r in ratios)
    if not ratios or any(not 0.0 < r < 1.0 for r in ratios) or len(set(ratios)) != len(ratios):
        raise ValueError(f"LU-KV ratios must be distinct and in (0, 1), got {ratios}")
    tasks = list(tasks) if tasks else list(TASKS)
    samples = calibration_samples(tokenizer, tasks, n, context, seed)
    start = time.perf_counter()
    per_sample = []
    for i, sample in enumerate(tqdm(samples, disable=not progress, desc="profiling (LU-KV)", unit="sample")):
        per_sample.append(sample_keep(model, tokenizer, scorer, sample, ratios))
        if on_sample is not None:
            on_sample(i)
    stacked = torch.stack(per_sample)  # [n, R, layers, H]
    keep = stacked.mean(0)
    shares_each = stacked.mean(1)
    shares_each = shares_each / shares_each.sum((-1, -2), keepdim=True)
    shares = keep.mean(0)
    shares = shares / shares.sum()
    counts = {t: sum(s.task == t for s in samples) for t in tasks}
    return Calibration(
        model=model_identity(model.config, model_name), scorer=scorer.model_dump(mode="json"),
        reference={"method": "lukv", "oracle": "attention from the question and answer tokens (teacher-forced) to "
                                               "the context, summed over them, mean over the query group",
                   "allocation": "greedy on marginal utility over each head's upper concave envelope"},
        ratios=ratios, tasks=tasks, n=len(samples),
        seeds={"seed": seed, "samples_per_task": counts,
               "note": f"make_samples(task, tokenizer, k, context, seed={seed}); evaluation uses seed 0"},
        context=context, library_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seconds=round(time.perf_counter() - start, 1), shares=shares.tolist(),
        spread=shares_each.std(0, unbiased=False).tolist(), keep=[[[round(x, 6) for x in h] for h in layer]
                                                                   for layer in keep.tolist()])
