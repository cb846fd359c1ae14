"""The worker of an engine serving a press: each step, it hands the backend its model runner (whose batch
order maps rows to requests), returns the pages of finished, aborted and preempted requests, runs the
evictions that wait for every layer (a model-scope schedule) after the step's forward, and reports to the
scheduler the pages each evicted-from request holds (:mod:`.scheduler`). Its layers' KV spec is
:class:`~.scheduler.PressAttentionSpec`, so the engine core counts their blocks with the press's manager."""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.cpu_worker import CPUWorker

from . import press_of
from .backend import HostState
from .scheduler import REPORT, PressAttentionSpec


class PressWorker(CPUWorker):
    """vLLM's CPU worker plus the host's bookkeeping (see the module docstring); :attr:`host` is its
    :class:`~.backend.HostState` (the press of its engine's ``additional_config``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host = HostState(press=press_of(self.vllm_config.additional_config))

    def shutdown(self) -> None:
        """Remove the host's hooks with the engine."""
        self.host.close()
        super().shutdown()

    def get_kv_cache_spec(self) -> Any:
        specs = super().get_kv_cache_spec()
        return {name: PressAttentionSpec(**{f.name: getattr(spec, f.name) for f in fields(spec) if f.init})
                if type(spec) is FullAttentionSpec else spec for name, spec in specs.items()}

    def sample_tokens(self, grammar_output: Any) -> Any:
        return self._report(super().sample_tokens(grammar_output))

    def _report(self, output: Any) -> Any:
        """A copy of ``output`` carrying the pages of every evicted-from request (never vLLM's shared empty output)."""
        serving = self.host.serving
        if output is None or serving is None:
            return output
        pages = {rid: serving.pages_per_layer(rid) for rid, r in serving.requests.items() if r.evicted}
        if not pages:
            return output
        output = copy.copy(output)
        setattr(output, REPORT, pages)
        return output

    def execute_model(self, scheduler_output: Any) -> Any:
        serving = self.host.start_step(self.vllm_config, self.model_runner)
        if serving is not None:
            for rid in list(scheduler_output.finished_req_ids) + list(scheduler_output.preempted_req_ids or []):
                serving.release(rid)
        out = super().execute_model(scheduler_output)
        if serving is not None:
            serving.end_step()
        return self._report(out)
