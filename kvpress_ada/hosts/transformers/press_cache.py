"""The contract every cache a press compresses into follows, and the one base class they share.

The host builds a press's cache (:func:`~.caches.new_cache`, from its evictor and storage); the cache is
a transformers ``Cache`` made of :class:`PressLayer` objects. A layer gives one view of what it
holds (:meth:`PressLayer.view`, dense while its prefill is in flight) and takes back one keep mask
over that view (:meth:`PressLayer.retain`, which drops or hides the rest);
:meth:`PressLayer.attend` computes attention over what is left. A new cache kind (quantized,
paged, offloaded) is one layer class, one cache class and one registered evictor.

A compressed layer is only correct under the ``"kvpress_ada"`` attention function (inside
``with press(model)`` or after :func:`kvpress_ada.attach`), so :meth:`PressCache.update` refuses
a compressed layer when the model was called without that routing, with one line saying what to
do, instead of failing deep inside transformers or, for the masked cache, attending to evicted
entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...evictors.rerotation import KeyRotation
from ...runtime import HeldEntries, LayerClock, Schedule, Step
from .entries import real_entries

DenseAttention = Callable[..., tuple[torch.Tensor, Any]]


class PressLayer(Protocol):
    """One layer of a press cache: one view of what it holds, one way to keep part of it."""

    compressed: bool

    def view(self, key_mask: torch.Tensor | None = None) -> HeldEntries:
        """What the layer holds. ``key_mask [B, L0]``: the real tokens of the prefill (a layer not
        compressed yet holds its padding too; tokens appended after ``L0`` are real)."""

    def retain(self, keep: torch.Tensor, held: HeldEntries, spare: int | None = None) -> None:
        """Keep the entries of ``held`` (this layer's :meth:`view`) where ``keep [B, H_kv, L]`` is True;
        the rest leave the layer. ``spare``: free slots per row for the tokens appended next. The layer keeps
        ``held``'s keys (a press may have re-rotated them) when it is not compressed yet, or when it declares
        ``rewrites_kept_keys``; otherwise a compressed layer's kept entries move as they are stored."""

    def head_lengths(self) -> torch.Tensor:
        """Entries each (batch, kv head) attends to, ``LongTensor[B, H_kv]``."""

    def nbytes(self) -> int:
        """Bytes held for keys and values."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float, dense_fn: DenseAttention, module: torch.nn.Module,
               **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Attention output ``[B, Q, H_q, D]`` of ``query`` over this layer (after ``update``)."""


def uncroppable(n: int, appended: int) -> ValueError:
    """The one-line refusal of a crop reaching entries a press compressed (what assisted decoding asks for when it
    rejects a candidate that the press counted as prompt)."""
    return ValueError(f"cannot crop {n} tokens: only {appended} were appended after compression (compressed entries "
                      "cannot be restored; assisted decoding, which rewinds rejected candidates, is not supported "
                      "under a press)")


class DenseUntilKept(CacheLayerMixin):
    """The part every compressing layer shares: dense (the forward's keys and values, concatenated, stored
    detached) until it first keeps a selection (``compressed``), then whatever its subclass stores. ``seen``
    counts the tokens fed (context + appended): RoPE positions continue from it. A subclass stores its kept
    entries and implements :meth:`_crop_kept`."""

    is_sliding = False
    is_croppable = True

    def _reset_dense(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        self.compressed = False
        self.seen = 0

    def _update_dense(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a dense forward's keys and values (stored detached: the cache never pins the autograd graph)."""
        self.seen += key_states.shape[-2]
        keys = key_states if self.keys is None else torch.cat([self.keys, key_states], dim=-2)
        values = value_states if self.values is None else torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = keys.detach(), values.detach()
        return keys, values

    def _dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None:
            raise ValueError("cannot compress a layer that holds no tokens")
        return self.keys, self.values

    def _dense_view(self, key_mask: torch.Tensor | None) -> HeldEntries:
        keys, values = self._dense()
        B, H, L, _ = keys.shape
        positions = torch.arange(L, device=keys.device).expand(B, H, L)
        return HeldEntries(keys, values, real_entries(key_mask, positions), positions, uniform=True)

    def _dense_head_lengths(self) -> torch.Tensor:
        if self.keys is None:
            return torch.zeros(0, 0, dtype=torch.long)
        B, H, L, _ = self.keys.shape
        return torch.full((B, H), L, dtype=torch.long, device=self.keys.device)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.compressed:
            # a compressed layer attends by its own (bottom-right causal) rule and ignores the mask transformers
            # builds, so that mask stays query-sized: a fixed shape for compiled decoding
            return query_length, 0
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (negative count, as in transformers 5); once compressed, only
        tokens appended since the layer last kept a selection (:meth:`_crop_kept`)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if not self.compressed:
            keys, values = self._dense()
            self.keys, self.values = keys[..., :-n, :], values[..., :-n, :]
        else:
            self._crop_kept(n)
        self.seen -= n

    def _crop_kept(self, n: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class SequenceState:
    """What the press routing records about the sequence a cache holds, with the cache (so it
    follows it across forwards and ``copy.deepcopy``): the prefill's real tokens, and per layer the
    most recent queries, the tokens appended since the last compaction, the compactions run, and,
    for a scorer that reads hidden states, the score each token's entries got when it arrived
    (``[B, H_kv, T]`` over the ``T`` tokens fed so far, indexed by sequence position: 4 bytes per
    token and kv head, against ``4 * head_dim`` for its key and value)."""

    n_layers: int
    key_mask: torch.Tensor | None = None  # [B, L_prefill] real tokens of the prefill (left padding)
    prompt: int = 0  # tokens of the prefill (0: a cache built outside a prefill, e.g. by fan-out)
    compressed: tuple[int, ...] | None = None  # the layers the press compresses (None: all; the hybrid rule)
    queries: list[torch.Tensor | None] = field(default_factory=list)
    clocks: list[LayerClock] = field(default_factory=list)  # what each layer has been written (the schedule's)
    compactions: list[int] = field(default_factory=list)
    entry_scores: list[torch.Tensor | None] = field(default_factory=list)
    recorded: list[int] = field(default_factory=list)  # queries recorded since the last compaction

    def __post_init__(self) -> None:
        self.queries = [None] * self.n_layers
        self.clocks = [LayerClock(self.prompt, compressed=i in self.scope) for i in range(self.n_layers)]
        self.compactions = [0] * self.n_layers
        self.entry_scores = [None] * self.n_layers
        self.recorded = [0] * self.n_layers

    @property
    def scope(self) -> tuple[int, ...]:
        """The layers the press compresses, in order (every layer but a hybrid model's sliding-window ones)."""
        return tuple(range(self.n_layers)) if self.compressed is None else self.compressed

    @property
    def since(self) -> list[int]:
        """Generated tokens each layer was written since its last decode compaction (or the prompt's end)."""
        return [clock.since for clock in self.clocks]

    def advance(self, schedule: Schedule, tokens: int) -> list[Step]:
        """Count a forward writing ``tokens`` tokens to every layer: each layer's :class:`~kvpress_ada.runtime.Step`."""
        return [schedule.advance(clock, tokens) for clock in self.clocks]

    def crop(self, n: int) -> None:
        """Forget the last ``n`` tokens fed (``Cache.crop``): their hidden-state scores, their recorded
        queries and their count toward the next compaction. Refuses, in one line, to crop past a decode
        compaction (what it evicted cannot come back)."""
        for layer in range(self.n_layers):
            if self.compactions[layer] and n > self.since[layer]:
                raise ValueError(f"cannot crop {n} tokens: layer {layer} was compacted {self.since[layer]} tokens ago "
                                 "and decode compaction cannot be undone (assisted decoding is not supported with "
                                 "decode_budget); crop at most the tokens appended since the last compaction")
        for layer in range(self.n_layers):
            drop = min(n, self.since[layer], self.recorded[layer])
            held = self.queries[layer]
            if drop and held is not None:
                self.queries[layer] = held[:, :, :max(0, held.shape[2] - drop)]
            self.recorded[layer] -= drop
            clock = self.clocks[layer]
            clock.since = max(0, clock.since - n)
            clock.written = max(0, clock.written - n)
            scores = self.entry_scores[layer]
            if scores is not None:
                self.entry_scores[layer] = scores[:, :, :max(0, scores.shape[2] - n)]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (beam reordering, batch selection or repetition) of every per-row tensor."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, rows.to(t.device))
        self.key_mask = pick(self.key_mask)
        self.queries = [pick(q) for q in self.queries]
        self.entry_scores = [pick(s) for s in self.entry_scores]

    def nbytes(self) -> int:
        """Bytes of the hidden-state scores held (they grow by 4 bytes per token and kv head while a press
        compacts in decode); the recorded queries are bounded by the scorer's window and not counted."""
        return sum(t.numel() * t.element_size() for t in self.entry_scores if t is not None)

    def add_entry_scores(self, layer_idx: int, scores: torch.Tensor) -> None:
        """Append the scores ``[B, H_kv, T]`` of the ``T`` tokens a forward feeds layer ``layer_idx``."""
        held = self.entry_scores[layer_idx]
        self.entry_scores[layer_idx] = scores if held is None else torch.cat([held, scores], dim=2)

    def entry_scores_at(self, layer_idx: int, positions: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, W]`` the recorded scores of the entries at sequence ``positions [B, H_kv, W]``
        (0 where a slot holds nothing, ``position < 0``)."""
        held = self.entry_scores[layer_idx]
        if held is None or int(positions.max()) >= held.shape[2]:
            known = 0 if held is None else held.shape[2]
            raise RuntimeError(f"layer {layer_idx} holds entries whose hidden-state scores were not recorded "
                               f"({known} recorded): the cache was filled outside the press")
        picked = held.gather(2, positions.clamp(min=0).long())
        return picked.masked_fill(positions < 0, 0.0)


class PressCache(Cache):
    """A ``Cache`` of :class:`PressLayer` objects; see the module docstring.

    ``routed``: set by the press routing for the duration of one forward (a compressed layer is
    only updated under it); ``state``: the :class:`SequenceState` of the sequence held; ``rerotation``: set
    when the press's evictor re-rotates the keys it keeps (:class:`~kvpress_ada.evictors.rerotation.KeyRotation`,
    applied at every :meth:`retain`)."""

    def __init__(self, layers: list[Any]):
        super().__init__(layers=layers)
        self.routed = False
        self.rerotation: KeyRotation | None = None
        self.state = SequenceState(n_layers=len(layers), compressed=self.compressed_layers())

    def compressed_layers(self) -> tuple[int, ...]:
        """The layers a press compresses: every layer but the sliding-window layers it leaves to their window."""
        return tuple(i for i, layer in enumerate(self.layers) if not getattr(layer, "is_sliding", False))

    def layer(self, layer_idx: int) -> PressLayer:
        """Layer ``layer_idx``, checked."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} out of range: this cache has layers 0..{len(self.layers) - 1}")
        layer: PressLayer = self.layers[layer_idx]  # type: ignore[assignment]
        return layer

    def is_compressed(self, layer_idx: int) -> bool:
        return self.layer(layer_idx).compressed

    def view(self, layer_idx: int) -> HeldEntries:
        """What layer ``layer_idx`` holds (see :meth:`PressLayer.view`)."""
        return self.layer(layer_idx).view(self.state.key_mask)

    def retain(self, layer_idx: int, keep: torch.Tensor, held: HeldEntries | None = None,
               spare: int | None = None) -> None:
        """Keep the entries of layer ``layer_idx``'s view where ``keep`` is True (their keys re-rotated first
        under :attr:`rerotation`)."""
        layer = self.layer(layer_idx)
        held = layer.view(self.state.key_mask) if held is None else held
        if self.rerotation is not None:
            if layer.compressed and not getattr(layer, "rewrites_kept_keys", False):
                raise ValueError(f"{type(layer).__name__} moves a compressed layer's kept entries as they are stored "
                                 "and cannot re-rotate them: re-compress it with evictor rerotate=False, or keep "
                                 "full-precision storage in the default cache")
            held = self.rerotation.apply(layer_idx, held, keep)
        layer.retain(keep, held, spare)

    def head_lengths(self, layer_idx: int) -> torch.Tensor:
        """Entries each (batch, kv head) of layer ``layer_idx`` attends to, ``LongTensor[B, H_kv]``."""
        return self.layer(layer_idx).head_lengths()

    def stores(self, storage: Any) -> bool:
        """Whether this cache keeps entries as ``storage`` (a :class:`~kvpress_ada.storage.Storage`) says: full
        precision here; a quantized cache overrides it."""
        return storage.layout is None

    def nbytes(self) -> int:
        """Bytes held for keys and values of all layers, plus the hidden-state scores a scorer reading
        hidden states keeps with the sequence (:meth:`SequenceState.nbytes`)."""
        return sum(self.layer(i).nbytes() for i in range(len(self.layers))) + self.state.nbytes()

    @property
    def is_croppable(self) -> bool:
        """Read by transformers' assisted decoding right after its first forward: a prefill under a press
        that carried the candidate tokens too, which would be compressed as prompt; refused in one line."""
        mask = self.state.key_mask
        if mask is not None and self.get_seq_length() == mask.shape[1]:
            raise ValueError("assisted decoding (prompt_lookup_num_tokens, assistant_model) is not supported under "
                             "a kvpress_ada press: its first forward feeds the candidate tokens with the prompt, and "
                             "the press would compress them as prompt; generate without it")
        return True

    def crop(self, tokens_to_remove: int) -> None:
        """``Cache.crop`` (a negative count of tokens to drop), cropping the sequence state too."""
        if tokens_to_remove < 0:
            self.state.crop(-tokens_to_remove)
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder every layer's rows and the sequence state's (keep masks, query windows)."""
        super().reorder_cache(beam_idx)
        self.state.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.state.select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        mask = self.state.key_mask
        if mask is not None:
            self.state.select_rows(torch.arange(mask.shape[0], device=mask.device).repeat_interleave(repeats))

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, dense_fn: DenseAttention, module: torch.nn.Module,
               **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Attention of ``query`` over layer ``layer_idx`` (dense until the layer is compressed)."""
        return self.layer(layer_idx).attend(query, key, value, attention_mask, scaling, dense_fn, module, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.routed and self.is_compressed(layer_idx):
            raise RuntimeError(
                f"this {type(self).__name__} was compressed by a kvpress_ada press and needs its attention: call "
                "the model with it inside `with press(model):`, or once `kvpress_ada.attach(model)` has run")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def layer_count(config: Any, n: int | None) -> int:
    """Layers of a press cache: ``n`` when given, else the model config's decoder layer count."""
    if n is not None:
        return n
    if config is None:
        raise ValueError("a press cache needs a model config or num_layers")
    return int(config.get_text_config(decoder=True).num_hidden_layers)
