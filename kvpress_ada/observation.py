"""What a scorer may read about one layer at the end of prefill."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class _LayerFields:
    """What :class:`Observation` and :class:`LayerView` both carry about one layer (described in
    :class:`Observation`); keyword-only, so each adds its own fields after these."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    layer_idx: int
    n_layers: int
    scaling: float
    output_weight: torch.Tensor | None = None
    rope_inv_freq: torch.Tensor | None = None
    pass_scores: torch.Tensor | None = None
    shard: Any = None
    entry_scores: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class Observation(_LayerFields):
    """Post-RoPE keys/values of one layer plus the queries a scorer asked for.

    ``keys``/``values``: ``[B, H_kv, L, D]`` (never repeated for GQA).
    ``queries``: the last ``w`` queries ``[B, H_q, w, D]`` (``w`` = the scorer's ``query_window``).
    ``key_mask``: ``[B, L]`` bool, False on left padding.
    ``output_weight``: the layer's output projection weight ``[hidden, H_q * D]`` (only for scorers that declare
    it).
    ``rope_inv_freq``: RoPE inverse frequencies ``[D // 2]`` (only for scorers that declare it).
    ``pass_scores``: ``[B, H_kv, L]`` what the scorer's own model pass measured for each entry
    (only for scorers that declare ``needs_model_pass``, e.g. KVzip's context reconstruction).
    ``entry_scores``: ``[B, H_kv, L]`` what the scorer's ``entry_scores`` gave each entry from the
    hidden state that entered the attention with its token (only for scorers that declare
    ``reads_hidden_states``, e.g. KVzap's surrogate).
    ``positions``: ``[B, H_kv, L]`` long, each entry's index in the sequence fed to the cache (what a scorer
    reading RoPE geometry needs when the entries are not contiguous: chunked prefill, decode compression);
    ``None`` when the entries are the sequence itself (index ``j`` of a row is its ``j``-th slot).
    ``head_offset``: index among this process's kv heads of the observation's first kv head
    (non-zero when chunked prefill scores the kv heads of a layer one at a time). ``shard``: under
    tensor parallelism, this rank's block of kv heads
    (:class:`~kvpress_ada.hosts.transformers.tensor_parallel.HeadShard`): ``keys`` etc. hold those heads
    only; ``None`` in one process. :attr:`global_head_offset` is the first head's index in the
    whole layer (what scorers that depend on a head's index use).
    """

    key_mask: torch.Tensor
    head_offset: int = 0
    positions: torch.Tensor | None = None

    @property
    def global_head_offset(self) -> int:
        """Index in the whole layer (over all ranks) of the first kv head in ``keys``."""
        return self.head_offset + (0 if self.shard is None else int(self.shard.offset))

    @property
    def n_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def group_size(self) -> int:
        return self.queries.shape[1] // self.keys.shape[1]

    @property
    def seq_len(self) -> int:
        return self.keys.shape[2]

    def valid_lengths(self) -> torch.Tensor:
        """Number of non-padding tokens per batch row, ``[B]`` long."""
        return self.key_mask.sum(-1)


@dataclass(frozen=True, kw_only=True)
class LayerView(_LayerFields):
    """One attention layer as the selection policy (:meth:`~kvpress_ada.Pipeline.keep`) sees it.

    ``keys``/``values``: ``[B, H_kv, L, D]`` what each (batch row, kv head) holds, left-padded per
    row and head, in position order; ``valid``: ``[B, H_kv, L]`` bool, False on padding;
    ``positions``: ``[B, H_kv, L]`` each entry's index in the sequence fed to the cache (None when
    the view's layout is the sequence itself). ``queries``: ``[B, H_q, w, D]`` the queries a scorer
    reads (the last ``w`` of the forward, the scorer's ``query_window``). ``scope``: the layers a layer
    schedule splits the budget across, in order (the layers the press compresses: a hybrid model's global
    layers; ``None``: all ``n_layers``). The remaining fields are those of :class:`Observation`.
    """

    valid: torch.Tensor
    positions: torch.Tensor | None = None
    uniform: bool | None = None  # every kv head of a row holds the same entries (None: not known, checked)
    scope: tuple[int, ...] | None = None

    @property
    def rank(self) -> tuple[int, int]:
        """``(index, count)`` of this layer among the layers of its :attr:`scope`."""
        if self.scope is None:
            return self.layer_idx, self.n_layers
        if self.layer_idx not in self.scope:
            raise ValueError(f"layer {self.layer_idx} is not among the layers a press compresses {self.scope}")
        return self.scope.index(self.layer_idx), len(self.scope)

    @classmethod
    def of(cls, obs: Observation) -> "LayerView":
        """The view of an observation whose rows hold the same entries in every kv head."""
        B, H, L = obs.keys.shape[:3]
        return cls(keys=obs.keys, values=obs.values, valid=obs.key_mask[:, None, :].expand(B, H, L),
                   queries=obs.queries, layer_idx=obs.layer_idx, n_layers=obs.n_layers, scaling=obs.scaling,
                   output_weight=obs.output_weight, rope_inv_freq=obs.rope_inv_freq, pass_scores=obs.pass_scores,
                   shard=obs.shard, uniform=True, entry_scores=obs.entry_scores, positions=obs.positions)

    def rows(self, index: torch.Tensor) -> "LayerView":
        """The view of the batch rows ``index``."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return replace(self, keys=self.keys[index], values=self.values[index], valid=self.valid[index],
                       queries=self.queries[index], pass_scores=pick(self.pass_scores), positions=pick(self.positions),
                       entry_scores=pick(self.entry_scores))

    def observations(self) -> list[Observation]:
        """What the scorer reads: one :class:`Observation` of the whole layer when every kv head of a
        row holds the same entries, else one per kv head (``H_kv = 1``, its query group, its columns
        of ``output_weight``, ``head_offset`` = its index). One host sync unless ``uniform`` is known."""
        H = self.keys.shape[1]
        common = dict(layer_idx=self.layer_idx, n_layers=self.n_layers, scaling=self.scaling,
                      rope_inv_freq=self.rope_inv_freq, shard=self.shard)
        uniform = self.uniform if self.uniform is not None else bool((self.valid == self.valid[:, :1]).all())
        if uniform:
            return [Observation(keys=self.keys, values=self.values, queries=self.queries, key_mask=self.valid[:, 0],
                                output_weight=self.output_weight, pass_scores=self.pass_scores,
                                entry_scores=self.entry_scores, positions=self.positions, **common)]
        G = self.queries.shape[1] // H
        D = self.queries.shape[-1]
        heads = []

        def head(t: torch.Tensor | None, h: int) -> torch.Tensor | None:
            return None if t is None else t[:, h:h + 1]

        for h in range(H):
            weight = None if self.output_weight is None else self.output_weight[:, h * G * D:(h + 1) * G * D]
            heads.append(Observation(
                keys=self.keys[:, h:h + 1], values=self.values[:, h:h + 1], queries=self.queries[:, h * G:(h + 1) * G],
                key_mask=self.valid[:, h], output_weight=weight, head_offset=h,
                pass_scores=head(self.pass_scores, h), entry_scores=head(self.entry_scores, h),
                positions=head(self.positions, h), **common))
        return heads


@dataclass(frozen=True)
class Budget:
    """How many entries a layer keeps: ``average`` ``[B]`` tokens per kv head averaged over the
    layers (what the layer schedule spreads), ``lengths`` ``[B]`` the context length each layer's
    budget is clipped to, ``cap`` ``[B]`` an optional per-head ceiling applied after the schedule
    (the tokens seen so far in a chunked prefill)."""

    average: torch.Tensor
    lengths: torch.Tensor
    cap: torch.Tensor | None = None
