"""Make Q-filters for a model (:mod:`kvpress_ada.qfilters`): ``kvpress-ada qfilters``.

Each of ``n`` documentation texts (:func:`~kvpress_ada.harness.distill.documentation_texts`: docstrings of the
Python standard library, offline and deterministic; ``context`` tokens each) is prefilled once; from every
layer ``ceil(samples / n)`` positions drawn from ``(seed, text)`` contribute their post-RoPE queries of every
query head (the same positions for all heads, as Godey et al.'s ``make_filters.py``). Per query head, the
first right singular vector of those ``samples`` queries, negated where most queries project positively on it
(so the score ``-(filter . key)`` grows with the attention the head's queries tend to pay the key), averaged over
the kv head's query group.
"""

from __future__ import annotations

import datetime
import math
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from kvpress_ada.calibration import CALIBRATION_SEED, model_identity
from kvpress_ada.harness.distill import documentation_texts
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.qfilters import QFilters, QFiltersMeta
from kvpress_ada.tokens import encode


def principal_filters(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[kv_heads, D]`` Q-filters of one layer from ``queries [H_q, S, D]`` (``S`` query samples per head):
    ``-sign * v1`` per query head (``v1`` the first right singular vector, ``sign`` +1 where most queries'
    coordinates on it are positive), averaged over each kv head's query group."""
    u, _, vh = torch.linalg.svd(queries.double(), full_matrices=False)
    sign = torch.where((u[..., 0] > 0).double().mean(-1) > 0.5, 1.0, -1.0)
    filters = -sign[:, None] * vh[:, 0, :]  # [H_q, D]
    return filters.view(kv_heads, -1, filters.shape[-1]).mean(1).float()


@torch.no_grad()
def make_qfilters(model: Any, tokenizer: Any, n: int = 20, context: int = 2048, samples: int = 3000,
                  seed: int = CALIBRATION_SEED, model_name: str | None = None, progress: bool = True) -> QFilters:
    """Q-filters of ``model`` from ``n`` documentation texts of ``context`` tokens (module docstring)."""
    from kvpress_ada import __version__

    if n < 1 or context < 2 or samples < 1:
        raise ValueError(f"Q-filters need n >= 1 texts, context >= 2 tokens and samples >= 1, got n={n}, "
                         f"context={context}, samples={samples}")
    start = time.perf_counter()
    device = next(model.parameters()).device
    per_text = math.ceil(samples / n)
    picked: list[list[torch.Tensor]] = []
    tokens = 0
    for i, text in enumerate(tqdm(documentation_texts(tokenizer, n, context, seed), disable=not progress,
                                  desc="Q-filters", unit="text")):
        ids = encode(tokenizer, text, device)
        tokens += ids.shape[1]
        gen = torch.Generator().manual_seed(seed * 1_000 + i)
        at = torch.randperm(ids.shape[1], generator=gen)[:per_text].to(device)
        prefill = capture_prefill(model, ids)
        for layer, c in enumerate(prefill.layers):
            if layer == len(picked):
                picked.append([])
            picked[layer].append(c.queries[0][:, at].float().cpu())  # [H_q, per_text, D]
        del prefill
    kv_heads = int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads)
    filters = torch.stack([principal_filters(torch.cat(q, dim=1)[:, :samples], kv_heads) for q in picked])
    meta = QFiltersMeta(
        model=model_identity(model.config, model_name),
        data={"source": "documentation text (kvpress_ada.harness.distill.documentation_texts)", "texts": n,
              "context": context, "tokens": tokens, "seed": seed, "samples_per_head": min(samples, per_text * n)},
        library_version=__version__, seconds=round(time.perf_counter() - start, 2),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return QFilters(filters, meta)
