"""Measure a model's query statistics (:mod:`kvpress_ada.query_stats`): ``kvpress-ada query-stats``.

Each of ``n`` documentation texts (:func:`~kvpress_ada.harness.distill.documentation_texts`: docstrings of the Python
standard library, offline and deterministic; ``context`` tokens each) is prefilled once, alone (its tokens at RoPE
positions ``0 .. T - 1``); every layer's post-RoPE queries are rotated back to their pre-RoPE form (the layer's own
RoPE frequencies) and, from position ``sinks`` on, summed with their outer products in float64. Per (layer, query
head): the mean and the unbiased covariance (``/ (N - 1)``) over the ``N`` positions of all texts, as kvpress's
``collect_queries`` computes them from its BookSum samples.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from kvpress_ada.calibration import CALIBRATION_SEED, model_identity
from kvpress_ada.families import family_of
from kvpress_ada.harness.distill import documentation_texts
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.query_stats import QueryStats, QueryStatsMeta
from kvpress_ada.scorers.statistics import unrotate
from kvpress_ada.tokens import encode


def pre_rope_queries(queries: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[H_q, T, D]`` float32: the pre-RoPE form of one unpadded text's post-RoPE ``queries [H_q, T, D]`` (query
    ``t`` at RoPE position ``t``; zero frequencies: a layer without RoPE, left as it is)."""
    T = queries.shape[1]
    return unrotate(queries[None], inv_freq, None, torch.ones(1, T, dtype=torch.bool, device=queries.device))[0]


@torch.no_grad()
def make_query_stats(model: Any, tokenizer: Any, n: int = 32, context: int = 1024, sinks: int = 4,
                     seed: int = CALIBRATION_SEED, model_name: str | None = None, progress: bool = True) -> QueryStats:
    """The query statistics of ``model`` from ``n`` documentation texts of ``context`` tokens (module docstring)."""
    from kvpress_ada import __version__

    if n < 1 or context < 2 or sinks < 0 or sinks >= context:
        raise ValueError(f"query statistics need n >= 1 texts, context >= 2 tokens and 0 <= sinks < context, got "
                         f"n={n}, context={context}, sinks={sinks}")
    start = time.perf_counter()
    device = next(model.parameters()).device
    family = family_of(model)
    sums: list[torch.Tensor] = []
    outer: list[torch.Tensor] = []
    count, tokens = 0, 0
    for text in tqdm(documentation_texts(tokenizer, n, context, seed), disable=not progress, desc="query stats",
                     unit="text"):
        ids = encode(tokenizer, text, device)
        tokens += ids.shape[1]
        if ids.shape[1] <= sinks:
            continue
        prefill = capture_prefill(model, ids)
        for layer, c in enumerate(prefill.layers):
            inv_freq = family.rope_inv_freq(model, layer).float()
            q = pre_rope_queries(c.queries[0], inv_freq)[:, sinks:].double()  # [H_q, T - sinks, D]
            if layer == len(sums):
                sums.append(torch.zeros(q.shape[0], q.shape[2], dtype=torch.float64, device=q.device))
                outer.append(torch.zeros(q.shape[0], q.shape[2], q.shape[2], dtype=torch.float64, device=q.device))
            sums[layer] += q.sum(1)
            outer[layer] += torch.einsum("htd,hte->hde", q, q)
        count += ids.shape[1] - sinks
        del prefill
    if count < 2:
        raise ValueError(f"query statistics need at least 2 query positions after the sinks, got {count}")
    mean = torch.stack(sums) / count  # [layers, H_q, D]
    cov = (torch.stack(outer) - count * mean[..., :, None] * mean[..., None, :]) / (count - 1)
    meta = QueryStatsMeta(
        model=model_identity(model.config, model_name),
        data={"source": "documentation text (kvpress_ada.harness.distill.documentation_texts)", "texts": n,
              "context": context, "tokens": tokens, "positions": count, "sinks": sinks, "seed": seed},
        library_version=__version__, seconds=round(time.perf_counter() - start, 2),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return QueryStats(mean.float().cpu(), cov.float().cpu(), meta)
