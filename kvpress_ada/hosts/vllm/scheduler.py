"""Blocks freed by eviction, seen by vLLM's admission (engine-core side of the vLLM host).

vLLM counts a request's KV memory in blocks (``cdiv(tokens, block_size)``, each block holding one page per
(layer, kv head)). Once the press has evicted from a request, the worker reports ``pages``: what it holds in
pages of one layer (its pages over all layers spread evenly when one pool serves every layer, else its fullest
layer's: :meth:`~kvpress_ada.serving.requests.PagedServing.pages_per_layer`). Such a request then needs only
``ceil(pages / H_kv) + cdiv(new_tokens, block_size)`` real blocks for a step that brings ``new_tokens`` (a head
takes at most ``cdiv(new_tokens, S)`` new pages; never more than vLLM's own count), and :class:`PressBlockManager`
keeps exactly that many real blocks among its table entries (the others are vLLM's
null block, as for a sliding window), returning the rest to the block pool, so more requests are admitted.
Since a request's pages never exceed ``H_kv`` times its real blocks per layer, the pools carved out of vLLM's
KV tensors (:mod:`.backend`) never run out. Requests not evicted from are counted exactly as vLLM counts them,
except under a quantized storage: its first eviction stores each (layer, kv head) row's side tensors in the row's
pages, which may take up to ``reserve`` pages per row more than the full-precision pages it frees, so such a request
holds ``reserve`` spare blocks (outside its table) until the worker's first report; real blocks beyond its table's
length (side tensors of a short request) stay spare as well.

Under decode compression an evicted-from request grows by at most ``decode_interval`` entries per head before its
next compaction: ``cdiv(upcoming - 1, block_size)`` more blocks, ``upcoming`` the tokens it still writes before then
(at most what it may still generate). Admission keeps those blocks free (:meth:`PressBlockManager.growth`): a
request is admitted only if its prompt fits beside the growth of those already running, so running requests are
not preempted to make room for it (vLLM itself reserves nothing for decode growth; nor does this manager when the
press does not compress while generating: growth is then unbounded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ...runtime import Schedule
from ...serving.pools import pool_reserve
from . import press_of

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
        self.reserve = 0  # spare blocks a request holds until its first eviction (a quantized storage's side tensors)
        self._spare: dict[str, list[Any]] = {}
        self._growth: dict[str, int] = {}  # request id -> blocks it may still take before its next compaction

    def _real(self, request_id: str) -> int:
        return sum(b is not self._null_block for b in self.req_to_blocks.get(request_id, ()))

    def _held(self, request_id: str) -> int:
        """Real blocks of the request: in its table and spare."""
        return self._real(request_id) + len(self._spare.get(request_id, ()))

    def needed(self, request_id: str, new_tokens: int) -> int:
        """Real blocks an evicted-from request needs for a step bringing ``new_tokens``."""
        return cdiv(self.pages[request_id], self.heads) + cdiv(new_tokens, self.block_size)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Any,
                                   total_computed_tokens: int, *args: Any, **kwargs: Any) -> int:
        if request_id not in self.pages:
            # the spare blocks are taken with the prompt's (not in vLLM's full-sequence admission check, which
            # keeps the running requests' decode growth free instead)
            admission = bool(kwargs.get("apply_admission_cap"))
            spare = self.reserve if request_id not in self._spare and not admission else 0
            own = super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                     total_computed_tokens, *args, **kwargs)
            return spare + (self.growth() if admission else 0) + own
        # never above the table's natural length (a head holds at most one entry per token) and the reserve
        self._target[request_id] = min(self.needed(request_id, max(num_tokens - total_computed_tokens, 0)),
                                       cdiv(num_tokens, self.block_size) + self.reserve)
        return max(self._target[request_id] - self._held(request_id), 0)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[Any]:
        if request_id not in self.pages:
            if self.reserve and request_id not in self._spare:
                self._spare[request_id] = self.block_pool.get_new_blocks(self.reserve)
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        blocks = self.req_to_blocks[request_id]
        deficit = self._target.pop(request_id, 0) - self._held(request_id)
        grown = max(cdiv(num_tokens, self.block_size) - len(blocks), 0)  # the table's natural growth
        real = self.block_pool.get_new_blocks(max(deficit, 0)) if deficit > 0 else []
        tail = real[:grown] + [self._null_block] * max(grown - len(real), 0)
        blocks.extend(tail)
        for block in real[grown:]:  # more than the table grows by: into null entries, else spare
            if self._null_block in blocks:
                blocks[blocks.index(self._null_block)] = block
            else:
                self._spare.setdefault(request_id, []).append(block)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in real)
        return tail

    def growth(self) -> int:
        """Blocks the evicted-from requests may still take before their next decode compaction (module docstring)."""
        return sum(self._growth.values())

    def shrink(self, request_id: str, pages: int, upcoming: int | None = None) -> None:
        """The worker's report: the request holds at most ``pages`` pages in a layer; keep the real blocks its next
        token needs, return the others to the pool (first entries first). ``upcoming``: under decode compression,
        the tokens it writes at most before its next compaction (their blocks are kept free at admission)."""
        if request_id not in self.req_to_blocks:
            return
        self.pages[request_id] = pages
        extra = self._held(request_id) - self.needed(request_id, 1)
        blocks = self.req_to_blocks[request_id]
        spare = self._spare.get(request_id, [])
        freed = [spare.pop() for _ in range(min(max(extra, 0), len(spare)))]  # spare blocks go first
        extra -= len(freed)
        for i, block in enumerate(blocks):
            if extra <= 0:
                break
            if block is not self._null_block:
                freed.append(block)
                blocks[i] = self._null_block
                extra -= 1
        if freed:
            self.block_pool.free_blocks(freed)
        if upcoming is not None:
            # its last step before the compaction needs what it holds after upcoming - 1 more tokens, plus one
            peak = cdiv(pages, self.heads) + cdiv(max(upcoming - 1, 0), self.block_size) + 1
            self._growth[request_id] = max(peak - max(self._held(request_id), self.needed(request_id, 1)), 0)

    def _free_spare(self, request_id: str) -> None:
        spare = self._spare.pop(request_id, None)
        if spare:
            self.block_pool.free_blocks(spare)

    def free(self, request_id: str) -> None:
        self.pages.pop(request_id, None)
        self._target.pop(request_id, None)
        self._growth.pop(request_id, None)
        self._free_spare(request_id)
        super().free(request_id)


def register_spec() -> None:
    """Make :class:`PressAttentionSpec` known to vLLM's registry (the built-in specs first: the registry registers
    them only while it is empty). Inert until a worker reports the spec."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(PressAttentionSpec, PressBlockManager, uniform_type_base_spec=FullAttentionSpec)


class PressScheduler(Scheduler):
    """vLLM's scheduler; the worker's page report shrinks evicted-from requests to the blocks they need. Under a
    press with ``prefill_chunk`` whose layer schedule compares layers (``AdaLayer``: every layer evicts at the end
    of a step), a step of a prompt ends at the end of the press's chunk it is in at the latest
    (:meth:`Schedule.chunk_end <kvpress_ada.runtime.Schedule.chunk_end>`), so every chunk's eviction falls at the
    end of a step, as on the transformers host (other presses split such a step instead: the serving layer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        press = press_of(self.vllm_config.additional_config)
        self.interval = None if press is None else press.decode_interval
        self.chunks: Schedule | None = None  # the schedule whose chunk ends cap a prompt's steps
        if press is None:
            return
        if press.prefill_chunk is not None and Schedule(press).prompt_waits:
            self.chunks = Schedule(press)
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            if isinstance(manager, PressBlockManager):
                spec = manager.kv_cache_spec
                manager.reserve = pool_reserve(press.storage, spec.block_size, spec.head_size, spec.dtype)

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's last cap on the tokens a request brings in a step (the running and the waiting requests' alike);
        then, under :attr:`chunks`, at most up to the end of the press's chunk of its prompt it is in."""
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        prompt = int(request.num_prompt_tokens)
        if self.chunks is None or num_computed_tokens >= prompt:
            return n
        return min(n, self.chunks.chunk_end(num_computed_tokens, prompt) - num_computed_tokens)

    def _upcoming(self, request_id: str) -> int | None:
        """Under decode compression, the tokens request ``request_id`` writes at most before its next compaction
        (one every ``decode_interval`` tokens written after the prompt; never more than it may still generate)."""
        request = self.requests.get(request_id)
        if self.interval is None or request is None:
            return None
        written = max(request.num_computed_tokens - request.num_prompt_tokens, 0)
        left = max(request.max_tokens - request.num_output_tokens, 0)
        return min(self.interval - written % self.interval, left)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        report = getattr(model_runner_output, REPORT, None) or {}
        if report:
            for manager in self.kv_cache_manager.coordinator.single_type_managers:
                if isinstance(manager, PressBlockManager):
                    for request_id, pages in report.items():
                        manager.shrink(request_id, pages, self._upcoming(request_id))
        return super().update_from_output(scheduler_output, model_runner_output)
