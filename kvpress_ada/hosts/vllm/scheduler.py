"""Blocks freed by eviction, seen by vLLM's admission (engine-core side of the vLLM host).

vLLM counts a request's KV memory in blocks (``cdiv(tokens, block_size)``, each block holding one page per
(layer, kv head)). Once the press has evicted from a request, the worker reports ``pages``: what it holds in
pages of one layer (its pages over all layers spread evenly when one pool serves every layer, else its fullest
layer's: :meth:`~kvpress_ada.hosts.serving.PagedServing.pages_per_layer`). Such a request then needs only
``ceil(pages / H_kv) + cdiv(new_tokens, block_size)`` real blocks for a step that brings ``new_tokens`` (a head
takes at most ``cdiv(new_tokens, S)`` new pages; never more than vLLM's own count), and :class:`PressBlockManager`
keeps exactly that many real blocks among its table entries (the others are vLLM's
null block, as for a sliding window), returning the rest to the block pool, so more requests are admitted.
Since a request's pages never exceed ``H_kv`` times its real blocks per layer, the pools carved out of vLLM's
KV tensors (:mod:`.backend`) never run out. Requests not evicted from are counted exactly as vLLM counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

#: the attribute of a ModelRunnerOutput that carries the worker's report: request id -> its pages in one layer
REPORT = "kvpress_pages"


@dataclass(frozen=True, kw_only=True)
class PressAttentionSpec(FullAttentionSpec):
    """Full attention whose requests may hold fewer pages than tokens (the layers of a press's worker)."""


class PressBlockManager(FullAttentionManager):
    """:class:`FullAttentionManager` that counts an evicted-from request by its pages (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pages: dict[str, int] = {}  # request id -> its pages in one layer (requests evicted from)
        self.heads = int(self.kv_cache_spec.num_kv_heads)
        self._target: dict[str, int] = {}

    def _real(self, request_id: str) -> int:
        return sum(b is not self._null_block for b in self.req_to_blocks.get(request_id, ()))

    def needed(self, request_id: str, new_tokens: int) -> int:
        """Real blocks an evicted-from request needs for a step bringing ``new_tokens``."""
        return cdiv(self.pages[request_id], self.heads) + cdiv(new_tokens, self.block_size)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Any,
                                   total_computed_tokens: int, *args: Any, **kwargs: Any) -> int:
        if request_id not in self.pages:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                      total_computed_tokens, *args, **kwargs)
        # never above the table's natural length: a head holds at most one entry per token
        self._target[request_id] = min(self.needed(request_id, max(num_tokens - total_computed_tokens, 0)),
                                       cdiv(num_tokens, self.block_size))
        return max(self._target[request_id] - self._real(request_id), 0)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[Any]:
        if request_id not in self.pages:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        blocks = self.req_to_blocks[request_id]
        deficit = self._target.pop(request_id, 0) - self._real(request_id)
        grown = max(cdiv(num_tokens, self.block_size) - len(blocks), 0)  # the table's natural growth
        real = self.block_pool.get_new_blocks(max(deficit, 0)) if deficit > 0 else []
        tail = real[:grown] + [self._null_block] * max(grown - len(real), 0)
        blocks.extend(tail)
        for block in real[grown:]:  # more than the table grows by: into null entries
            blocks[blocks.index(self._null_block)] = block
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in real)
        return tail

    def shrink(self, request_id: str, pages: int) -> None:
        """The worker's report: the request holds at most ``pages`` pages in a layer; keep the real blocks its next
        token needs, return the others to the pool (first entries first)."""
        if request_id not in self.req_to_blocks:
            return
        self.pages[request_id] = pages
        extra = self._real(request_id) - self.needed(request_id, 1)
        blocks = self.req_to_blocks[request_id]
        freed = []
        for i, block in enumerate(blocks):
            if extra <= 0:
                break
            if block is not self._null_block:
                freed.append(block)
                blocks[i] = self._null_block
                extra -= 1
        if freed:
            self.block_pool.free_blocks(freed)

    def free(self, request_id: str) -> None:
        self.pages.pop(request_id, None)
        self._target.pop(request_id, None)
        super().free(request_id)


def register_spec() -> None:
    """Make :class:`PressAttentionSpec` known to vLLM's registry (the built-in specs first: the registry registers
    them only while it is empty). Inert until a worker reports the spec."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(PressAttentionSpec, PressBlockManager, uniform_type_base_spec=FullAttentionSpec)


class PressScheduler(Scheduler):
    """vLLM's scheduler; the worker's page report shrinks evicted-from requests to the blocks they need."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        report = getattr(model_runner_output, REPORT, None) or {}
        if report:
            for manager in self.kv_cache_manager.coordinator.single_type_managers:
                if isinstance(manager, PressBlockManager):
                    for request_id, pages in report.items():
                        manager.shrink(request_id, pages)
        return super().update_from_output(scheduler_output, model_runner_output)
