"""Do blocks freed mid-request reach vLLM's admission? And how does a refusal at engine start reach the user?

Three engine starts on a tiny KV pool (``num_gpu_blocks_override``), 8 requests of 100 prompt tokens:
1. ``ReleasingScheduler`` + ``ReleasingWorker`` with release 0 (vLLM's own accounting): peak running requests;
2. the same with 2 blocks released per request at the end of its prefill: the worker's report crosses the
   worker -> engine-core process boundary on the ModelRunnerOutput, the scheduler frees the blocks, and more
   requests run at once (tokens are not meaningful here: see kvpress_vllm_probe/release.py);
3. the scheduler raising in ``__init__`` (engine-core process): what exception and message the caller gets.

Run (in the vLLM venv, after make_tiny_model.py and ``pip install --no-deps -e benchmarks/vllm_probe/probe_plugin``):
    python benchmarks/vllm_probe/release_probe.py /tmp/tiny-llama /tmp/release
"""

import json
import sys
from pathlib import Path

PROMPTS = [f"{i} " + "abcd" * 25 for i in range(8)]


def run(model: str, log: Path, release: int = 0, fail: bool = False) -> list[dict]:
    from vllm import LLM, SamplingParams

    log.unlink(missing_ok=True)
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=256, seed=0, block_size=32,
              num_gpu_blocks_override=17, max_num_seqs=8, enable_prefix_caching=False,
              worker_cls="kvpress_vllm_probe.release.ReleasingWorker",
              scheduler_cls="kvpress_vllm_probe.release.ReleasingScheduler",
              additional_config={"kvpress_probe": {"sched_log": str(log), "release": release, "fail": fail}})
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    del llm
    return [json.loads(line) for line in log.read_text().splitlines()]


if __name__ == "__main__":
    model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/release")
    out.mkdir(parents=True, exist_ok=True)
    for release in (0, 2):
        steps = run(model, out / f"release{release}.jsonl", release=release)
        print(f"RESULT release={release}: steps={len(steps)} peak running={max(s['running'] for s in steps)} "
              f"releases seen by the scheduler={sum(len(s['released']) for s in steps)} "
              f"min free blocks={min(s['free_after'] for s in steps)}")
    try:
        run(model, out / "fail.jsonl", fail=True)
        print("RESULT fail: no exception")
    except Exception as e:  # noqa: BLE001
        text = str(e)
        print(f"RESULT fail: {type(e).__module__}.{type(e).__name__}: {text!r} ({len(text.splitlines())} line(s))")
        print("RESULT fail cause:", repr(e.__cause__), repr(e.__context__))
