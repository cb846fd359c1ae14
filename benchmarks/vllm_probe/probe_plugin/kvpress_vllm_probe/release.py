"""Worker -> scheduler channel and block release seen by admission (configured by worker_cls / scheduler_cls).

``ReleasingWorker`` attaches ``kvpress_release = {req_id: n}`` to the ModelRunnerOutput of the step that ends a
request's prefill (n = ``additional_config["kvpress_probe"]["release"]`` blocks). ``ReleasingScheduler`` reads it
in ``update_from_output`` and returns the request's first n blocks to the block pool the way vLLM's sliding-window
manager does (``_remove_blocks_in_range``: the table entries become the null block). It logs, per step, the
number of running requests and free blocks. The released blocks still hold live KV in this probe (nothing is
compacted), so the generated tokens of this probe are NOT meaningful: it checks the seams, not the output.
With ``additional_config["kvpress_probe"]["fail"]`` the scheduler refuses to start (start-up error surfacing).
"""

import copy
import json

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.cpu_worker import CPUWorker


def _cfg(vllm_config) -> dict:
    return (vllm_config.additional_config or {}).get("kvpress_probe") or {}


class ReleasingWorker(CPUWorker):
    def execute_model(self, scheduler_output):
        self._prefill_done = []
        new = {r.req_id: len(r.prompt_token_ids or []) for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        self._prompt_len = getattr(self, "_prompt_len", {})
        self._prompt_len.update(new)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            prompt_len = self._prompt_len.get(req_id)
            if prompt_len is not None and computed[req_id] < prompt_len <= computed[req_id] + n:
                self._prefill_done.append(req_id)  # this step ends the request's prefill
        for req_id in scheduler_output.finished_req_ids:
            self._prompt_len.pop(req_id, None)
        return self._attach(super().execute_model(scheduler_output))

    def sample_tokens(self, grammar_output):
        return self._attach(super().sample_tokens(grammar_output))

    def _attach(self, output):
        n = _cfg(self.vllm_config).get("release", 0)
        if output is None or not n or not self._prefill_done:
            return output
        output = copy.copy(output)  # never mutate vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT
        output.kvpress_release = {req_id: n for req_id in self._prefill_done}
        self._prefill_done = []
        return output


class ReleasingScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs):
        if _cfg(vllm_config).get("fail"):
            raise ValueError("kvpress_ada: prefix caching is not supported by the vLLM host (probe refusal)")
        super().__init__(vllm_config, *args, **kwargs)
        self._probe_log = _cfg(vllm_config).get("sched_log")

    def update_from_output(self, scheduler_output, model_runner_output):
        released = getattr(model_runner_output, "kvpress_release", {})
        manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        before = self.kv_cache_manager.block_pool.get_num_free_blocks()
        for req_id, n in released.items():
            manager._remove_blocks_in_range(req_id, 0, n)
        if self._probe_log:
            with open(self._probe_log, "a") as f:
                f.write(json.dumps({"running": len(self.running), "waiting": len(self.waiting),
                                    "free_before": before, "released": released,
                                    "free_after": self.kv_cache_manager.block_pool.get_num_free_blocks()}) + "\n")
        return super().update_from_output(scheduler_output, model_runner_output)
