"""SmolLM3."""

from __future__ import annotations

from .base import LlamaLike, setting
from .registry import register_family


@register_family("smollm3")
class SmolLM3Family(LlamaLike):
    """SmolLM3: every fourth layer carries no rotary position embedding (``no_rope_layers[i] == 0``)."""

    vllm_checked = True

    @property
    def layers_without_rope(self) -> tuple[int, ...]:
        flags = setting(self.config, "no_rope_layers", ())
        return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)
