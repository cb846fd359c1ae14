"""The ``"kvpress_ada"`` attention function and the few helpers every mode handler shares.

A forward routed through kvpress_ada carries one :class:`Handler` in the model's ``**kwargs``
(:data:`RUN_KWARG`); the attention function hands each layer's post-RoPE tensors to it. Without a
handler the function is transformers' dense SDPA. Nothing here knows which mode is running.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ...evictors.rerotation import KeyRotation
from ...families import family_for, family_of
from ...observation import LayerView
from ...runtime import layer_view as build_view
from .press_cache import HeldEntries, SequenceState
from .tensor_parallel import HeadShard, local_weight

ATTENTION_NAME = "kvpress_ada"
RUN_KWARG = "kvpress_ada_run"


class Handler(Protocol):
    """What a forward routed through kvpress_ada needs of its mode (prefill, chunked prefill, decode,
    fan-out capture, a scorer's model pass): every handler implements every method, so the routing
    and the compiled step never ask which handler they hold."""

    def handles_prefill(self, layer_idx: int) -> bool:
        """Whether this forward is the prefill of ``layer_idx`` that :meth:`after_prefill` handles."""
        ...

    def after_prefill(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float) -> None:
        """Called right after the layer's dense prefill attention with its post-RoPE tensors."""
        ...

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Attention for every other call (decode steps, chunks, layers already compressed)."""
        ...

    def record_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        """The hidden states ``[B, T, hidden]`` entering layer ``layer_idx``'s attention (handed over
        only while a press whose scorer reads them is open, or while the handler's own recording runs)."""
        ...

    def after_forward(self, output: Any) -> Any:
        """End of the forward (``output`` is ``None`` when it raised): evictions that waited for every
        layer run here; returns the output the caller gets."""
        ...

    @property
    def traceable(self) -> bool:
        """Whether this forward only attends through the cache (no host-side work: a compiled step may run it)."""
        ...


def press_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Attention function registered as ``"kvpress_ada"``; dense SDPA when no handler is passed."""
    run: Handler | None = kwargs.pop(RUN_KWARG, None)
    scaling = float(module.scaling) if scaling is None else scaling  # type: ignore[arg-type]
    if run is None or run.handles_prefill(int(module.layer_idx)):  # type: ignore[arg-type]
        out = dense_attention(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
        if run is not None:
            run.after_prefill(module, query, key, value, scaling)
        return out
    return run.attend(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)


def register_attention() -> None:
    """Register :func:`press_attention` and transformers' SDPA mask as ``"kvpress_ada"`` with transformers
    (idempotent): called when a press is applied, so importing the host registers nothing."""
    AttentionInterface.register(ATTENTION_NAME, press_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@contextmanager
def attention_routed(model: Any) -> Iterator[Any]:
    """Switch ``model`` to the ``"kvpress_ada"`` attention implementation inside the block."""
    previous = model.config._attn_implementation
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The decoder's attention modules, in layer order (as the model's family reaches them)."""
    return family_of(model).attention_modules(model)


def attention_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states ``[B, T, hidden]`` an attention module's forward receives (after the layer's
    input norm), from the arguments a forward pre-hook sees."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor):
        raise RuntimeError("the attention module was called without hidden_states")
    return hidden


@contextmanager
def recording_attention_inputs(model: Any, record: Callable[[int, torch.Tensor], None],
                               enabled: bool = True) -> Iterator[None]:
    """While enabled, ``record(layer_idx, hidden [B, T, hidden])`` receives the hidden states entering
    every attention module, before its forward (a forward pre-hook per layer)."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        record(int(module.layer_idx), attention_input(args, kwargs))  # type: ignore[arg-type]

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in attention_modules(model)] if enabled else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def logit_extras(kwargs: dict) -> tuple[float | None, torch.Tensor | None]:
    """What a family's attention computes besides softmax of scaled logits, as its model hands it to the
    attention function: the logit soft-cap (``softcap``, Gemma-2) and the per-query-head sink logits
    (``s_aux``, GPT-OSS); ``(None, None)`` for plain attention."""
    return kwargs.get("softcap") or None, kwargs.get("s_aux")


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
                     scaling: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H_q, Q, D]`` attention of ``query`` over ``key``/``value [B, H_kv, L, D]`` (GQA) where ``allowed``
    (bool, broadcast to ``[B, H_q, Q, L]``; ``None``: everything) with the family's ``softcap`` and ``sinks [H_q]``:
    SDPA when neither is set, else the eager formula of the family's own attention."""
    Hq, H = query.shape[1], key.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                              enable_gqa=Hq != H)
    keys, values = key.repeat_interleave(Hq // H, dim=1), value.repeat_interleave(Hq // H, dim=1)
    logits = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, Hq, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs.nan_to_num(0.0), values.float()).to(query.dtype)


def dense_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """What a layer not compressed yet attends with: transformers' SDPA attention, or, for a family whose
    attention soft-caps its logits or adds sinks (:func:`logit_extras`), :func:`masked_attention` under the
    model's mask."""
    softcap, sinks = logit_extras(kwargs)
    if softcap is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    Q, L = query.shape[-2], key.shape[-2]
    if attention_mask is None:  # SDPA's is_causal: bottom-right aligned
        allowed = torch.ones(Q, L, dtype=torch.bool, device=query.device).tril(L - Q)
    else:
        mask = attention_mask[..., :L]
        allowed = mask if mask.dtype == torch.bool else mask == 0
    out = masked_attention(query, key, value, allowed, scaling, softcap, sinks)
    return out.transpose(1, 2).contiguous(), None


def output_weight(module: torch.nn.Module) -> torch.Tensor:
    """The attention module's output projection weight ``[hidden, H_q * D]`` (this rank's columns under
    tensor parallelism)."""
    weight = local_weight(family_for(getattr(module, "config", None)).output_weight(module))
    assert isinstance(weight, torch.Tensor)
    return weight


def rope_inv_freq(model: Any, layer_idx: int = 0) -> torch.Tensor:
    """The RoPE inverse frequencies ``[D // 2]`` of layer ``layer_idx`` (a one-line ``ValueError`` when the model
    has none)."""
    return family_of(model).rope_inv_freq(model, layer_idx)


def record_entry_scores(state: SequenceState, scorer: Any, layer_idx: int, hidden: torch.Tensor,
                        shard: HeadShard | None = None) -> None:
    """Score the entries of the tokens entering layer ``layer_idx`` from their hidden states
    (``scorer.entry_scores``; this rank's kv heads under tensor parallelism) and append the scores
    to ``state``."""
    with torch.no_grad():
        scores = scorer.entry_scores(hidden, layer_idx).detach().float()
    state.add_entry_scores(layer_idx, scores if shard is None else shard.local(scores))


@dataclass(frozen=True)
class ModuleInputs:
    """The :class:`~kvpress_ada.runtime.LayerInputs` of a transformers attention ``module`` of ``model``."""

    model: Any
    module: torch.nn.Module

    def output_weight(self, layer_idx: int) -> torch.Tensor:
        return output_weight(self.module)

    def rope_inv_freq(self, layer_idx: int) -> torch.Tensor:
        return rope_inv_freq(self.model, layer_idx)


def key_rotation(model: Any, rows: torch.Tensor | None = None) -> KeyRotation:
    """How a cache of ``model`` re-rotates the keys a press keeps (each layer's RoPE frequencies, none for the
    layers its family declares without RoPE); ``rows [B]``: the batch rows that re-rotate (``None``: all)."""
    without = set(family_of(model).layers_without_rope)
    return KeyRotation(inv_freqs=tuple(None if i in without else ModuleInputs(model, m).rope_inv_freq(i).detach()
                                       for i, m in enumerate(attention_modules(model))), rows=rows)


def layer_view(scorer: Any, model: Any, module: torch.nn.Module, n_layers: int, held: HeldEntries,
               queries: torch.Tensor, scaling: float, shard: HeadShard | None = None,
               pass_scores: torch.Tensor | None = None, state: SequenceState | None = None,
               entry_scores: torch.Tensor | None = None, scope: tuple[int, ...] | None = None) -> LayerView:
    """The runtime's :func:`~kvpress_ada.runtime.layer_view` of the layer of attention ``module`` holding ``held``,
    scored with ``queries``; the held entries' hidden-state scores are ``entry_scores``, else looked up in
    ``state`` by position, for a scorer that reads hidden states. ``scope``: the layers the press compresses
    (default: ``state``'s)."""
    layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
    if scorer.reads_hidden_states and entry_scores is None and state is not None:
        entry_scores = state.entry_scores_at(layer_idx, held.positions)
    return build_view(scorer, held, queries, layer_idx=layer_idx, n_layers=n_layers, scaling=scaling,
                      inputs=ModuleInputs(model, module), shard=shard, pass_scores=pass_scores,
                      entry_scores=entry_scores, scope=scope if scope is not None else None if state is None
                      else state.scope)
