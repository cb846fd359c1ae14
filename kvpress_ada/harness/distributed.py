"""The process group, as launched by ``torchrun``: rank, world size and the few collectives we need.

Everything here runs on ``torch.distributed`` (gloo on CPU, NCCL on GPU); outside ``torchrun``
(no ``WORLD_SIZE`` in the environment, or 1) every helper is a no-op for one process, so code that
calls them runs unchanged in a single process.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist


def launched() -> bool:
    """True under ``torchrun`` with more than one process (``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


@dataclass(frozen=True)
class World:
    """This process's place among the ``size`` processes of a run (rank 0 writes the results)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> list[int]:
        """Indices of ``0..n-1`` this rank works on: round robin, so every rank gets a mix of the tasks
        (whatever the order of the samples) and shares differ by at most one."""
        return list(range(self.rank, n, self.size))

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. converts the default model into the shared cache), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0 (None elsewhere); picklable objects, gloo or NCCL."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def max(self, value: float) -> float:
        """The largest ``value`` over the ranks, on every rank."""
        if self.size == 1:
            return value
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return max(values)


def init(backend: str | None = None) -> World:
    """Join the process group ``torchrun`` set up (idempotent); one process without ``torchrun``.

    ``backend``: gloo on CPU, NCCL when CUDA is available, unless given."""
    if not launched():
        return World()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return World(dist.get_rank(), dist.get_world_size())


def finish() -> None:
    """Leave the process group (after the last collective) so the process exits cleanly."""
    if is_initialized():
        dist.destroy_process_group()
