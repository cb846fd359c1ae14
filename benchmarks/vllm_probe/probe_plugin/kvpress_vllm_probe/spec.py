"""A custom KV cache spec and manager through vLLM's KVCacheSpecRegistry (kv_cache_spec_registry.py).

``HeadPagedSpec`` is a FullAttentionSpec subclass (same memory, same grouping: ``uniform_type_base_spec``);
``PagedManager`` is a FullAttentionManager that logs what the scheduler asks of it and delegates. The worker
(``SpecWorker``, configured by ``worker_cls``) reports ``HeadPagedSpec`` for every full-attention layer, the
engine core builds its KV cache manager from it and picks ``PagedManager`` through the registry.
"""

import json
import os
from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm.v1.worker.cpu_worker import CPUWorker


@dataclass(frozen=True, kw_only=True)
class HeadPagedSpec(FullAttentionSpec):
    pass


class PagedManager(FullAttentionManager):
    def _log(self, **record) -> None:
        path = os.environ.get("KVPRESS_PROBE_MANAGER_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "manager": type(self).__name__, **record}) + "\n")

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs) -> int:
        n = super().get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs)
        self._log(call="get_num_blocks_to_allocate", req=request_id, num_tokens=num_tokens, blocks=n,
                  free=self.block_pool.get_num_free_blocks())
        return n

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        new = super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        self._log(call="allocate_new_blocks", req=request_id, num_tokens=num_tokens,
                  new=[b.block_id for b in new])
        return new

    def free(self, request_id) -> None:
        self._log(call="free", req=request_id, blocks=[b.block_id for b in self.req_to_blocks.get(request_id, [])])
        super().free(request_id)


def register_spec() -> None:
    # Built-ins first: _ensure_registered() does nothing once the registry is non-empty (kv_cache_spec_registry.py:45)
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(HeadPagedSpec, PagedManager, uniform_type_base_spec=FullAttentionSpec)


class SpecWorker(CPUWorker):
    def get_kv_cache_spec(self):
        specs = super().get_kv_cache_spec()
        return {name: HeadPagedSpec(**{f.name: getattr(s, f.name) for f in fields(s) if f.init})
                if type(s) is FullAttentionSpec else s for name, s in specs.items()}
