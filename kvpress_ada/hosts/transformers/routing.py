"""The one place that routes a transformers model through kvpress_ada: attention, prefill hook.

``with press(model):`` installs a forward pre-hook on the model and switches it to the
``"kvpress_ada"`` attention implementation (registered through transformers' public
``AttentionInterface``). At prefill the hook swaps in a fresh cache built by the press's evictor
(:class:`RaggedCache` for ``TopK``, :class:`MaskedCache` for ``Mask``). The pre-hook then picks the
mode of the forward in one place (:meth:`_Route._handler`; chunked prefill when the press chunks a
prompt this long) and passes its handler down to the attention function through the model's
``**kwargs``: :class:`~.prefill.PrefillRun` (compress each layer after its prefill, or all layers at
the end of it), :class:`~.chunked_prefill.ChunkedPrefill`, :class:`~.decode_compression.DecodeRun`
(attention through the cache, with decode compaction when the press asks for it). Every handler that
evicts calls :meth:`Pipeline.keep <kvpress_ada.Pipeline.keep>`.

A compressed cache outlives the block: :func:`attach` keeps the routing installed (without a
press) so ``model(..., cache=cache)`` and ``model.generate(cache=cache)`` (``past_key_values=``
before transformers 5.24) keep working on it; :func:`detach` removes it.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Iterator
from weakref import WeakKeyDictionary

import torch
from transformers import DynamicCache

from ...families import Family, family_of
from ...runtime import Schedule, window_limit
from . import compiled
from .attention import (
    ATTENTION_NAME,
    RUN_KWARG,
    Handler,
    attention_input,
    attention_modules,
    key_rotation,
    register_attention,
)
from .caches import new_cache
from .checks import check_press
from .chunked_prefill import start_chunked_prefill
from .decode_compression import DecodeRun, hidden_scorer
from .hf import cache_kwarg, check_left_padded, check_supported, input_shape, prefill_key_mask
from .prefill import PrefillRun
from .press_cache import PressCache, SequenceState
from .ragged_cache import read_with
from .tensor_parallel import head_shard

if TYPE_CHECKING:
    from ...pipeline import Pipeline


def next_positions(position_ids: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """``[B]`` RoPE position following a prefill of ``shape`` (its ``position_ids`` when given)."""
    if isinstance(position_ids, torch.Tensor):
        return position_ids[:, -1].expand(shape[0]) + 1
    return torch.full((shape[0],), shape[1], dtype=torch.long)


def _check_sliding_window(family: Family, length: int) -> None:
    """Refuse a forward that would bring a press cache past the window of a model whose every layer slides (its
    layers are compressed as global ones: :func:`~kvpress_ada.runtime.window_limit`)."""
    window = window_limit(family)
    if window is not None and length > window:
        raise ValueError(f"this forward brings the compressed cache to {length} tokens, past the model's sliding "
                         f"window ({window}); every layer of this model slides, so a press compresses its layers as "
                         f"global ones, which holds only within the window: keep context + generated tokens <= "
                         f"{window}")


# ---------------------------------------------------------------------------------- routing
class _Route:
    """The hooks and attention implementation that route one model through kvpress_ada."""

    def __init__(self, model: Any):
        self.model = model
        self.presses: dict[int, Pipeline] = {}  # thread id -> the press that thread's open block applies
        self.compiled_blocks = 0  # open blocks that asked for compiled decoding
        self.hidden_blocks = 0  # open blocks whose scorer reads the hidden states entering attention
        self.hidden_handles: list[Any] = []
        self.attached = False
        self.cache_key = cache_kwarg(model)
        self.family = family_of(model)
        self.previous = model.config._attn_implementation
        self.handles = [model.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
                        model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)]
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)

    def close(self) -> None:
        for handle in self.handles + self.hidden_handles:
            handle.remove()
        self.model.set_attn_implementation(self.previous)

    def read_hidden_states(self, on: bool) -> None:
        """Open (``on``) or close a block whose scorer reads hidden states: while any is open, every
        attention module hands its input hidden states to the forward's handler (``record_hidden``)."""
        self.hidden_blocks += 1 if on else -1
        if self.hidden_blocks == 1 and on:
            hook = partial(_hand_hidden_states, self.family)
            self.hidden_handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
                                   for m in attention_modules(self.model)]
        elif self.hidden_blocks == 0:
            for handle in self.hidden_handles:
                handle.remove()
            self.hidden_handles = []

    def _pre_hook(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if RUN_KWARG in kwargs:  # a handler already owns this forward (a chunk, fan-out capture, a model pass)
            return args, kwargs
        press = self.presses.get(threading.get_ident())
        if press is not None and kwargs.get("use_cache") is False:
            raise ValueError("a press compresses the KV cache, but this forward runs with use_cache=False; "
                             "call the model with use_cache=True (the default of generate) or outside the press")
        given_key = "past_key_values" if "past_key_values" in kwargs else self.cache_key
        cache = kwargs.get(given_key)
        if not isinstance(cache, PressCache):
            offloaded = getattr(cache, "offloading", False)
            fresh = cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0 and not offloaded)
            if press is None:
                return args, kwargs
            if cache is not None and (offloaded or (not fresh and cache.get_seq_length() == 0)):
                raise ValueError(f"a press compresses into its own cache and cannot use this {type(cache).__name__}"
                                 f"{' (offloaded)' if offloaded else ''}: leave cache_implementation unset (or "
                                 "pass an empty DynamicCache) under a press")
            if not fresh:
                assert cache is not None
                warnings.warn(f"{type(cache).__name__} already holds {cache.get_seq_length()} tokens that were "
                              "not compressed by this press; the forward runs uncompressed", stacklevel=3)
                return args, kwargs
            cache = new_cache(press, self.model.config)
        shape, _ = input_shape(args, kwargs)
        _check_sliding_window(self.family, cache.get_seq_length() + shape[1])
        kwargs.pop("past_key_values", None)
        if press is not None and cache.get_seq_length() == 0:  # a prefill under the press
            if not cache.stores(press.storage):
                raise ValueError(f"this {type(cache).__name__} does not store entries as the press's "
                                 f"storage={press.storage.label!r}: pass no cache (the press builds one) or a cache "
                                 "of that storage")
            key_mask = prefill_key_mask(args, kwargs)
            check_left_padded(key_mask)
            cache.state = SequenceState(n_layers=len(cache.layers), key_mask=key_mask, prompt=int(shape[1]),
                                        compressed=cache.compressed_layers())
            cache.rerotation = key_rotation(self.model) if press.evictor.rerotate else None
            read_with(cache, press.reader)
            if Schedule(press).chunked(shape[1]):
                return start_chunked_prefill(self.model, press, cache, args, kwargs, self.cache_key)
        if kwargs.get("output_attentions") or getattr(self.model.config, "output_attentions", False):
            raise ValueError("output_attentions=True is not supported through a press cache (its attention returns "
                             "no weights); call the model without it")
        run = self._handler(press, cache, args, kwargs, shape)
        kwargs[self.cache_key] = cache
        kwargs[RUN_KWARG] = run
        cache.routed = True
        return args, kwargs

    def _handler(self, press: Pipeline | None, cache: PressCache, args: tuple, kwargs: dict,
                 shape: torch.Size) -> Handler:
        """The mode of this forward: a compressed prefill, or attention through the cache (with decode
        compaction when the press compacts while generating; never during the prefill itself)."""
        prefill = cache.get_seq_length() == 0
        steps = cache.state.advance(Schedule(press), int(shape[1])) if press is not None and prefill else []
        due = next((step.due for step in steps if step.due is not None), None)
        if press is not None and prefill and due is not None:
            key_mask = cache.state.key_mask
            assert key_mask is not None
            press.check_context(int(key_mask.sum(-1).min()))
            return PrefillRun(press=press, cache=cache, model=self.model, key_mask=key_mask, due=due,
                              input_ids=kwargs.get("input_ids", args[0] if args else None),
                              next_position=next_positions(kwargs.get("position_ids"), shape),
                              shard=head_shard(self.model))
        if press is not None and press.compresses_decode and not prefill:
            return DecodeRun.for_step(cache, self.model, press, int(shape[1]))
        return DecodeRun(cache=cache, model=self.model, hidden_scorer=hidden_scorer(press) if prefill else None)

    def _post_hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        run: Handler | None = kwargs.get(RUN_KWARG)
        return None if run is None else run.after_forward(output)


def _hand_hidden_states(family: Family, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of an attention module: its input hidden states go to the forward's handler."""
    run: Handler | None = kwargs.get(RUN_KWARG)
    if run is not None:
        run.record_hidden(family.layer_index(module), attention_input(args, kwargs))


_ROUTES: WeakKeyDictionary[torch.nn.Module, _Route] = WeakKeyDictionary()
_LOCK = threading.RLock()  # guards _ROUTES and every route's hooks, presses and compiled forward


def _route(model: Any) -> _Route:
    route = _ROUTES.get(model)
    if route is None:
        route = _ROUTES[model] = _Route(model)
    return route


def _release(model: Any) -> None:
    route = _ROUTES.get(model)
    if route is not None and not route.presses and not route.attached:
        route.close()
        del _ROUTES[model]


def attach(model: Any) -> Any:
    """Keep ``model`` routed through kvpress_ada outside any ``with press(model)`` block, so a cache a
    press compressed can be used with ``model(...)`` and ``model.generate(cache=cache)``.
    Forwards with any other cache run exactly as before. Idempotent; undo with :func:`detach`."""
    check_supported(model)
    with _LOCK:
        _route(model).attached = True
    return model


def detach(model: Any) -> Any:
    """Undo :func:`attach` (a running ``with press(model)`` block keeps its routing until it ends)."""
    with _LOCK:
        route = _ROUTES.get(model)
        if route is not None:
            route.attached = False
            _release(model)
    return model


@contextmanager
def apply_press(press: Pipeline, model: Any, compile: bool | None = None) -> Iterator[Any]:
    """Apply ``press`` to ``model`` inside the ``with`` block (see the module docstring).

    Threads: a block applies to the forwards of the thread that opened it; forwards of other threads
    run as if no press were open (dense attention, their own caches), each thread may hold its own
    block on the same model, and one thread's blocks do not nest. ``compile``: run decode steps over
    the compressed cache through a compiled forward (:mod:`.compiled`; ``None``: on CUDA, off on CPU,
    ``$KVPRESS_ADA_COMPILE`` overrides)."""
    check_supported(model)
    me = threading.get_ident()
    with _LOCK:
        active = _ROUTES.get(model)
        if active is not None and me in active.presses:
            raise RuntimeError(f"a press ({type(active.presses[me].scorer).__name__}) is already applied to this "
                               "model in this thread; `with press(model)` blocks do not nest: exit the outer block "
                               "first")
    if press.is_noop:
        yield model
        return
    check_press(press, model)
    device = next(model.parameters()).device
    compiling = compiled.compile_enabled(compile, device)
    hidden = press.scorer.reads_hidden_states
    with _LOCK:
        route = _route(model)
        route.presses[me] = press
        if hidden:
            route.read_hidden_states(True)
        if compiling:
            compiled.install(model, route.cache_key, compiled.default_mode(device))
            route.compiled_blocks += 1
    try:
        yield model
    finally:
        with _LOCK:
            route.presses.pop(me, None)
            if hidden:
                route.read_hidden_states(False)
            if compiling:
                route.compiled_blocks -= 1
                if route.compiled_blocks == 0:
                    compiled.uninstall(model)
            _release(model)
