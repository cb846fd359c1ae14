"""The adapter contract: what kvpress_ada needs to know of one model family, and the Llama-like defaults.

A :class:`Family` is bound to one model config (a transformers ``PretrainedConfig`` or a parsed
``config.json`` mapping) and answers two kinds of questions: how to reach the attention modules and
their tensors on a model (the transformers host, tensor parallelism, the vLLM host), and what the
family's attention computes besides plain causal softmax attention (sliding-window layers, attention
sinks, logit soft-capping, layers without RoPE, query scaling). Nothing here imports a host library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

if TYPE_CHECKING:
    import torch


def setting(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` of a config object, or ``config[key]`` of a ``config.json`` mapping (``default`` if unset)."""
    if isinstance(config, Mapping):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


class Family:
    """One model family (architecture), bound to ``config``. Subclass :class:`LlamaLike` for a family whose
    attention modules look like Llama's; override only what differs; register with
    :func:`~kvpress_ada.families.register_family`."""

    def __init__(self, config: Any):
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_type={self.model_type!r})"

    @property
    def model_type(self) -> str:
        return str(setting(self.config, "model_type"))

    # ------------------------------------------------------------ reaching a transformers model
    def attention_modules(self, model: Any) -> list[torch.nn.Module]:
        """The decoder's attention modules, in layer order."""
        raise NotImplementedError

    def layer_index(self, module: Any) -> int:
        """The index of the layer an attention module belongs to."""
        return int(module.layer_idx)

    def projections(self, module: Any) -> dict[str, torch.nn.Module]:
        """An attention module's projections by role: ``"q"``, ``"k"``, ``"v"`` (or a fused ``"qkv"``) and ``"o"``."""
        raise NotImplementedError

    def output_weight(self, module: Any) -> torch.Tensor:
        """The output projection's weight ``[hidden, H_q * D]`` (what scorers that read ``W_O`` read)."""
        raise NotImplementedError

    def rope_inv_freq(self, model: Any, layer_idx: int = 0) -> torch.Tensor:
        """The RoPE inverse frequencies ``[D // 2]`` layer ``layer_idx`` rotates with (zeros for a layer without
        RoPE: a rotation by nothing); a one-line ``ValueError`` when the model exposes none."""
        raise NotImplementedError

    def rotary_inv_freq(self, rotary: Any, layer_idx: int = 0, owner: str = "the model") -> torch.Tensor:
        """What :meth:`rope_inv_freq` reads of the model's rotary embedding, read from ``rotary`` (a decoder's rotary
        embedding: the model's, or one a host without the model built from its config,
        :func:`kvpress_ada.hosts.transformers.rotary.config_rope_inv_freq`); ``owner`` names it in the refusal."""
        raise NotImplementedError

    def qk_norms(self, module: Any) -> tuple[torch.nn.Module, torch.nn.Module] | None:
        """The query and key norms applied before RoPE, or ``None`` when the family has none."""
        return None

    # ------------------------------------------------------------ declarations
    @property
    def n_layers(self) -> int:
        return int(setting(self.config, "num_hidden_layers"))

    @property
    def head_dim(self) -> int:
        heads = int(setting(self.config, "num_attention_heads"))
        return int(setting(self.config, "head_dim", int(setting(self.config, "hidden_size")) // heads))

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding-window layers (``None`` when no layer slides)."""
        window = setting(self.config, "sliding_window")
        return int(window) if window is not None and self.sliding_window_layers else None

    @property
    def sliding_window_layers(self) -> tuple[int, ...]:
        """The layers that attend only to the last ``sliding_window`` tokens: the config's ``layer_types``
        marked ``"sliding_attention"``; without ``layer_types``, every layer when ``use_sliding_window`` is set."""
        if setting(self.config, "sliding_window") is None:
            return ()
        types = setting(self.config, "layer_types")
        if types is not None:
            return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        return tuple(range(self.n_layers)) if setting(self.config, "use_sliding_window", False) else ()

    def attention_sinks(self, module: Any) -> torch.Tensor | None:
        """Learned per-head sink logits that join each softmax, or ``None`` (no sinks)."""
        return None

    @property
    def logit_softcap(self) -> float | None:
        """``c`` when attention logits go through ``c * tanh(logits / c)``, else ``None``."""
        return None

    @property
    def layers_without_rope(self) -> tuple[int, ...]:
        """Layers whose queries and keys carry no rotary position embedding."""
        return ()

    @property
    def query_scaling(self) -> float:
        """The factor attention logits are scaled by (``head_dim ** -0.5`` unless the family says otherwise)."""
        return float(self.head_dim) ** -0.5

    # ------------------------------------------------------------ tensor parallelism
    def head_projection_styles(self, plan: Mapping[str, str]) -> dict[str, str]:
        """The style a tensor-parallel plan gives each projection whose output is split by head (``"replicated"``
        when the plan does not name it: every rank computes every head, as GPT-OSS's plan leaves its attention)."""
        raise NotImplementedError

    # ------------------------------------------------------------ the vLLM host
    def engine_attention_modules(self, model: Any) -> list[torch.nn.Module]:
        """The attention modules of vLLM's model of this family, in layer order."""
        raise NotImplementedError

    def engine_output_projection(self, module: Any) -> torch.nn.Module | None:
        """The output projection of one of vLLM's attention modules (``None`` when it has none)."""
        raise NotImplementedError

    def engine_output_weight(self, module: Any) -> torch.Tensor | None:
        """The output projection's weight of one of vLLM's attention modules (``None`` when it has none). On CPU,
        vLLM's linear layers hand their weight to a packed GEMM and keep an empty one: the vLLM host reads it back
        through :meth:`engine_output_projection`."""
        proj = self.engine_output_projection(module)
        return None if proj is None else cast("torch.Tensor", proj.weight)

    #: whether the vLLM host's kept positions and tokens were checked equal to the transformers host's for this
    #: family (``tests/test_vllm_host.py``); an unchecked family is refused there rather than served unverified
    vllm_checked: ClassVar[bool] = False

    def refuses(self, host: str) -> str | None:
        """Why ``host`` (``"transformers"``, ``"vllm"``) cannot serve this family, or ``None`` when it can."""
        if host == "vllm" and self.sliding_window_layers and len(self.sliding_window_layers) < self.n_layers:
            return ("the vLLM host keeps one page group per layer and kv head for global attention only; "
                    "vLLM's sliding-window layer groups of a hybrid model are not served yet (use the transformers "
                    "host)")
        if host == "vllm" and not self.vllm_checked:
            return ("the vLLM host has not been checked against vLLM's model of this family yet (use the "
                    "transformers host)")
        return None


class LlamaLike(Family):
    """A family whose decoder layers hold a Llama-shaped attention module: ``layers[i].<attention>`` with
    separate ``q/k/v/o`` projections and one ``rotary_emb`` on the decoder (transformers and vLLM alike)."""

    #: the attribute of a decoder layer holding its attention module
    attention: ClassVar[str] = "self_attn"
    #: the attention module's projections, by role
    projection_names: ClassVar[dict[str, str]] = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
    #: the query and key norms of the attention module (``None``: none)
    qk_norm_names: ClassVar[tuple[str, str] | None] = None
    #: the attribute of the decoder holding the rotary embedding
    rotary: ClassVar[str] = "rotary_emb"

    def attention_modules(self, model: Any) -> list[torch.nn.Module]:
        return [getattr(layer, self.attention) for layer in model.get_decoder().layers]

    def projections(self, module: Any) -> dict[str, torch.nn.Module]:
        return {role: getattr(module, name) for role, name in self.projection_names.items()}

    def output_weight(self, module: Any) -> torch.Tensor:
        return getattr(module, self.projection_names["o"]).weight

    def rope_inv_freq(self, model: Any, layer_idx: int = 0) -> torch.Tensor:
        return self.rotary_inv_freq(getattr(model.get_decoder(), self.rotary, None), layer_idx, type(model).__name__)

    def rotary_inv_freq(self, rotary: Any, layer_idx: int = 0, owner: str = "the model") -> torch.Tensor:
        # a family whose layer types rotate differently (Gemma-3's local and global bases) holds one per type
        types = setting(self.config, "layer_types")
        kind = types[layer_idx] if types is not None and 0 <= layer_idx < len(types) else None
        inv_freq = getattr(rotary, f"{kind}_inv_freq", None) if kind is not None else None
        if inv_freq is None:
            inv_freq = getattr(rotary, "inv_freq", None)
        if inv_freq is None:
            raise ValueError(f"{owner} exposes no {self.rotary}.inv_freq, which this scorer needs")
        if layer_idx in self.layers_without_rope:
            import torch

            return torch.zeros_like(inv_freq)
        return inv_freq

    def qk_norms(self, module: Any) -> tuple[torch.nn.Module, torch.nn.Module] | None:
        if self.qk_norm_names is None:
            return None
        q, k = self.qk_norm_names
        return getattr(module, q), getattr(module, k)

    def head_projection_styles(self, plan: Mapping[str, str]) -> dict[str, str]:
        marker = f".{self.attention}."
        styles = {key.rsplit(".", 1)[-1]: style for key, style in plan.items() if marker in key}
        return {name: styles.get(name, "replicated") for role, name in self.projection_names.items() if role != "o"}

    def engine_attention_modules(self, model: Any) -> list[torch.nn.Module]:
        decoder = getattr(model, "model", None)
        return [] if decoder is None else [getattr(layer, self.attention) for layer in decoder.layers]

    def engine_output_projection(self, module: Any) -> torch.nn.Module | None:
        return getattr(module, self.projection_names["o"], None)
