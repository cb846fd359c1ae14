"""A CPU worker that logs, per step, what the worker learns from the scheduler (configured by ``worker_cls``)."""

import json
import os

from vllm.config import get_current_vllm_config
from vllm.v1.worker.cpu_worker import CPUWorker


class LoggingCPUWorker(CPUWorker):
    def execute_model(self, scheduler_output):
        cfg = (self.vllm_config.additional_config or get_current_vllm_config().additional_config or {})
        path = (cfg.get("kvpress_probe") or {}).get("log")
        if path:
            s = scheduler_output
            record = {
                "event": "step", "pid": os.getpid(),
                "new": [{"req": r.req_id, "prompt_len": len(r.prompt_token_ids or []), "block_ids": r.block_ids,
                         "num_computed_tokens": r.num_computed_tokens} for r in s.scheduled_new_reqs],
                "cached": {"req_ids": s.scheduled_cached_reqs.req_ids,
                           "num_computed_tokens": s.scheduled_cached_reqs.num_computed_tokens,
                           "new_block_ids": s.scheduled_cached_reqs.new_block_ids,
                           "resumed": sorted(s.scheduled_cached_reqs.resumed_req_ids)},
                "num_scheduled_tokens": s.num_scheduled_tokens, "finished_req_ids": sorted(s.finished_req_ids),
                "preempted_req_ids": sorted(s.preempted_req_ids or []),
                "new_block_ids_to_zero": s.new_block_ids_to_zero,
            }
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return super().execute_model(scheduler_output)
