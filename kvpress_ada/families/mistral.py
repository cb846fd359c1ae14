"""Mistral."""

from __future__ import annotations

from .base import LlamaLike, setting
from .registry import register_family


@register_family("mistral")
class MistralFamily(LlamaLike):
    """Mistral: every layer slides when the config sets ``sliding_window`` (its config has no ``layer_types``)."""

    vllm_checked = True

    @property
    def sliding_window_layers(self) -> tuple[int, ...]:
        return () if setting(self.config, "sliding_window") is None else tuple(range(self.n_layers))
