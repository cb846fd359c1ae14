"""What a scorer may read about one layer at the end of prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Observation:
    """Post-RoPE keys/values of one layer plus the queries a scorer asked for.

    ``keys``/``values``: ``[B, H_kv, L, D]`` (never repeated for GQA).
    ``queries``: the last ``w`` queries ``[B, H_q, w, D]`` (``w`` = the scorer's ``query_window``).
    ``key_mask``: ``[B, L]`` bool, False on left padding.
    ``output_weight``: the layer's ``o_proj.weight`` ``[hidden, H_q * D]`` (only for scorers that declare it).
    ``rope_inv_freq``: RoPE inverse frequencies ``[D // 2]`` (only for scorers that declare it).
    ``pass_scores``: ``[B, H_kv, L]`` what the scorer's own model pass measured for each entry
    (only for scorers that declare ``needs_model_pass``, e.g. KVzip's context reconstruction).
    ``head_offset``: index among this process's kv heads of the observation's first kv head
    (non-zero when chunked prefill scores the kv heads of a layer one at a time). ``shard``: under
    tensor parallelism, this rank's block of kv heads
    (:class:`~kvpress_ada.integration.tensor_parallel.HeadShard`): ``keys`` etc. hold those heads
    only; ``None`` in one process. :attr:`global_head_offset` is the first head's index in the
    whole layer (what scorers that depend on a head's index use).
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    key_mask: torch.Tensor
    layer_idx: int
    n_layers: int
    scaling: float
    output_weight: torch.Tensor | None = None
    rope_inv_freq: torch.Tensor | None = None
    pass_scores: torch.Tensor | None = None
    head_offset: int = 0
    shard: Any = None

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
