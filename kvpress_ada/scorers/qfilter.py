"""Q-Filters (Godey et al., 2025, arXiv 2503.02812): score each key by its projection on its head's principal
query direction, a direction measured once per model (:mod:`kvpress_ada.qfilters`)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from .. import qfilters
from ..observation import Observation
from .base import Scorer, register_scorer


@register_scorer("qfilter")
class QFilter(Scorer):
    """Score = ``-(filter . k)`` per kv head, ``filter`` the (layer, kv head)'s Q-filter from ``path`` and ``k``
    the cache's post-RoPE key. No queries are read: the filter stands for them.

    As NVIDIA kvpress's ``QFilterPress`` (``kvpress/presses/qfilter_press.py``, 0.5.5), which downloads the
    authors' filters from the Hugging Face Hub by model name; here they are made by ``kvpress-ada qfilters``
    from offline text, shipped for the default model (``builtin:smollm2_135m``) and ``qwen2.5-coder-0.5b``
    (``builtin:qwen2_5_coder_0_5b``), and refused, in one line naming that command, for any other model.

    Across heads: projections carry each head's key scale, so raw scores are not compared.

    Chunked prefill and decode compression: a key's score depends on the key alone."""

    name: Literal["qfilter"] = "qfilter"
    path: str = Field(qfilters.SHIPPED, description="Q-filters file (`kvpress-ada qfilters --out FILE`) or "
                                                     "builtin:NAME for one shipped with kvpress_ada")
    comparable_across_heads: ClassVar[bool] = False
    model_specific: ClassVar[bool] = True  # filters are measured on one model: refused for any other

    def query_window(self) -> int:
        return 0

    def load_filters(self) -> qfilters.QFilters:
        """The Q-filters file's content (read once, cached)."""
        return qfilters.load(self.path)

    def check_model(self, config: Any) -> None:
        self.load_filters().check_model(config, source=f"Q-filters {self.path!r}")

    def score(self, obs: Observation) -> torch.Tensor:
        layers = self.load_filters().on(obs.keys.device)
        if obs.layer_idx >= len(layers) or layers[obs.layer_idx].shape[-1] != obs.keys.shape[-1]:
            raise ValueError(f"Q-filters {self.path!r} were made for another model (layer {obs.layer_idx}, head "
                             f"dimension {obs.keys.shape[-1]} here): make this model's with `kvpress-ada qfilters`")
        filters = layers[obs.layer_idx]  # [H_kv of the layer, D]
        start = obs.global_head_offset
        heads = filters[start:start + obs.n_kv_heads]
        return -torch.einsum("bhld,hd->bhl", obs.keys.float(), heads)
