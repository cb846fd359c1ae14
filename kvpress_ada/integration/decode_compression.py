"""Decode-phase compression: ``Pipeline(..., decode_budget=B, decode_interval=K)``.

While generating inside ``with press(model)``, every layer counts the tokens appended to it since
its last compaction. In the forward where that count reaches ``K`` (right after the layer's
attention, as prefill compression does), the layer is re-scored, re-split across heads and
compacted in place:

1. **View.** The layer's entries are read as a left-padded dense view ``[B, H_kv, L_max, D]``
   with a per-(batch, kv head) validity mask (:meth:`decode_view` of the cache layer: the ragged
   rows of a :class:`RaggedLayer`, the visible entries of a :class:`MaskedLayer`, the dense
   prefill of a layer not compressed yet), entries in position order.
2. **Score.** Rows are ragged, and a scorer's ``key_mask`` is per batch row, so each kv head is
   scored as its own :class:`Observation` (``H_kv = 1``: its keys and values, the queries of its
   GQA group, the matching columns of ``o_proj``); the queries are the scorer's
   ``query_window()`` most recent *generated* queries of that layer (a rolling window captured
   in the attention hook; fewer right after the prefill, and never more than the row holds).
   As at prefill, window attention treats the last ``w`` entries of a row as the window's own
   keys; that is exact while those tokens are held (always when ``w <= K``, and for SnapKV-like
   scorers that protect their window when ``w <= B``). Keys already carry RoPE, so kept keys
   keep their true positions, and tokens appended later continue from ``get_seq_length()``.
3. **Allocate.** The layer schedule gives this layer's per-head budget ``b_l`` for an average of
   ``B`` (``UniformLayer``: ``b_l = B``), the head allocator (uniform or Ada) splits ``H_kv * b_l``
   across heads; counts are then fitted to what each head holds (a head never keeps more than
   it has; the excess goes to heads with room), so each batch row keeps exactly
   ``min(H_kv * b_l, entries it held)`` entries.
4. **Compact.** The evictor's keep mask goes back to the layer (:meth:`decode_compact`): the
   ragged layer re-lays its rows out through the same ``compress`` path as prefill, with a spare
   of exactly ``K`` slots per row, so the next ``K`` single-token steps append without ever
   growing the layout; the masked reference just updates its keep mask.

**Bound** (what ``tests/test_decode_compression.py`` asserts). Single-token decode steps, per
layer ``l`` and batch row: right after a compaction the layer holds exactly
``min(H_kv * b_l, held)`` entries; after any forward from the first compaction on it holds at
most ``H_kv * (b_l + K - 1)`` (``H_kv * (b_l + K)`` inside the compacting step, before its
compaction). A :class:`RaggedCache` layer compacted in the decode phase lays each row out with
room for its kept entries plus ``K``, rounded up to whole :data:`~kvpress_ada.kernels.reference.CHUNK`
(32-slot) chunks, so from the first compaction of every layer on,
``cache.nbytes() <= n_layers * B * H_kv * (decode_budget + K + CHUNK - 1) * D * 2 * itemsize``
for schedules whose ``b_l`` average ``decode_budget`` (and at least the bound without the
``CHUNK - 1`` when every layer held enough entries). Before its first compaction a layer holds
what the prefill left (the whole prompt in a decode-only pipeline) plus the generated tokens.
Forwards of several tokens (a question appended
after the context) count all their tokens; they may grow the ragged layout past the bound for
that one step.

**Scorers.** Every scorer reading a window of queries (SnapKV, TOVA, CriticalKV,
ExpectedAttention with a ``window``) or none (StreamingLLM, KNorm, KeyDiff, LagKV, Random) re-scores
in decode; ``RandomScorer`` sees each head as head 0, so its draws are identical across the heads
of a layer. Refused at ``Pipeline`` construction, with one line: scorers that read every query
since the start (``query_window() is None``: H2O, ``ExpectedAttention(window=None)``), scorers
with a model pass of their own (KVzip), and model-scope layer schedules (``AdaLayer``, which needs
every layer's scores at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..allocators.heads import fit_to_valid

if TYPE_CHECKING:
    from ..pipeline import Pipeline


def check_decode_support(press: Pipeline) -> None:
    """Raise a one-line ``ValueError`` when ``press`` cannot re-score the cache while generating."""
    name = type(press.scorer).__name__
    if type(press.scorer).needs_model_pass:
        raise ValueError(f"{name} scores from a model pass over the prefill and cannot re-score the cache while "
                         "generating: drop decode_budget/decode_interval or use a windowed scorer (e.g. snapkv)")
    if press.scorer.query_window() is None:
        raise ValueError(f"{name} reads every query since the start (query_window None) but decode compression "
                         "keeps only a window of recent queries: use a scorer with a finite window")
    if type(press.layers).needs_all_layers:
        raise ValueError(f"the layer schedule {type(press.layers).__name__} needs every layer's scores at once; "
                         "decode compression compacts layer by layer: use a uniform or pyramid layer schedule")


@dataclass
class DecodeState:
    """Per-cache decode state: each layer's rolling window of generated queries and the tokens
    appended since its last compaction. Lives on the cache (``cache.decode_state``), so it follows
    the cache across forwards and copies (``copy.deepcopy``)."""

    n_layers: int
    key_mask: torch.Tensor | None = None  # [B, L_prefill] real tokens of the prefill (left padding)
    queries: list[torch.Tensor | None] = field(default_factory=list)
    since: list[int] = field(default_factory=list)
    compactions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.queries = [None] * self.n_layers
        self.since = [0] * self.n_layers
        self.compactions = [0] * self.n_layers


def start_decode(cache: Any, key_mask: torch.Tensor) -> DecodeState:
    """Fresh decode state for a cache whose prefill has ``key_mask [B, L]`` real tokens."""
    state = DecodeState(n_layers=len(cache.layers), key_mask=key_mask)
    cache.decode_state = state
    return state


def after_decode_attention(press: Pipeline, cache: Any, model: Any, layer_idx: int, query: torch.Tensor,
                           scaling: float, output_weight: torch.Tensor) -> None:
    """Called after a decode forward's attention of one layer: record its queries and compact the
    layer when ``decode_interval`` tokens were appended since its last compaction."""
    assert press.decode_interval is not None
    state: DecodeState | None = getattr(cache, "decode_state", None)
    if state is None:  # a cache prefilled outside this press: start counting now
        state = DecodeState(n_layers=len(cache.layers))
        cache.decode_state = state
    window = press.scorer.query_window()
    assert window is not None  # refused at Pipeline construction
    held = state.queries[layer_idx]
    recent = query.detach() if held is None else torch.cat([held, query.detach()], dim=2)
    state.queries[layer_idx] = recent[:, :, recent.shape[2] - min(window, recent.shape[2]):]
    state.since[layer_idx] += query.shape[2]
    if state.since[layer_idx] < press.decode_interval:
        return
    layer = cache.layers[layer_idx]
    with torch.no_grad():
        keys, values, valid = layer.decode_view(state.key_mask)
        keep = decode_keep(press, model, layer_idx, len(cache.layers), keys, values, valid,
                           state.queries[layer_idx], scaling, output_weight, layer.get_seq_length())
        layer.decode_compact(keep, spare=press.decode_interval, key_mask=state.key_mask)
    state.since[layer_idx] = 0
    state.compactions[layer_idx] += 1


def decode_keep(press: Pipeline, model: Any, layer_idx: int, n_layers: int, keys: torch.Tensor,
                values: torch.Tensor, valid: torch.Tensor, queries: torch.Tensor | None, scaling: float,
                output_weight: torch.Tensor, seen: int) -> torch.Tensor:
    """Keep mask ``[B, H_kv, L_max]`` over a layer's left-padded view (see the module docstring)."""
    from .press_context import observation_for

    assert press.decode_budget is not None
    B, H, L, D = keys.shape
    if queries is None:
        queries = keys.new_zeros(B, H, 0, D)
    queries = queries[:, :, queries.shape[2] - min(queries.shape[2], L):]  # never more queries than entries
    G = queries.shape[1] // H
    scores = torch.empty(B, H, L, dtype=torch.float32, device=keys.device)
    for h in range(H):
        heads = slice(h * G, (h + 1) * G)
        obs = observation_for(press.scorer, model, layer_idx, n_layers, queries[:, heads], keys[:, h:h + 1],
                              values[:, h:h + 1], valid[:, h], scaling, output_weight[:, h * G * D:(h + 1) * G * D])
        scores[:, h] = press.scores(obs)[:, 0]
    lengths = torch.full((B,), seen, dtype=torch.long, device=keys.device)
    avg = torch.full((B,), press.decode_budget, dtype=torch.long, device=keys.device)
    budget = press.layers.layer_budget(avg, layer_idx, n_layers, lengths, press.scorer.protected(lengths))
    counts = press._allocate(scores, budget, layer_idx)
    counts = fit_to_valid(scores, counts, valid)
    return press.evictor.select(scores, counts) & valid
