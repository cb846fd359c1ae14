"""The one place that touches transformers: attention registration, the prefill hook, caches.

``with press(model):`` registers a forward pre-hook on the model and switches it to the
``"kvpress_ada"`` attention implementation (registered through transformers' public
``AttentionInterface``). At prefill the hook swaps in a fresh :class:`RaggedCache` (``TopK``)
or :class:`MaskedCache` (``Mask``) and passes a :class:`PressRun` down to the attention
function through the model's ``**kwargs``. The attention function runs dense attention for the
prefill of each layer, then scores, allocates and compacts that layer before the next one runs.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..observation import Observation
from .hf import cache_kwarg, check_supported, prefill_key_mask
from .masked_cache import MaskedCache
from .ragged_cache import RaggedCache

ATTENTION_NAME = "kvpress_ada"
RUN_KWARG = "kvpress_ada_run"


@dataclass
class PressRun:
    """What the attention function needs for one forward pass."""

    press: "object"
    cache: RaggedCache | MaskedCache
    model: torch.nn.Module
    compress: bool
    key_mask: torch.Tensor | None

    def handles_prefill(self, layer_idx: int) -> bool:
        return self.compress and not self.cache.is_compressed(layer_idx)

    def after_prefill(self, module, query, key, value, scaling) -> None:
        """Score, allocate and compact this layer right after its dense prefill attention."""
        obs = observation_for(self.press.scorer, self.model, module.layer_idx, len(self.cache.layers), query, key,
                              value, self.key_mask, scaling, module.o_proj.weight)
        self.cache.compress_layer(module.layer_idx, self.press.select(obs))


def observation_for(scorer, model, layer_idx, n_layers, query, key, value, key_mask, scaling, output_weight):
    """The :class:`Observation` of one layer, holding only what ``scorer`` declares it reads."""
    window = scorer.query_window()
    queries = query if window is None else query[:, :, query.shape[2] - window:]
    if key_mask is None or key_mask.shape[-1] != key.shape[2]:
        key_mask = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
    return Observation(
        keys=key, values=value, queries=queries, key_mask=key_mask.to(key.device),
        layer_idx=layer_idx, n_layers=n_layers, scaling=scaling,
        output_weight=output_weight.detach() if scorer.needs_output_weight else None,
        rope_inv_freq=_rope_inv_freq(model) if scorer.needs_rope else None,
    )


def press_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered as ``"kvpress_ada"``; dense SDPA when no press is running."""
    run: PressRun | None = kwargs.pop(RUN_KWARG, None)
    scaling = module.scaling if scaling is None else scaling
    if run is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    layer_idx = module.layer_idx
    if run.handles_prefill(layer_idx):
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        run.after_prefill(module, query, key, value, scaling)
        return out
    return run.cache.attend(layer_idx, query, key, value, attention_mask, scaling, sdpa_attention_forward, module,
                        dropout=dropout, **kwargs)


AttentionInterface.register(ATTENTION_NAME, press_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)




def new_cache(press, model):
    """The cache a press compresses into: ragged for ``TopK``, masked for ``Mask``."""
    if press.evictor.cache_kind == "ragged":
        return RaggedCache(config=model.config)
    return MaskedCache(config=model.config)




def _rope_inv_freq(model) -> torch.Tensor:
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError(f"{type(model).__name__} exposes no rotary_emb.inv_freq, which this scorer needs")
    return rotary.inv_freq


def _check_sliding_window(model, length: int) -> None:
    config = model.config
    window = getattr(config, "sliding_window", None)
    uses = config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
    if window is not None and uses and length > window:
        raise ValueError(f"context of {length} tokens exceeds the model's sliding window ({window}): "
                         "sliding-window attention layers are not supported by kvpress_ada presses")


def _make_pre_hook(press, model):
    cache_key = cache_kwarg(model)

    def pre_hook(module, args, kwargs):
        if kwargs.get("use_cache") is False:
            raise ValueError("a press compresses the KV cache, but this forward runs with use_cache=False; "
                             "call the model with use_cache=True (the default of generate) or outside the press")
        given_key = "past_key_values" if "past_key_values" in kwargs else cache_key
        cache = kwargs.get(given_key)
        fresh = cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0)
        if fresh:
            cache = new_cache(press, model)
        elif not isinstance(cache, (RaggedCache, MaskedCache)):
            warnings.warn(f"{type(cache).__name__} already holds {cache.get_seq_length()} tokens that were not "
                          "compressed by this press; the forward runs uncompressed", stacklevel=2)
            return args, kwargs
        prefill = cache.get_seq_length() == 0
        key_mask = None
        if prefill:
            key_mask = prefill_key_mask(args, kwargs)
            length = key_mask.shape[-1]
            min_valid = int(key_mask.sum(-1).min())
            press.check_context(min_valid)
            _check_sliding_window(model, length)
        kwargs.pop("past_key_values", None)
        kwargs[cache_key] = cache
        kwargs[RUN_KWARG] = PressRun(press=press, cache=cache, model=model, compress=prefill, key_mask=key_mask)
        return args, kwargs

    return pre_hook




@contextmanager
def attention_routed(model):
    """Switch ``model`` to the ``"kvpress_ada"`` attention implementation inside the block."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@contextmanager
def apply_press(press, model):
    """Apply ``press`` to ``model`` inside the ``with`` block (see the module docstring)."""
    check_supported(model)
    if press.is_noop:
        yield model
        return
    handle = model.register_forward_pre_hook(_make_pre_hook(press, model), with_kwargs=True)
    try:
        with attention_routed(model):
            yield model
    finally:
        handle.remove()
