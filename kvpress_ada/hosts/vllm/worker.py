"""The worker of an engine serving a press: each step, it hands the backend its model runner (whose batch
order maps rows to requests), returns the pages of finished, aborted and preempted requests, and runs the
evictions that wait for every layer (a model-scope schedule) after the step's forward."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from .backend import STATE


class PressWorker(CPUWorker):
    """vLLM's CPU worker plus the host's bookkeeping (see the module docstring)."""

    def execute_model(self, scheduler_output: Any) -> Any:
        serving = STATE.start_step(self.vllm_config, self.model_runner)
        if serving is not None:
            for rid in list(scheduler_output.finished_req_ids) + list(scheduler_output.preempted_req_ids or []):
                serving.release(rid)
        out = super().execute_model(scheduler_output)
        if STATE.serving is not None:
            STATE.serving.end_step()
        return out
