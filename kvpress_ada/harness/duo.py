"""DuoAttention's head patterns measured with the library (``kvpress-ada calibrate --method duo``).

DuoAttention (Xiao et al., ICLR 2025, arXiv 2410.10819) trains one gate per (layer, kv head) on synthetic passkey
retrieval: how much the model's output moves when that head attends only to its sinks and recent tokens (a
*streaming* head) instead of the whole context (a *retrieval* head). kvpress downloads the gates the authors
trained for six 7-8B models, or approximates them from mean queries and keys. Here the deviation is measured
directly, without training, on calibration samples of the task suite (question-aware: context, question and
the generation prompt): for the last ``queries`` prompt queries, the relative L2 distance between each query
head's attention output over every entry and over only the first ``sinks`` and its ``recent`` latest entries,
averaged over the queries, the samples and the kv head's query group. The normalised deviations are the
calibration's ``shares``: the ``DuoAttention`` scorer streams the heads that move the output least.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from kvpress_ada.calibration import CALIBRATION_SEED, Calibration, model_identity

#: sink and recent entries a streaming head keeps (DuoAttention's and kvpress's on-the-fly defaults)
DUO_SINKS, DUO_RECENT = 128, 256
DUO_QUERIES = 64  # last prompt queries (the question and the generation prompt) whose outputs are compared


def streaming_deviation(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                        sinks: int, recent: int) -> torch.Tensor:
    """``[H_kv]``: for the ``Q`` queries ``[H_q, Q, D]`` at the end of ``keys``/``values [H_kv, L, D]`` (causal),
    the relative L2 distance between each query head's attention output over every entry and over the first
    ``sinks`` and its ``recent`` latest entries (itself included), averaged over the queries and the query group."""
    Hq, Q, _ = queries.shape
    H, L, _ = keys.shape
    G = Hq // H
    q_pos = torch.arange(L - Q, L, device=keys.device)[:, None]
    k_pos = torch.arange(L, device=keys.device)[None, :]
    causal = k_pos <= q_pos  # [Q, L]
    streaming = causal & ((k_pos < sinks) | (k_pos > q_pos - recent))
    logits = torch.matmul(queries.view(H, G, Q, -1).float(), keys.float()[:, None].transpose(-1, -2)) * scaling
    full = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1) @ values.float()[:, None]
    stream = torch.softmax(logits.masked_fill(~streaming, float("-inf")), -1) @ values.float()[:, None]
    deviation = (full - stream).norm(dim=-1) / full.norm(dim=-1).clamp(min=1e-12)  # [H, G, Q]
    return deviation.mean((1, 2))


@torch.no_grad()
def measure_duo(model: Any, tokenizer: Any, n: int = 16, tasks: Sequence[str] | None = None, context: int = 1000,
                seed: int = CALIBRATION_SEED, sinks: int = DUO_SINKS, recent: int = DUO_RECENT,
                queries: int = DUO_QUERIES, model_name: str | None = None, progress: bool = True,
                on_sample: Callable[[int], None] | None = None) -> Calibration:
    """DuoAttention's per-(layer, kv head) deviations of ``model`` on ``n`` calibration samples of ``tasks``
    (default: every task of the suite) at ``context`` tokens, as a calibration (see the module docstring)."""
    from kvpress_ada import __version__
    from kvpress_ada.harness.calibrate import calibration_samples
    from kvpress_ada.harness.eval.tasks import TASKS
    from kvpress_ada.hosts.transformers.fanout import capture_prefill
    from kvpress_ada.hosts.transformers.generation import split_prompt
    from kvpress_ada.tokens import encode

    for label, value in (("sinks", sinks), ("recent", recent), ("queries", queries)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    tasks = list(tasks) if tasks else list(TASKS)
    samples = calibration_samples(tokenizer, tasks, n, context, seed)
    device = next(model.parameters()).device
    start = time.perf_counter()
    per_sample = []
    for i, sample in enumerate(tqdm(samples, disable=not progress, desc="duo heads", unit="sample")):
        head, tail = split_prompt(tokenizer, sample.context, sample.question)
        ids = torch.cat([encode(tokenizer, head, device), encode(tokenizer, tail, device)], dim=1)
        prefill = capture_prefill(model, ids)
        Q = min(queries, ids.shape[1])
        per_sample.append(torch.stack([
            streaming_deviation(c.queries[0, :, -Q:], c.keys[0], c.values[0], c.scaling, sinks, recent).double().cpu()
            for c in prefill.layers]))
        del prefill
        if on_sample is not None:
            on_sample(i)
    stacked = torch.stack(per_sample)  # [samples, layers, kv heads]
    mean = stacked.mean(0)
    counts = {t: sum(s.task == t for s in samples) for t in tasks}
    return Calibration(
        model=model_identity(model.config, model_name),
        scorer={"name": "duo_attention", "sinks": sinks, "recent": recent, "queries": queries},
        reference={"measure": "relative L2 distance of each kv head's attention outputs (its query group, the last "
                              "`queries` prompt queries) over only its `sinks` first and `recent` latest entries "
                              "against over every entry; shares: those distances normalised to sum 1"},
        ratios=[], tasks=tasks, n=len(samples),
        seeds={"seed": seed, "samples_per_task": counts,
               "note": f"make_samples(task, tokenizer, k, context, seed={seed}); evaluation uses seed 0"},
        context=context, question_aware=True, library_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seconds=round(time.perf_counter() - start, 1), shares=(mean / mean.sum()).tolist(),
        spread=(stacked / stacked.sum((1, 2), keepdim=True)).std(0, unbiased=False).tolist())
