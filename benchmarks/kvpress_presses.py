"""NVIDIA kvpress 0.5.5 presses built from JSON specs and handed what they would download or draw; runs inside the
kvpress virtualenv and is shared by its two workers (``benchmarks/kvpress_worker.py``,
``benchmarks/kvpress_agreement_worker.py``).

Never imports ``kvpress_ada``. A spec is ``{"press": <kvpress class name>, "kwargs": {...}}``; a kwarg value that is a
spec is a nested press (ChunkKVPress's ``press``), and so is each spec of a list (ComposedPress's ``presses``).
:func:`hand_over` sets, on the press and every press nested in it, what a request hands kvpress instead of its hub
downloads (keys as in the requests; values nested lists or tensors):

- ``q_filters``: ``[layers, kv heads, D]``, set on every ``QFilterPress``;
- ``gates``: per layer ``{name: weights}``, Fast KVzip gates in kvpress's ``FastKVzipGate`` state-dict layout;
- ``duo``: ``sink``, ``recent``, ``scores [layers, kv heads]``: DuoAttention's head patterns (kvpress's own rule
  then picks the streaming heads);
- ``curve``: LU-KV's prune ratios ``[99, layers, kv heads]`` (row ``round(100 r) - 1`` is read at ratio ``r``);
- ``query_stats``: ``mean [layers, H_q, D]`` and ``cov [layers, H_q, D, D]``, the pre-RoPE query statistics set on every
  ``ExpectedAttentionStatsPress`` (its ``mu`` and ``cov``);
- ``attrs``: attributes set on the top press once built (FinchPress's ``window_size``, a ``delimiter_token_id``
  absent from the ids).
"""

from __future__ import annotations

from typing import Any

import kvpress
import numpy as np
import torch
from kvpress.presses.fastkvzip_press import FastKVzipGate


def spec(press: str, /, **kwargs: Any) -> dict:
    """A press spec: kvpress's ``press(**kwargs)``."""
    return {"press": press, "kwargs": kwargs}


def build(name: str, kwargs: dict):
    """kvpress's ``name(**kwargs)``, nested press specs built first."""

    def value(v):
        if isinstance(v, dict) and set(v) == {"press", "kwargs"}:
            return build(v["press"], v["kwargs"])
        if isinstance(v, list):
            return [value(x) for x in v]
        return v

    return getattr(kvpress, name)(**{k: value(v) for k, v in kwargs.items()})


def presses(press) -> list:
    """``press`` and every press nested in it."""
    found = [press]
    for name in ("press", "base_press"):
        if isinstance(getattr(press, name, None), kvpress.BasePress):
            found += presses(getattr(press, name))
    for inner in getattr(press, "presses", None) or []:
        found += presses(inner)
    return found


def hand_over(press, handed: dict, model) -> None:
    """Set what ``handed`` holds (filters, gates, head patterns, a keep curve, attributes) instead of downloads."""
    for p in presses(press):
        if isinstance(p, kvpress.QFilterPress) and handed.get("q_filters") is not None:
            p.q_filters = torch.as_tensor(handed["q_filters"], dtype=model.dtype)
            p.post_init_from_model = lambda model: None  # the filters are given, not downloaded
        if isinstance(p, kvpress.FastKVzipPress) and handed.get("gates") is not None:
            p.gates = [gate(i, layer, model) for i, layer in enumerate(handed["gates"])]
        if isinstance(p, kvpress.DuoAttentionPress) and handed.get("duo") is not None:
            duo = handed["duo"]
            pattern = (int(duo["sink"]), int(duo["recent"]), np.asarray(duo["scores"], dtype=float))
            p.load_attention_pattern = lambda model, pattern=pattern: pattern  # kvpress's rule picks the heads
        if isinstance(p, kvpress.ExpectedAttentionStatsPress) and handed.get("query_stats") is not None:
            stats = handed["query_stats"]  # what post_init_from_model would download: set, so it is not
            p.mu = torch.as_tensor(stats["mean"], dtype=model.dtype)
            p.cov = torch.as_tensor(stats["cov"], dtype=model.dtype)
        if isinstance(p, kvpress.LUKVPress) and handed.get("curve") is not None:
            p._budget_curves = np.asarray(handed["curve"], dtype=float)  # prune ratios [99, layers, kv heads]
    for name, v in (handed.get("attrs") or {}).items():
        setattr(press, name, v)


def gate(index: int, weights: dict, model) -> FastKVzipGate:
    """kvpress's gate module holding ``weights`` (its own state-dict names and shapes)."""
    w = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in weights.items()}
    nhead, _, sink, dim = w["k_base"].shape
    ngroup = w["b"].shape[-1]
    module = FastKVzipGate(index, model.config.hidden_size, nhead, ngroup, torch.float32, dim, sink)
    module.load_state_dict(w)
    return module.eval()
