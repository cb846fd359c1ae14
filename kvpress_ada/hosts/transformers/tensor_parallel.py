"""Tensor parallelism: a press on a model loaded with ``from_pretrained(path, tp_plan="auto")`` under
``torchrun``.

Rank ``r`` of ``W`` holds a contiguous block of ``H_kv / W`` kv heads with their query groups
(:func:`head_shard` refuses world sizes that do not divide the kv heads, or plans that do not shard the
query, key and value projections, as the model's family names them, column-wise), scores them and keeps
only their ragged rows. Decisions that span heads (Ada's head allocation, a model-scope schedule) run on
every head's scores, all-gathered per layer (:meth:`HeadShard.gather`, ``[B, H_kv, L]`` scores, never the
cache), so each rank takes its heads' part of the single-process decision. Design notes:
``docs/design.md`` (Scaling out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...families import family_of


@dataclass(frozen=True)
class HeadShard:
    """This rank's contiguous block of ``n_local`` kv heads out of ``n_local * size`` (tensor parallelism)."""

    rank: int
    size: int
    n_local: int
    group: Any = None  # the tensor-parallel process group (None: the default group)

    @property
    def offset(self) -> int:
        """Global index of this rank's first kv head."""
        return self.rank * self.n_local

    @property
    def n_heads(self) -> int:
        return self.n_local * self.size

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[B, n_local, ...]`` of every rank -> ``[B, n_heads, ...]`` in global head order (an all-gather)."""
        import torch.distributed as dist

        local = local.contiguous()
        if local.shape[1] != self.n_local:
            raise ValueError(f"expected {self.n_local} local kv heads on dim 1, got shape {tuple(local.shape)}")
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=1)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a ``[B, n_heads, ...]`` tensor."""
        return full.narrow(1, self.offset, self.n_local)


def _tp_mesh(model: Any) -> Any:
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    if mesh is None:
        return None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["tp"] if "tp" in names and len(names) > 1 else mesh


def head_shard(model: Any) -> HeadShard | None:
    """The kv-head block of this rank when ``model`` is tensor-parallel (``tp_size > 1``) with its attention
    heads split across ranks, else ``None`` (one process, or a plan that leaves attention whole: GPT-OSS's).

    Raises a clear error for what is not supported: a kv-head count the world size does not divide
    (the GQA group of a kv head would be split across ranks), or sharding along more than tensor
    parallelism of the attention heads."""
    size = getattr(model, "tp_size", None) or getattr(model, "_tp_size", None) or 1
    if size <= 1:
        return None
    config = model.config
    plan = getattr(model, "_tp_plan", None) or getattr(config, "base_model_tp_plan", None) or {}
    styles = family_of(model).head_projection_styles(plan)
    if set(styles.values()) == {"replicated"}:
        return None  # the plan leaves attention whole: every rank holds every kv head, as one process does
    n_kv = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    n_q = int(config.num_attention_heads)
    if n_kv % size or n_q % size:
        raise ValueError(f"tensor parallelism over {size} ranks needs the number of kv heads ({n_kv}) and of query "
                         f"heads ({n_q}) divisible by {size}, so that each rank holds whole kv heads with their query "
                         "groups; kvpress_ada presses refuse other world sizes")
    for proj, style in sorted(styles.items(), key=lambda item: item[1] == "replicated"):  # a named style first
        if style != "colwise":
            raise ValueError(f"kvpress_ada presses need {proj} sharded column-wise (contiguous blocks of heads) under "
                             f"tensor parallelism; this model's plan shards it as {style!r}")
    mesh = _tp_mesh(model)
    if mesh is not None:
        rank, group = mesh.get_local_rank(), mesh.get_group()
    else:
        import torch.distributed as dist

        rank, group = dist.get_rank(), None
    return HeadShard(rank=int(rank), size=int(size), n_local=n_kv // size, group=group)


def local_weight(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter that may be a ``DTensor`` (the output projection row-wise: the columns of
    its heads)."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if callable(to_local) else weight
