"""The one place that routes a transformers model through kvpress_ada: attention, prefill hook.

``with press(model):`` installs a forward pre-hook on the model and switches it to the
``"kvpress_ada"`` attention implementation (registered through transformers' public
``AttentionInterface``). At prefill the hook swaps in a fresh cache built by the press's evictor
(:class:`RaggedCache` for ``TopK``, :class:`MaskedCache` for ``Mask``) and passes a
:class:`PressRun` down to the attention function through the model's ``**kwargs``. The attention
function runs dense attention for the prefill of each layer, then scores, allocates and
compacts that layer before the next one runs.

A compressed cache outlives the block: :func:`attach` keeps the routing installed (without a
press) so ``model(..., cache=cache)`` and ``model.generate(cache=cache)`` (``past_key_values=``
before transformers 5.24) keep working on it; :func:`detach` removes it. Presses do not nest on one model.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterator, Protocol
from weakref import WeakKeyDictionary

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..observation import Observation
from . import compiled
from .decode_compression import after_decode_attention, start_decode
from .hf import cache_kwarg, check_left_padded, check_supported, input_shape, prefill_key_mask
from .model_pass import model_pass_scores
from .press_cache import PressCache
from .tensor_parallel import HeadShard, head_shard, local_weight

if TYPE_CHECKING:
    from ..pipeline import Pipeline

ATTENTION_NAME = "kvpress_ada"
RUN_KWARG = "kvpress_ada_run"


class PrefillHandler(Protocol):
    """What the ``"kvpress_ada"`` attention function needs for one forward pass.

    It is handed through the model's ``**kwargs`` under :data:`RUN_KWARG`; the attention function
    depends on this protocol alone (implemented by :class:`PressRun` and fan-out's ``CaptureRun``).
    """

    def handles_prefill(self, layer_idx: int) -> bool:
        """Whether this forward is the prefill of ``layer_idx`` that :meth:`after_prefill` handles."""

    def after_prefill(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float) -> None:
        """Called right after the layer's dense prefill attention with its post-RoPE tensors."""

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Attention for every other call (decode steps, layers already compressed)."""


@dataclass
class PressRun:
    """One forward with a press cache: compress each layer after its prefill (``compress``) and
    attend through the cache otherwise. ``press`` is ``None`` for decode-only routing."""

    press: Pipeline | None
    cache: PressCache
    model: torch.nn.Module
    compress: bool
    key_mask: torch.Tensor | None
    input_ids: torch.Tensor | None = None
    next_position: torch.Tensor | None = None  # [B] RoPE position after the prefill (model passes)
    decode: bool = False  # a decode forward of a press with decode compression (decode_compression.py)
    shard: HeadShard | None = None  # tensor parallelism: this rank's kv heads
    pending: dict[int, Observation] = field(default_factory=dict)

    def handles_prefill(self, layer_idx: int) -> bool:
        return self.compress and not self.cache.is_compressed(layer_idx)

    def after_prefill(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float) -> None:
        """Score, allocate and compact this layer right after its dense prefill attention (or keep
        its observation for :meth:`finish` when the press evicts at the end of prefill)."""
        if self.press is None:  # pragma: no cover - handles_prefill is False without a press
            return
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        obs = observation_for(self.press.scorer, self.model, layer_idx, len(self.cache.layers), query, key,
                              value, self.key_mask, scaling, _output_weight(module), shard=self.shard)
        if self.press.evicts_at_end:
            self.pending[layer_idx] = obs
        else:
            self.cache.compress_layer(layer_idx, self.press.select(obs))

    def after_forward(self, output: Any) -> Any:
        """Called by the routing's post-hook with the forward's output (``None`` when it raised);
        returns the output the caller gets."""
        self.cache.routed = False
        if output is not None:  # always_call: also reached when the forward raised
            self.finish()
        return output

    def finish(self) -> None:
        """End of the forward: evict every layer at once when the press waited for all of them."""
        pending, self.pending = self.pending, {}
        if self.press is None or len(pending) != len(self.cache.layers):
            return  # nothing waited, or the forward failed part-way (the error is already raised)
        layers = sorted(pending)
        observations = [pending[i] for i in layers]
        if type(self.press.scorer).needs_model_pass:
            assert self.key_mask is not None and self.next_position is not None
            # let go of the prefill tensors while the pass grows the cache: they are re-read after it
            empty = torch.empty(0)
            observations = [replace(obs, keys=empty, values=empty) for obs in observations]
            maps = model_pass_scores(self.model, self.press.scorer, self.cache, self.input_ids, self.key_mask,
                                     self.next_position)
            observations = [_with_dense(obs, self.cache.dense(i), m) for i, obs, m in zip(layers, observations, maps)]
        for layer_idx, keep in zip(layers, self.press.select_all(observations)):
            self.cache.compress_layer(layer_idx, keep)

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        out = self.cache.attend(layer_idx, query, key, value, attention_mask, scaling, sdpa_attention_forward,
                                module, **kwargs)
        if self.decode and self.press is not None:
            after_decode_attention(self.press, self.cache, self.model, layer_idx, query, scaling,
                                   _output_weight(module))
        return out


def _with_dense(obs: Observation, dense: tuple[torch.Tensor, torch.Tensor], pass_scores: torch.Tensor) -> Observation:
    return replace(obs, keys=dense[0], values=dense[1], pass_scores=pass_scores)


def _output_weight(module: torch.nn.Module) -> torch.Tensor:
    weight = local_weight(getattr(module, "o_proj").weight)  # tensor parallelism: the columns of this rank's heads
    assert isinstance(weight, torch.Tensor)
    return weight


def observation_for(scorer: Any, model: Any, layer_idx: int, n_layers: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, key_mask: torch.Tensor | None, scaling: float,
                    output_weight: torch.Tensor, shard: HeadShard | None = None) -> Observation:
    """The :class:`Observation` of one layer, holding only what ``scorer`` declares it reads.

    A scorer asking for a window of ``w`` trailing queries gets ``min(w, L)`` of them.
    """
    window = scorer.query_window()
    length = query.shape[2]
    queries = query if window is None else query[:, :, length - min(window, length):]
    if key_mask is None or key_mask.shape[-1] != key.shape[2]:
        key_mask = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
    return Observation(
        keys=key, values=value, queries=queries, key_mask=key_mask.to(key.device),
        layer_idx=layer_idx, n_layers=n_layers, scaling=scaling,
        output_weight=output_weight.detach() if scorer.needs_output_weight else None,
        rope_inv_freq=_rope_inv_freq(model) if scorer.needs_rope else None, shard=shard,
    )


def press_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Attention function registered as ``"kvpress_ada"``; dense SDPA when no handler is passed."""
    run: PrefillHandler | None = kwargs.pop(RUN_KWARG, None)
    scaling = float(module.scaling) if scaling is None else scaling  # type: ignore[arg-type]
    if run is None or run.handles_prefill(int(module.layer_idx)):  # type: ignore[arg-type]
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
        if run is not None:
            run.after_prefill(module, query, key, value, scaling)
        return out
    return run.attend(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)


AttentionInterface.register(ATTENTION_NAME, press_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _rope_inv_freq(model: Any) -> torch.Tensor:
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError(f"{type(model).__name__} exposes no rotary_emb.inv_freq, which this scorer needs")
    return rotary.inv_freq


def next_positions(position_ids: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """``[B]`` RoPE position following a prefill of ``shape`` (its ``position_ids`` when given)."""
    if isinstance(position_ids, torch.Tensor):
        return position_ids[:, -1].expand(shape[0]) + 1
    return torch.full((shape[0],), shape[1], dtype=torch.long)


def _check_sliding_window(model: Any, length: int) -> None:
    """Refuse a forward that would bring a press cache past the model's sliding window."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    uses = config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
    if window is not None and uses and length > window:
        raise ValueError(f"this forward brings the compressed cache to {length} tokens, past the model's sliding "
                         f"window ({window}); kvpress_ada presses do not support sliding-window attention: keep "
                         f"context + generated tokens <= {window}")


# ---------------------------------------------------------------------------------- routing
class _Route:
    """The hooks and attention implementation that route one model through kvpress_ada."""

    def __init__(self, model: Any):
        self.model = model
        self.press: Pipeline | None = None
        self.attached = False
        self.cache_key = cache_kwarg(model)
        self.previous = model.config._attn_implementation
        self.handles = [model.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
                        model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)]
        model.set_attn_implementation(ATTENTION_NAME)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.model.set_attn_implementation(self.previous)

    def _pre_hook(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if RUN_KWARG in kwargs:  # another handler (fan-out capture) owns this forward
            return args, kwargs
        press = self.press
        if press is not None and kwargs.get("use_cache") is False:
            raise ValueError("a press compresses the KV cache, but this forward runs with use_cache=False; "
                             "call the model with use_cache=True (the default of generate) or outside the press")
        given_key = "past_key_values" if "past_key_values" in kwargs else self.cache_key
        cache = kwargs.get(given_key)
        if not isinstance(cache, PressCache):
            fresh = cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0)
            if press is None:
                return args, kwargs
            if not fresh:
                assert cache is not None
                warnings.warn(f"{type(cache).__name__} already holds {cache.get_seq_length()} tokens that were "
                              "not compressed by this press; the forward runs uncompressed", stacklevel=3)
                return args, kwargs
            cache = press.evictor.new_cache(self.model.config)
        shape, _ = input_shape(args, kwargs)
        _check_sliding_window(self.model, cache.get_seq_length() + shape[1])
        prefill = press is not None and cache.get_seq_length() == 0
        if prefill and press is not None and press.prefill_chunk is not None and shape[1] > press.prefill_chunk:
            from .chunked_prefill import start_chunked_prefill

            if press.compresses_decode:
                start_decode(cache, prefill_key_mask(args, kwargs))
            kwargs.pop("past_key_values", None)
            return start_chunked_prefill(self.model, press, cache, args, kwargs, self.cache_key)
        run = PressRun(press=press, cache=cache, model=self.model, compress=False, key_mask=None,
                       decode=press is not None and press.compresses_decode and not prefill)
        if prefill:
            assert press is not None
            run.key_mask = prefill_key_mask(args, kwargs)
            check_left_padded(run.key_mask)
            if press.compresses_decode:
                start_decode(cache, run.key_mask)
            if press.compresses_prefill:
                run.compress = True
                press.check_context(int(run.key_mask.sum(-1).min()))
                run.input_ids = kwargs.get("input_ids", args[0] if args else None)
                run.next_position = next_positions(kwargs.get("position_ids"), shape)
            run.shard = head_shard(self.model)
        kwargs.pop("past_key_values", None)
        kwargs[self.cache_key] = cache
        kwargs[RUN_KWARG] = run
        cache.routed = True
        return args, kwargs

    def _post_hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        run = kwargs.get(RUN_KWARG)
        if isinstance(run, PressRun):
            return run.after_forward(output)
        return None


_ROUTES: WeakKeyDictionary[torch.nn.Module, _Route] = WeakKeyDictionary()


def _route(model: Any) -> _Route:
    route = _ROUTES.get(model)
    if route is None:
        route = _ROUTES[model] = _Route(model)
    return route


def _release(model: Any) -> None:
    route = _ROUTES.get(model)
    if route is not None and route.press is None and not route.attached:
        route.close()
        del _ROUTES[model]


def attach(model: Any) -> Any:
    """Keep ``model`` routed through kvpress_ada outside any ``with press(model)`` block, so a cache a
    press compressed can be used with ``model(...)`` and ``model.generate(cache=cache)``.
    Forwards with any other cache run exactly as before. Idempotent; undo with :func:`detach`."""
    check_supported(model)
    _route(model).attached = True
    return model


def detach(model: Any) -> Any:
    """Undo :func:`attach` (a running ``with press(model)`` block keeps its routing until it ends)."""
    route = _ROUTES.get(model)
    if route is not None:
        route.attached = False
        _release(model)
    return model


@contextmanager
def attention_routed(model: Any) -> Iterator[Any]:
    """Switch ``model`` to the ``"kvpress_ada"`` attention implementation inside the block."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def apply_press(press: Pipeline, model: Any, compile: bool | None = None) -> Iterator[Any]:
    """Apply ``press`` to ``model`` inside the ``with`` block (see the module docstring).

    ``compile``: run decode steps over the compressed cache through a compiled forward
    (:mod:`.compiled`; ``None``: on CUDA, off on CPU, ``$KVPRESS_ADA_COMPILE`` overrides)."""
    check_supported(model)
    # refuses a tensor-parallel layout the press cannot follow, before any forward
    if head_shard(model) is not None and (press.compresses_decode or press.prefill_chunk is not None):
        raise ValueError("decode compression (decode_budget) and chunked prefill (prefill_chunk) are not supported "
                         "on a tensor-parallel model yet; use a press without them")
    active = _ROUTES.get(model)
    if active is not None and active.press is not None:
        raise RuntimeError(f"a press ({type(active.press.scorer).__name__}) is already applied to this model; "
                           "`with press(model)` blocks do not nest: exit the outer block first")
    if press.is_noop:
        yield model
        return
    press.check_model(model)
    route = _route(model)
    route.press = press
    device = next(model.parameters()).device
    step = compiled.install(model, route.cache_key, compiled.default_mode(device)) \
        if compiled.compile_enabled(compile, device) else None
    try:
        yield model
    finally:
        if step is not None:
            compiled.uninstall(model)
        route.press = None
        _release(model)
