"""Fan-out: prefill once, derive the compressed cache of any number of presses.

Compression happens after each layer's dense prefill attention and never changes the prefill's
hidden states, so every press sees the same observations. :func:`capture_prefill` records them
(keys, values, all queries) once; :meth:`Prefill.compressed_cache` then builds exactly the cache
that running the press on its own would have built, without another prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from ...families import family_of
from ...runtime import Schedule, compressed_layers, held_windows
from ...scorers.base import PassScorer
from .attention import RUN_KWARG, attention_routed, key_rotation, layer_view, recording_attention_inputs
from .caches import new_cache, ragged_cache
from .checks import check_press
from .hf import cache_kwarg, check_left_padded, check_supported, prefill_key_mask
from .model_pass import RecordingRun, model_pass_scores
from .press_cache import HeldEntries
from .ragged_cache import RaggedCache, read_with
from .routing import next_positions
from .tensor_parallel import head_shard
from .window_layer import WindowLayer


@dataclass
class LayerCapture:
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    scaling: float
    module: torch.nn.Module  # the attention module (its output projection, its layer index)
    hidden: torch.Tensor | None = None  # [B, L, hidden] entering the attention (capture_prefill(hidden_states=True))


@dataclass
class CaptureRun(RecordingRun):
    """The handler that records each layer's prefill instead of compressing it (every layer's forward
    is its prefill)."""

    layers: dict[int, LayerCapture] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    def record_hidden(self, layer_idx: int, hidden: torch.Tensor) -> None:
        self.hidden[layer_idx] = hidden

    def handles_prefill(self, layer_idx: int) -> bool:
        return True

    def after_prefill(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float) -> None:
        layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        self.layers[layer_idx] = LayerCapture(key, value, query, scaling, module, self.hidden.pop(layer_idx, None))

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        raise RuntimeError("CaptureRun handles the prefill of every layer")  # pragma: no cover


@dataclass
class Prefill:
    """One prefill's observations, its dense cache and its last-position logits."""

    model: Any  # a transformers PreTrainedModel
    layers: list[LayerCapture]
    key_mask: torch.Tensor
    full_cache: DynamicCache
    logits: torch.Tensor
    input_ids: torch.Tensor | None = None
    pass_cache: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    entry_cache: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def scope(self) -> tuple[int, ...]:
        """The layers a press compresses (the hybrid rule: not a hybrid model's sliding-window layers)."""
        return compressed_layers(family_of(self.model))

    def window_mask(self, layer_idx: int) -> torch.Tensor:
        """``[B, H_kv, L]`` what a sliding-window layer a press leaves to its window holds after this prefill."""
        c = self.layers[layer_idx]
        B, H, L, _ = c.keys.shape
        window = family_of(self.model).sliding_window
        assert window is not None
        recent = torch.arange(L, device=c.keys.device) >= L - (window - 1)
        return (self.key_mask[:, None, :] & recent).expand(B, H, L)

    @property
    def seq_len(self) -> int:
        return self.key_mask.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values of the full (uncompressed) cache of this prefill: what the model's own cache
        holds (a hybrid model's sliding-window layers: their window, not every token)."""
        held = [getattr(layer, name, None) for layer in self.full_cache.layers for name in ("keys", "values")]
        return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))

    def view(self, scorer, layer_idx: int, pass_scores: torch.Tensor | None = None):
        """The :class:`~kvpress_ada.observation.LayerView` of layer ``layer_idx``'s dense prefill."""
        c = self.layers[layer_idx]
        B, H, L, _ = c.keys.shape
        valid = self.key_mask[:, None, :].expand(B, H, L)
        held = HeldEntries(c.keys, c.values, valid, torch.arange(L, device=c.keys.device).expand(B, H, L), uniform=True)
        entry = self.entry_scores(scorer)[layer_idx] if scorer.reads_hidden_states else None
        return layer_view(scorer, self.model, c.module, len(self.layers), held, c.queries, c.scaling,
                          head_shard(self.model), pass_scores, entry_scores=entry, scope=self.scope)

    def entry_scores(self, scorer) -> list[torch.Tensor]:
        """``[B, H_kv, L]`` per layer: what a scorer reading hidden states gives every entry (computed
        once per scorer configuration from the captured hidden states, then cached)."""
        key = scorer.model_dump_json()
        if key not in self.entry_cache:
            if any(c.hidden is None for c in self.layers):
                raise ValueError(f"{type(scorer).__name__} scores entries from the hidden states entering attention: "
                                 "capture the prefill with capture_prefill(..., hidden_states=True)")
            shard = head_shard(self.model)
            with torch.no_grad():
                scores = [scorer.entry_scores(c.hidden, i).float() for i, c in enumerate(self.layers)]
            self.entry_cache[key] = scores if shard is None else [shard.local(s) for s in scores]
        return self.entry_cache[key]

    def keep_masks(self, press) -> list[torch.Tensor]:
        """The keep mask ``[B, H_kv, L]`` the press selects in every layer."""
        if press.is_noop:
            return [torch.ones(c.keys.shape[:3], dtype=torch.bool, device=c.keys.device) for c in self.layers]
        Schedule(press).check_fan_out(self.seq_len)
        press.check_context(int(self.key_mask.sum(-1).min()))
        check_press(press, self.model)
        scorer = press.scorer
        scope = self.scope
        maps = self.pass_scores(scorer) if isinstance(scorer, PassScorer) else [None] * len(self.layers)
        views = [self.view(press.scorer, i, maps[i]) for i in scope]
        kept = dict(zip(scope, press.keep(views, press.prefill_budget(self.key_mask.sum(-1)))))
        return [kept[i] if i in kept else self.window_mask(i) for i in range(len(self.layers))]

    def pass_scores(self, scorer: PassScorer) -> list[torch.Tensor]:
        """``[B, H_kv, L]`` per layer: what ``scorer``'s model pass measured over the full cache (run
        once per scorer configuration, then cached); zeros in a sliding-window layer a press leaves to its
        window (a hybrid model's: the pass scores the layers a press compresses)."""
        key = scorer.model_dump_json()
        if key not in self.pass_cache:
            scope = self.scope
            maps = dict(zip(scope, model_pass_scores(self.model, scorer, self.full_cache, self.input_ids,
                                                     self.key_mask, next_positions(None, self.key_mask.shape),
                                                     scope)))
            self.pass_cache[key] = [maps[i] if i in maps else c.keys.new_zeros(c.keys.shape[:3], dtype=torch.float32)
                                    for i, c in enumerate(self.layers)]
        return self.pass_cache[key]

    def compressed_batch(self, presses: list, keep_masks: list[list[torch.Tensor]]) -> RaggedCache:
        """One ragged cache whose batch row ``e`` holds what ``presses[e]`` keeps of this (batch 1)
        prefill: the rows are laid out independently, so row ``e`` attends to exactly the entries of
        ``compressed_cache(presses[e])`` and decoding all rows at once answers every press in one
        batch (fan-out evaluation's decode)."""
        if self.key_mask.shape[0] != 1:
            raise ValueError("compressed_batch stacks presses of a batch-1 prefill, not batch "
                             f"{self.key_mask.shape[0]}")
        if any(p.rewrites_kept for p in presses):
            raise ValueError("compressed_batch shares the prefill's entries between its rows, and a press that merges "
                             "dropped values or prunes key channels rewrites them: build its cache with "
                             "compressed_cache(press)")
        storages = {p.storage for p in presses}
        if len(storages) > 1:
            raise ValueError("compressed_batch stacks presses of one storage, got "
                             f"{sorted(s.label for s in storages)}: batch each storage apart")
        readers = {p.reader for p in presses}
        if len(readers) > 1:
            raise ValueError("compressed_batch stacks presses of one reader (every row of a cache reads alike), got "
                             f"{len(readers)}: batch each reader apart")
        cache = ragged_cache(presses[0].storage, self.model.config) if presses else RaggedCache(self.model.config)
        read_with(cache, next(iter(readers), None))
        E = len(presses)
        rotating = torch.tensor([p.evictor.rerotate for p in presses], dtype=torch.bool)
        if bool(rotating.any()):  # the rows of the presses whose evictor re-rotates the keys it keeps
            cache.rerotation = key_rotation(self.model, rotating)
        scope = cache.compressed_layers()
        for i, c in enumerate(self.layers):
            cache.update(c.keys.expand(E, -1, -1, -1), c.values.expand(E, -1, -1, -1), i)
            if i in scope:  # a sliding-window layer keeps its window
                cache.retain(i, torch.cat([masks[i] for masks in keep_masks], dim=0))
        return cache

    def compressed_cache(self, press, keep_masks: list[torch.Tensor] | None = None):
        """A fresh cache holding what ``press`` keeps (a dense copy for a no-op press)."""
        if press is None or press.is_noop:
            cache = DynamicCache(config=self.model.config)
            for i, c in enumerate(self.layers):
                cache.update(c.keys.clone(), c.values.clone(), i)
            return cache
        keep_masks = self.keep_masks(press) if keep_masks is None else keep_masks
        compressed = new_cache(press, self.model.config)
        compressed.state.key_mask = self.key_mask
        compressed.rerotation = key_rotation(self.model) if press.evictor.rerotate else None
        read_with(compressed, press.reader)
        scope = compressed.compressed_layers()
        for i, (c, keep) in enumerate(zip(self.layers, keep_masks)):
            compressed.update(c.keys, c.values, i)
            if i in scope:  # a sliding-window layer keeps its window
                held = None
                if press.rewrites_kept:  # merge the dropped values, prune key channels
                    held = press.rewrite(self.view(press.scorer, i), keep, compressed.view(i))
                compressed.retain(i, keep, held)
        return compressed


@torch.inference_mode()
def capture_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    hidden_states: bool = False) -> Prefill:
    """Prefill ``input_ids`` once with dense attention and record what every press needs;
    ``hidden_states=True`` also records each layer's attention input ``[B, L, hidden]``
    (:attr:`LayerCapture.hidden`: what scorers reading hidden states need)."""
    check_supported(model)
    key_mask = prefill_key_mask((), {"input_ids": input_ids, "attention_mask": attention_mask})
    check_left_padded(key_mask)
    cache = DynamicCache(config=model.config)
    window = family_of(model).sliding_window
    for i in held_windows(family_of(model)):  # what a model pass over this cache crops off must come back
        cache.layers[i] = WindowLayer(sliding_window=int(window or 0))
    run = CaptureRun()
    # only the last position's logits are kept: a 262k-token vocabulary (Gemma) over an 8k prompt is 8.4 GB in fp32
    kwargs = {"input_ids": input_ids, "use_cache": True, "logits_to_keep": 1, cache_kwarg(model): cache, RUN_KWARG: run}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with attention_routed(model), recording_attention_inputs(model, run.record_hidden, hidden_states):
        out = model(**kwargs)
    layers = [run.layers[i] for i in range(len(run.layers))]
    return Prefill(model=model, layers=layers, key_mask=key_mask, full_cache=cache, logits=out.logits[:, -1],
                   input_ids=input_ids)
