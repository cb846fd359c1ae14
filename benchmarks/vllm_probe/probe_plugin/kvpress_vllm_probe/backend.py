"""A CPU attention backend that logs what the backend sees and delegates to vLLM's CPU_ATTN."""

import json
import os

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


class LoggingCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = get_current_vllm_config().additional_config or {}
        self.log_path = (cfg.get("kvpress_probe") or {}).get("log")
        self.calls = 0

    def _log(self, record: dict) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.log_path:
            self._log({"event": "kv_update", "pid": os.getpid(), "layer": layer.layer_name,
                       "key": list(key.shape), "slot_mapping": slot_mapping.tolist()})
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if self.log_path and attn_metadata is not None:
            m = attn_metadata
            self._log({
                "event": "forward", "pid": os.getpid(), "layer": layer.layer_name, "call": self.calls,
                "query": list(query.shape), "key": list(key.shape), "value": list(value.shape),
                "output": list(output.shape), "kv_cache": list(kv_cache.shape), "kv_stride": list(kv_cache.stride()),
                "kv_data_ptr": kv_cache.data_ptr(), "kv_storage_ptr": kv_cache.untyped_storage().data_ptr(),
                "kv_storage_bytes": kv_cache.untyped_storage().nbytes(), "kv_dtype": str(kv_cache.dtype),
                "num_actual_tokens": m.num_actual_tokens, "max_query_len": m.max_query_len,
                "query_start_loc": m.query_start_loc.tolist(), "seq_lens": m.seq_lens.tolist(),
                "block_table": m.block_table.tolist(), "slot_mapping": m.slot_mapping.tolist(),
                "causal": bool(m.causal) if not isinstance(m.causal, torch.Tensor) else "tensor",
                "layout_ok": self._layout_ok(key, value, kv_cache, m.slot_mapping),
            })
            self.calls += 1
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                               output_block_scale)


    @staticmethod
    def _layout_ok(key, value, kv_cache, slot_mapping) -> bool:
        """Whether every written token sits where the fp32 "vec" ISA puts it: with b, o = divmod(slot, bs) and the
        page of (b, h) viewed as the backend does (``[2 * bs, D]``, K half then V half), K is stored transposed
        (``K half.reshape(D, bs)[:, o]``) and V row-major (``V half[o]``). Other ISAs (bf16 AMX) tile both."""
        block_size, d = kv_cache.shape[2], key.shape[-1]
        ok = True
        for i in range(key.shape[0]):
            b, o = divmod(int(slot_mapping[i]), block_size)
            page = kv_cache[b].reshape(kv_cache.shape[1], 2, block_size * d)
            k_half, v_half = page[:, 0].reshape(-1, d, block_size), page[:, 1].reshape(-1, block_size, d)
            ok &= torch.equal(k_half[:, :, o], key[i]) and torch.equal(v_half[:, o], value[i])
        return bool(ok)


class LoggingCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[LoggingCPUImpl]:
        return LoggingCPUImpl
