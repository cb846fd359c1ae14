"""Fast KVzip (Kim, Han and Yun, NAVER AI Lab, 2026, arXiv 2601.17668, "Efficient and Accurate LLM Inference with
Gated KV Eviction"): a low-rank sink-attention gate per layer reads the hidden state entering the attention with each
token and scores its entry in every kv head, trained on KVzip's scores; one pass, no reconstruction.

The gate (:mod:`kvpress_ada.surrogate`, kind ``gate``) is a surrogate like KVzap's, trained for the default model by
``kvpress-ada distill --kind gate`` (shipped: ``builtin:smollm2_135m_kvzip_gate``; refused for another model in one
line naming that command). NVIDIA kvpress's ``FastKVzipPress`` downloads the authors' gates (``Jang-Hyun/Fast-KVzip``:
Qwen2.5-1M, Qwen3, Gemma3). As kvpress: the first ``sinks`` tokens and the last ``window_ratio`` of the context
(``int(ratio * length)`` tokens) are protected, and the ``fastkvzip`` preset takes one top-k over every layer and head
(kvpress's ``layerwise=False``). Differs: the gate scores every token as it arrives, so chunked prefill and decode
compression run too (kvpress's press scores only a one-shot prefill; the authors' repository has its own chunked
prefill with a fixed 4096-token window, not reproduced); ``predict`` gives the gate's log, so a
:class:`~kvpress_ada.allocators.threshold.Threshold` on it is a threshold on ``log(gate)``. Any surrogate file is
accepted (a KVzap one makes it KVzap with Fast KVzip's protected tokens).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from .. import surrogate
from ..observation import Observation
from .base import protect_first_valid, register_scorer
from .kvzap import KVzap


@register_scorer("fastkvzip")
class FastKVzip(KVzap):
    """Log of Fast KVzip's gate for every entry from its token's hidden state (see the module docstring)."""

    name: Literal["fastkvzip"] = "fastkvzip"  # type: ignore[assignment]
    path: str = Field(surrogate.SHIPPED_GATE, description="gate file (`kvpress-ada distill --kind gate --out FILE`) "
                                                          "or builtin:NAME for one shipped with kvpress_ada")
    window_ratio: float = Field(0.02, ge=0.0, lt=1.0, description="fraction of the context's most recent tokens "
                                                                  "always kept (int(ratio * length), at least window)")

    def _recent(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[B]`` most recent tokens protected of rows holding ``lengths`` tokens."""
        return torch.maximum(torch.floor(self.window_ratio * lengths.double()).long(),
                             torch.full_like(lengths, self.window, dtype=torch.long))

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return torch.minimum(self.sinks + self._recent(lengths), lengths.long())

    def score(self, obs: Observation) -> torch.Tensor:
        scores = protect_first_valid(self.entry_scored(obs).float(), obs.key_mask, self.sinks)
        lengths = obs.valid_lengths()
        rank = obs.key_mask.long().cumsum(-1) - 1  # index among the row's valid tokens
        recent = obs.key_mask & (rank >= (lengths - self._recent(lengths))[:, None])
        return scores.masked_fill(recent[:, None, :], float("inf"))
