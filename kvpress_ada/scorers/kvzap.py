"""KVzap (Jégou and Jeblick, NVIDIA 2026, arXiv 2601.07891): a small learned model per layer reads the
hidden state entering the attention with each token and predicts, for every kv head, the log of
the score KVzip's context reconstruction would give that token's entry (:mod:`kvpress_ada.surrogate`,
trained by ``kvpress-ada distill``). One matrix product (or a 2-layer MLP) per layer and token,
computed as the token arrives: KVzip's ranking in one pass, so it runs in chunked prefill and
decode compression where KVzip's own pass cannot.

Scores are predicted log scores, on one scale for every head and layer: a top-k over all layers and
heads (``AdaLayer(alpha=0)`` with ``AdaHead(alpha=0)``, like ``kvzip``) or a threshold
(:class:`~kvpress_ada.allocators.threshold.Threshold`) compares them directly. The first ``sinks``
tokens (as KVzip) and the last ``window`` tokens are protected. A padded row scores as it would alone in
fp32; in fp16/bf16 the model's hidden states of a padded row differ from its own by rounding, and so can
the entries it keeps where scores are that close (``docs/design.md``, Contracts).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from .. import surrogate
from ..observation import Observation
from .base import Scorer, protect_first_valid, protect_last, register_scorer


@register_scorer("kvzap")
class KVzap(Scorer):
    """Predicted log KVzip score of every entry from its token's hidden state (module docstring)."""

    name: Literal["kvzap"] = "kvzap"
    path: str = Field(surrogate.SHIPPED_MLP, description="surrogate file (`kvpress-ada distill --out FILE`) or "
                                                         "builtin:NAME for one shipped with kvpress_ada")
    sinks: int = Field(4, ge=0, description="initial tokens always kept")
    window: int = Field(0, ge=0, description="most recent tokens always kept")

    reads_hidden_states: ClassVar[bool] = True
    model_specific: ClassVar[bool] = True  # a surrogate is trained for one model: refused for any other

    def query_window(self) -> int:
        return 0

    def protected(self, lengths: torch.Tensor) -> torch.Tensor:
        return lengths.long().clamp(max=self.sinks + self.window)

    def load_surrogate(self) -> surrogate.Surrogate:
        """The surrogate file's content (read once, cached)."""
        return surrogate.load(self.path)

    def check_model(self, config: Any) -> None:
        self.load_surrogate().check_model(config, source=f"surrogate {self.path!r}")

    def entry_scores(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.load_surrogate().predict(hidden, layer_idx)

    def score(self, obs: Observation) -> torch.Tensor:
        scores = protect_first_valid(self.entry_scored(obs).float(), obs.key_mask, self.sinks)
        return protect_last(scores, self.window)
