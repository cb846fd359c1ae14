"""With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` does vLLM (CPU) run scheduler and worker in the caller's process,
and does a refusal raised in the scheduler's ``__init__`` then reach the caller as the original exception?

Checks: the pids that load the plugin (one expected), that generation still equals transformers', and the
exception type and message of a start-up refusal.

Run (in the vLLM venv, after make_tiny_model.py and ``pip install --no-deps -e benchmarks/vllm_probe/probe_plugin``):
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/vllm_probe/single_process_probe.py /tmp/tiny-llama /tmp/single
"""

import os
import sys
from pathlib import Path


def main(model: str, out: Path) -> None:
    from vllm import LLM, SamplingParams

    out.mkdir(parents=True, exist_ok=True)
    plugin_log = out / "plugin.log"
    plugin_log.unlink(missing_ok=True)
    os.environ["KVPRESS_PROBE_PLUGIN_LOG"] = str(plugin_log)
    kwargs = dict(model=model, enforce_eager=True, dtype="float32", max_model_len=256, seed=0, block_size=32,
                  enable_prefix_caching=False, scheduler_cls="kvpress_vllm_probe.release.ReleasingScheduler")
    llm = LLM(**kwargs, additional_config={"kvpress_probe": {}})
    prompts = ["Hello world, this is a test of the tiny model.", "abc " * 30]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    print("RESULT caller pid", os.getpid(), "plugin registered in:", plugin_log.read_text().split())
    print("RESULT executor:", type(llm.llm_engine.engine_core).__name__,
          llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend)
    print("RESULT tokens", [list(o.outputs[0].token_ids) for o in outs])
    del llm
    try:
        LLM(**kwargs, additional_config={"kvpress_probe": {"fail": True}})
        print("RESULT fail: no exception")
    except Exception as e:  # noqa: BLE001
        print(f"RESULT fail: {type(e).__module__}.{type(e).__name__}: {e}")


if __name__ == "__main__":
    args = sys.argv[1:] + ["/tmp/tiny-llama", "/tmp/single"][len(sys.argv) - 1:]
    main(args[0], Path(args[1]))
