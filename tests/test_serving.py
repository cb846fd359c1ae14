"""The press applied to requests the way a serving engine runs them (serving/requests.py): a tiny Llama
driven token by token with packed per-layer tensors, requests arriving at different times, against the
transformers host on each request alone: the same kept positions per (layer, kv head) and the same
greedy tokens; pages held are the kept entries rounded up per head and all return on release."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvpress_ada import AdaHead, AdaLayer, KVzap, Pipeline, SnapKV, preset
from kvpress_ada.hosts.transformers.caches import ragged_cache
from kvpress_ada.hosts.transformers.hf import cache_kwarg
from kvpress_ada.serving.pages import PagePool
from kvpress_ada.serving.pools import page_pool
from kvpress_ada.serving.record_pages import QuantizedPagePool
from kvpress_ada.serving.requests import PagedServing, check_servable
from kvpress_ada.storage import Int4, Int8

ENGINE = "kvpress_ada_test_engine"


def _engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A layer of the made-up engine: the step's tokens of one request go to the serving state."""
    step = kwargs.get("engine_step")
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    serving, rids, counts, positions, hidden, outputs = step
    B, H_q, Q, D = query.shape
    scale = float(module.scaling if scaling is None else scaling)
    layer = int(module.layer_idx)
    out = serving.attend(layer, rids, query[0].transpose(0, 1), key[0].transpose(0, 1),
                         value[0].transpose(0, 1), positions, counts, scale, hidden=hidden.get(layer))
    if outputs is not None:
        for rid, part in zip(rids, out.split(counts)):
            outputs.setdefault(rid, []).append(part.clone())
    return out.view(1, Q, H_q, D), None


AttentionInterface.register(ENGINE, _engine_attention)


class Engine:
    """Greedy decoding of several requests through one PagedServing, one request per forward (packed: B = 1)."""

    def __init__(self, model, press, pages=400, page_size=8, chunk=None):
        cfg = model.config
        D = cfg.hidden_size // cfg.num_attention_heads
        self.model, self.chunk = model, chunk
        if press.storage.quantized:  # the kind's own pool over an engine's pages (records over their bytes)
            pools = [page_pool(press.storage, torch.zeros(pages, 2, page_size, D))
                     for _ in range(cfg.num_hidden_layers)]
        else:
            pools = [PagePool.allocate(pages, page_size, D, torch.float32) for _ in range(cfg.num_hidden_layers)]

        def layer_info(i):
            attn = model.model.layers[i].self_attn
            return {"output_weight": attn.o_proj.weight.detach(), "rope_inv_freq": model.model.rotary_emb.inv_freq}

        self.serving = PagedServing(press, pools, cfg.num_key_value_heads, layer_info)
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def step(self, rid, ids: torch.Tensor, start: int) -> int:
        return self.packed([(rid, ids, start)])[0]

    def packed(self, work: list[tuple[str, torch.Tensor, int]], outputs: dict | None = None) -> list[int]:
        """One forward of several requests' next tokens packed (``(rid, ids [1, c], first position)`` each, in
        order); each request's greedy next token. ``outputs``: each request's attention outputs, layer after
        layer, are appended to ``outputs[rid]``."""
        ids = torch.cat([w[1] for w in work], dim=1)
        counts = [w[1].shape[1] for w in work]
        positions = torch.cat([torch.arange(start, start + c) for (_, _, start), c in zip(work, counts)])
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(ENGINE)
        hidden: dict[int, torch.Tensor] = {}  # hidden states entering each layer's attention, as an engine hands them

        def record(module, args, kwargs):
            hidden[int(module.layer_idx)] = kwargs.get("hidden_states", args[0] if args else None)[0]

        hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True)
                 for layer in self.model.model.layers]
        try:
            with torch.no_grad():
                logits = self.model(input_ids=ids, position_ids=positions[None], use_cache=False,
                                    engine_step=(self.serving, [w[0] for w in work], counts, positions, hidden,
                                                 outputs)).logits
        finally:
            for hook in hooks:
                hook.remove()
            self.model.set_attn_implementation(previous)
        self.serving.end_step()
        ends = list(itertools.accumulate(counts))
        return [int(logits[0, e - 1].argmax()) for e in ends]

    def prefill(self, rid, prompt: torch.Tensor) -> None:
        self.serving.add(rid, prompt.shape[1])
        bounds = [(0, prompt.shape[1])] if self.chunk is None else self.chunk(prompt.shape[1])
        for a, b in bounds:
            token = self.step(rid, prompt[:, a:b], a)
        self.tokens[rid] = [token]
        self.done[rid] = prompt.shape[1]

    def decode(self, rid) -> None:
        token = self.step(rid, torch.tensor([[self.tokens[rid][-1]]]), self.done[rid])
        self.done[rid] += 1
        self.tokens[rid].append(token)

    def kept(self, rid) -> list[list[list[int]]]:
        request = self.serving.requests[rid]
        out = []
        for pool, seq in zip(self.serving.pools, request.seqs):
            _, _, present, positions = pool.view([seq])
            out.append([sorted(positions[0, h][present[0, h]].tolist()) for h in range(seq.heads)])
        return out


def _alone(model, press, prompt, new_tokens):
    """The transformers host: greedy tokens and kept positions per (layer, kv head) of one request."""
    cache = ragged_cache(press.storage, model.config)
    with torch.no_grad(), press(model):
        out = model.generate(prompt, do_sample=False, max_new_tokens=new_tokens, **{cache_kwarg(model): cache})
    kept = []
    for i in range(len(cache.layers)):
        held = cache.view(i)
        kept.append([sorted(held.positions[0, h][held.valid[0, h]].tolist()) for h in range(held.valid.shape[1])])
    return out[0, prompt.shape[1]:].tolist(), kept


def _prompt(n, seed):
    return torch.randint(5, 100, (1, n), generator=torch.Generator().manual_seed(seed))


SERVED = ["snapkv", "ada_snapkv", "pyramidkv", "ada_pyramidkv", "streamingllm", "h2o", "tova", "knorm",
          "expected_attention", "ada_expected_attention", "criticalkv", "ada_criticalkv", "lagkv", "keydiff"]
MODES = {"one-shot": {}, "decode": {"decode_budget": 20, "decode_interval": 4}, "chunked": {"prefill_chunk": 24}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", SERVED)
def test_staggered_requests_keep_and_generate_what_each_keeps_alone(llama, name, mode):
    try:
        press = preset(name, compression_ratio=0.5, **MODES[mode])
    except ValueError:
        pytest.skip(f"{name} does not run in {mode} mode")  # refused at construction
    engine = Engine(llama, press, chunk=_press_chunks(press) if press.prefill_chunk else None)
    prompts = {"a": _prompt(90, 1), "b": _prompt(71, 2), "c": _prompt(100, 3)}
    new = 9
    engine.prefill("a", prompts["a"])
    for _ in range(3):
        engine.decode("a")
    engine.prefill("b", prompts["b"])
    engine.decode("b")
    engine.prefill("c", prompts["c"])
    while any(len(engine.tokens[r]) < new for r in prompts):
        for r in prompts:
            if len(engine.tokens[r]) < new:
                engine.decode(r)
    for r, prompt in prompts.items():
        tokens, kept = _alone(llama, press, prompt, new)
        # the engine writes a generated token's entry when it feeds it back: the last one is not in the cache
        assert engine.kept(r) == kept, (name, mode, r)
        assert engine.tokens[r] == tokens, (name, mode, r)


def _engine_chunks(size):
    """An engine's own split of a prompt into steps of at most ``size`` tokens (vLLM's long-prefill threshold)."""
    return lambda n: [(a, min(a + size, n)) for a in range(0, n, size)]


def _press_chunks(press):
    """The press's own end-aligned chunks of a prompt (every chunk but the first holds ``prefill_chunk``)."""
    def split(n):
        size = press.prefill_chunk
        bounds = list(range(n, 0, -size))[::-1]
        return list(zip([0] + bounds[:-1], bounds))
    return split


def _windowed(name, **options):
    """Preset ``name`` at ratio 0.5 with a 16-query window (so that scoring, not the window, decides)."""
    press = preset(name, compression_ratio=0.5, **options)
    return press.model_copy(update={"scorer": press.scorer.model_copy(update={"window": 16})})


BESIDE = {  # mode -> press (an engine step brings at most 40 tokens of a prompt: vLLM's long-prefill threshold)
    "one-shot": _windowed("ada_snapkv"),
    "chunked": _windowed("ada_snapkv", prefill_chunk=40),
    "decode": _windowed("ada_snapkv", decode_budget=20, decode_interval=4),
    "model scope": Pipeline(scorer=SnapKV(window=16), layers=AdaLayer(), compression_ratio=0.5, prefill_chunk=40,
                            decode_budget=20, decode_interval=4),
    "int4": _windowed("ada_snapkv", prefill_chunk=40, storage=Int4(group_size=16, residual=4)),
}
# (prompt length, step it arrives at): prompts ending, chunking and compacting in x's steps with other query counts
PARTNERS = [(90, 0), (50, 1), (60, 0), (130, 0), (90, 4), (17, 2), (100, 0)]


def _serve_packed(model, press, requests, new_tokens):
    """Run ``requests`` (``rid -> (prompt, arrival step, split)``) through one engine, every running request's next
    step packed into each forward: its prompt in the steps ``split(n)`` gives, then ``new_tokens`` greedy tokens.
    Returns the engine, each request's tokens and its attention outputs (every step, every layer)."""
    engine = Engine(model, press)
    steps = {rid: split(prompt.shape[1]) for rid, (prompt, _, split) in requests.items()}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    outputs: dict[str, list[torch.Tensor]] = {}
    t = 0
    while any(len(tokens[r]) < new_tokens for r in requests):
        work = []
        for rid, (prompt, arrival, _) in requests.items():
            if t < arrival or len(tokens[rid]) >= new_tokens:
                continue
            if rid not in engine.serving.requests:
                engine.serving.add(rid, prompt.shape[1])
            if steps[rid]:
                a, b = steps[rid].pop(0)
                work.append((rid, prompt[:, a:b], a))
            else:
                work.append((rid, torch.tensor([[tokens[rid][-1]]]), prompt.shape[1] + len(tokens[rid]) - 1))
        for (rid, _, _), token in zip(work, engine.packed(work, outputs)):
            if not steps[rid]:  # the step that brought the prompt's end, or a generated token
                tokens[rid].append(token)
        t += 1
    return engine, tokens, outputs


@pytest.mark.parametrize("partner", PARTNERS, ids=[f"{n}@{s}" for n, s in PARTNERS])
@pytest.mark.parametrize("mode", list(BESIDE))
def test_a_request_keeps_and_generates_the_same_beside_any_partner(llama, mode, partner):
    """Request x's kept positions per (layer, kv head), attention outputs and tokens depend only on its own tokens
    and steps, not on a request packed beside it in the same steps (its length, phase, query count, budget), in
    every mode the engine runs; and equal the transformers host's (x's steps: the press's chunks, if any)."""
    press = BESIDE[mode]
    x = _prompt(100, 21)
    split = _press_chunks(press) if press.prefill_chunk is not None else _engine_chunks(40)
    new = 12
    alone, tokens, outputs = _serve_packed(llama, press, {"x": (x, 0, split)}, new)
    length, arrival = partner
    # a layer schedule comparing layers evicts at the end of a step: a chunked prompt then comes in its chunks
    theirs = split if press.prefill_chunk is not None and type(press.layers).needs_all_layers else _engine_chunks(40)
    beside, tokens2, outputs2 = _serve_packed(
        llama, press, {"x": (x, 0, split), "p": (_prompt(length, 22), arrival, theirs)}, new)
    assert beside.kept("x") == alone.kept("x"), (mode, partner)
    assert len(outputs2["x"]) == len(outputs["x"])
    for mine, theirs in zip(outputs2["x"], outputs["x"]):  # packed matmuls of other sizes: rounding apart
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6), (mode, partner)
    assert tokens2["x"] == tokens["x"]
    host_tokens, host_kept = _alone(llama, press, x, new)
    assert alone.kept("x") == host_kept and tokens["x"] == host_tokens, mode


@pytest.mark.parametrize("steps", [7, 20, 40, 64, 100])
def test_a_chunked_press_evicts_at_its_own_chunks_whatever_the_engines_steps(llama, steps):
    """prefill_chunk=40 on a 100-token prompt (the transformers host's chunks 20 + 40 + 40): an engine bringing it in
    steps of 7, 20, 40, 64 or 100 tokens (smaller than a chunk, crossing chunks' ends, the whole prompt at once) keeps
    per (layer, kv head) the transformers host's positions and generates its tokens."""
    press = _windowed("ada_snapkv", prefill_chunk=40)
    x = _prompt(100, 21)
    engine, tokens, _ = _serve_packed(llama, press, {"x": (x, 0, _engine_chunks(steps))}, 8)
    host_tokens, host_kept = _alone(llama, press, x, 8)
    assert engine.kept("x") == host_kept and tokens["x"] == host_tokens, steps


def test_a_model_scope_chunked_press_takes_steps_that_end_at_its_chunks_and_refuses_others_in_one_line(llama):
    """Under AdaLayer every layer evicts at the end of a step: steps of 20 (ending at the chunks' ends 20 and 60)
    give the transformers host's kept positions and tokens; a step of 40 (crossing the end at 20) is refused."""
    press = Pipeline(scorer=SnapKV(window=16), layers=AdaLayer(), compression_ratio=0.5, prefill_chunk=40)
    x = _prompt(100, 21)
    engine, tokens, _ = _serve_packed(llama, press, {"x": (x, 0, _engine_chunks(20))}, 6)
    host_tokens, host_kept = _alone(llama, press, x, 6)
    assert engine.kept("x") == host_kept and tokens["x"] == host_tokens
    with pytest.raises(ValueError) as err:
        _serve_packed(llama, press, {"x": (x, 0, _engine_chunks(40))}, 2)
    assert "\n" not in str(err.value) and "crosses the end of a prefill chunk at 20" in str(err.value)


def test_model_scope_schedule_evicts_every_layer_at_the_end_of_the_step(llama):
    press = Pipeline(scorer=SnapKV(), layers=AdaLayer(), compression_ratio=0.6)
    engine = Engine(llama, press)
    prompt = _prompt(77, 4)
    engine.prefill("a", prompt)
    for _ in range(4):
        engine.decode("a")
    tokens, kept = _alone(llama, press, prompt, 5)
    assert engine.kept("a") == kept and engine.tokens["a"] == tokens


def test_pages_held_are_the_kept_entries_and_return_on_release(llama):
    press = preset("ada_snapkv", compression_ratio=0.75)
    engine = Engine(llama, press, pages=200, page_size=8)
    free = engine.serving.free_pages()
    engine.prefill("a", _prompt(96, 5))
    request = engine.serving.requests["a"]
    lengths = [n for seq in request.seqs for n in seq.lengths]
    assert sum(lengths) == 24 * 2 * len(request.seqs)  # round(0.25 * 96) per kv head on average, exact total
    assert request.pages_held == sum(-(-n // 8) for n in lengths)
    held = request.pages_held
    assert engine.serving.free_pages() == free - held
    assert engine.serving.release("a") == held and engine.serving.free_pages() == free
    assert all(seq.pages_held == 0 for seq in request.seqs)


def test_packed_requests_in_one_step_equal_each_request_stepped_alone():
    """One layer: three requests' tokens packed into one attend() call give the outputs, pages and evictions
    of three separate calls."""
    press = Pipeline(scorer=SnapKV(window=8), allocator=AdaHead(alpha=0.2), compression_ratio=0.5)
    g = torch.Generator().manual_seed(0)
    counts = [70, 1, 66]
    T, H_q, H, D = sum(counts), 4, 2, 16
    q, k, v = torch.randn(T, H_q, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    positions = torch.cat([torch.arange(c) + (30 if c == 1 else 0) for c in counts])

    def served():
        s = PagedServing(press, [PagePool.allocate(100, 8, D, torch.float32)], H)
        s.add("x", 70)
        s.add("y", 30)  # already past its prompt: a decode token
        s.add("z", 66)
        s.attend(0, ["y"], torch.randn(30, H_q, D, generator=torch.Generator().manual_seed(9)),
                 torch.randn(30, H, D, generator=torch.Generator().manual_seed(10)),
                 torch.randn(30, H, D, generator=torch.Generator().manual_seed(11)), torch.arange(30), [30], 0.25)
        return s

    together = served()
    out = together.attend(0, ["x", "y", "z"], q, k, v, positions, counts, 0.25)
    alone = served()
    parts, t = [], 0
    for rid, c in zip(["x", "y", "z"], counts):
        parts.append(alone.attend(0, [rid], q[t:t + c], k[t:t + c], v[t:t + c], positions[t:t + c], [c], 0.25))
        t += c
    assert torch.allclose(out, torch.cat(parts), atol=1e-6)
    for rid in "xyz":
        a, b = together.requests[rid].seqs[0], alone.requests[rid].seqs[0]
        assert a.lengths == b.lengths
        va, vb = together.pools[0].view([a]), alone.pools[0].view([b])
        assert torch.equal(va[3], vb[3]) and torch.equal(va[0], vb[0])


def test_what_a_serving_engine_cannot_apply_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        check_servable(preset("kvzip", compression_ratio=0.5))
    assert "\n" not in str(err.value) and "model pass" in str(err.value)


def test_a_press_is_served_only_by_pools_that_keep_its_storage():
    """Full-precision pools refuse a quantized storage (and quantized pools another storage) in one line."""
    from kvpress_ada.storage import Int8

    D, S = 32, 8
    plain = PagePool.allocate(10, S, D, torch.float32)
    records = QuantizedPagePool(torch.zeros(10, 2 * S * D * 4, dtype=torch.uint8), S, D, torch.float32,
                                Int4(group_size=16, residual=0).layout)
    int4 = preset("snapkv", compression_ratio=0.5, storage=Int4(group_size=16, residual=0))
    PagedServing(int4, [records], 2)
    PagedServing(preset("snapkv", compression_ratio=0.5), [plain], 2)
    for press, pools in ((int4, [plain]), (preset("snapkv", compression_ratio=0.5), [records]),
                         (preset("snapkv", compression_ratio=0.5, storage=Int8(group_size=16, residual=0)), [records]),
                         (preset("snapkv", compression_ratio=0.5, storage=Int4(group_size=16)), [records])):
        with pytest.raises(ValueError) as err:
            PagedServing(press, pools, 2)
        assert "\n" not in str(err.value) and f"storage={press.storage.label!r}" in str(err.value), str(err.value)


@pytest.mark.parametrize("mode", ["one-shot", "decode", "chunked"])
def test_a_scorer_reading_hidden_states_keeps_what_it_keeps_on_the_transformers_host(llama, tmp_path, mode):
    """KVzap scores each entry from the hidden state its token brought, recorded with the entry in its page."""
    from conftest import random_surrogate

    from kvpress_ada import surrogate as sur

    path = tmp_path / "surrogate.safetensors"
    sur.save(random_surrogate(llama.config, seed=5), path)
    press = preset("kvzap", compression_ratio=0.5, **MODES[mode]).model_copy(
        update={"scorer": KVzap(path=str(path), window=8)})
    engine = Engine(llama, press, chunk=_press_chunks(press) if press.prefill_chunk else None)
    prompts = {"a": _prompt(90, 11), "b": _prompt(75, 12)}
    engine.prefill("a", prompts["a"])
    engine.prefill("b", prompts["b"])
    for _ in range(8):
        engine.decode("a")
        engine.decode("b")
    for r, prompt in prompts.items():
        tokens, kept = _alone(llama, press, prompt, 9)
        assert engine.kept(r) == kept and engine.tokens[r] == tokens, (mode, r)


def test_a_prompt_shorter_than_the_scorer_needs_is_served_whole(llama):
    """A server answers a short request rather than failing it: nothing of it is evicted."""
    press = preset("snapkv", compression_ratio=0.5, decode_budget=8, decode_interval=2)  # window 64
    engine = Engine(llama, press)
    engine.prefill("short", _prompt(40, 7))
    for _ in range(5):
        engine.decode("short")
    assert engine.kept("short") == [[list(range(45))] * 2] * len(llama.model.layers)
    with torch.no_grad():
        plain = llama.generate(_prompt(40, 7), do_sample=False, max_new_tokens=6)
    assert engine.tokens["short"] == plain[0, 40:].tolist()


@pytest.mark.parametrize("name", ["snapkv", "ada_snapkv", "streamingllm"])
def test_a_request_computed_again_with_its_generated_tokens_meets_the_same_eviction(llama, name):
    """A preempted request comes back as one step holding its prompt and what it had generated: the press still
    evicts at the prompt's end, so the kept entries and the next tokens are those of the uninterrupted run."""
    first, again, token = _run_then_replay(llama, _small_window_press(name), _prompt(90, 8), generated=6)
    assert token == first.tokens["r"][6]
    assert again.kept("r") == first.kept("r")


def test_a_model_scope_schedule_evicts_a_computed_again_request_over_all_it_holds_at_the_step_end(llama):
    """Replayed with its generated tokens, a request under a model-scope schedule (which evicts at the end of the
    step, after the tokens past the prompt's end were written) keeps the prompt's budget over everything it holds:
    the uninterrupted run's entries at the same point minus the replayed tokens, in every row."""
    press = Pipeline(scorer=SnapKV(window=16), layers=AdaLayer(), compression_ratio=0.5)
    first, again, _ = _run_then_replay(llama, press, _prompt(90, 9), generated=6)
    held = [len(head) for layer in again.kept("r") for head in layer]
    assert sum(held) == sum(len(head) for layer in first.kept("r") for head in layer) - 6 * len(held)


def _run_then_replay(model, press, prompt, generated):
    """Request "r" run uninterrupted for ``generated`` tokens, and the same request computed again in a fresh engine
    as one step of its prompt and those tokens (as after a preemption): both engines and the replay's next token."""
    first = Engine(model, press)
    first.prefill("r", prompt)
    for _ in range(generated):
        first.decode("r")
    again = Engine(model, press)
    again.serving.add("r", prompt.shape[1])
    token = again.step("r", torch.cat([prompt, torch.tensor([first.tokens["r"][:generated]])], dim=1), 0)
    return first, again, token


def _small_window_press(name):
    press = preset(name, compression_ratio=0.5)
    if "window" in type(press.scorer).model_fields:
        press = press.model_copy(update={"scorer": press.scorer.model_copy(update={"window": 16})})
    return press


def _nearest_outward(lo: torch.Tensor, hi: torch.Tensor, true_lo: torch.Tensor, true_hi: torch.Tensor) -> bool:
    """Whether 16-bit ``lo, hi`` are ``true_lo`` rounded down and ``true_hi`` rounded up: on the outer side, and one
    step of their dtype inward crosses the true value (finite true values)."""
    inward_lo = torch.nextafter(lo, torch.full_like(lo, float("inf"))).float()
    inward_hi = torch.nextafter(hi, torch.full_like(hi, float("-inf"))).float()
    return (lo.dtype.itemsize == 2 and bool((lo.float() <= true_lo).all()) and bool((hi.float() >= true_hi).all())
            and bool((inward_lo > true_lo).all()) and bool((inward_hi < true_hi).all()))


READING = {  # mode -> a press's fields beside its reader (of 2 pages of 8 per kv head on average: a row holds ~6)
    "evict": dict(scorer=SnapKV(window=16), allocator=AdaHead(alpha=0.2), compression_ratio=0.5),
    "decode": dict(scorer=SnapKV(window=16), compression_ratio=0.5, decode_budget=24, decode_interval=4),
    "no eviction": dict(scorer="knorm"),
}


def _pages_per_head(selected, lengths, page_size):
    """Per row (kv head) of one request: the indices of the pages it reads among those it holds."""
    held = (lengths.long() + page_size - 1) // page_size
    return tuple(tuple(j for j in range(int(n)) if selected[h, j]) for h, n in enumerate(held))


@pytest.mark.parametrize("storage", [None, Int4(group_size=16, residual=4), Int8(group_size=16, residual=0)],
                         ids=["full", "int4", "int8"])
@pytest.mark.parametrize("mode", list(READING))
def test_requests_read_the_pages_each_reads_alone_on_the_transformers_host(llama, monkeypatch, mode, storage):
    """Under a reader (Ada's read budget over Quest's page bounds) requests packed in mixed steps (staggered
    arrivals, prompts in an engine's chunks of 40 beside others' decode tokens) read at each decode step, per
    (layer, kv head), the pages the transformers host reads for each alone, and generate its tokens, in full
    precision and as int4 / int8 records (the quantized pools' own summaries of their rows' pages, the records of
    the selected pages read); each held full-precision page's summaries are the min / max of the keys it holds
    after appends and compactions, a free page's the identities; pages held count their summaries' bytes."""
    from kvpress_ada.hosts.transformers.page_summaries import PageSummaries
    from kvpress_ada.readers import TopPages

    P = 8
    press = Pipeline(**READING[mode], reader=TopPages(budget=2 * P, page_size=P, allocator=AdaHead(alpha=0.2)))
    if storage is not None:
        press = press.replace(storage=storage)
    served: dict[str, dict[int, list]] = {}
    pages_read = PagedServing._pages_read

    def record_served(self, layer_idx, ids, query, table, lengths, scaling):
        selected = pages_read(self, layer_idx, ids, query, table, lengths, scaling)
        for n, rid in enumerate(ids):
            H = selected.shape[1]
            served.setdefault(rid, {}).setdefault(layer_idx, []).append(
                _pages_per_head(selected[n], lengths[n * H:(n + 1) * H], P))
        return selected

    alone: dict[int, list] = {}
    select = PageSummaries.select

    def record_alone(self, query, row_lengths, scaling, layer_idx, softcap=None):
        selected = select(self, query, row_lengths, scaling, layer_idx, softcap)
        alone.setdefault(layer_idx, []).append(_pages_per_head(selected, row_lengths, P))
        return selected

    monkeypatch.setattr(PagedServing, "_pages_read", record_served)
    monkeypatch.setattr(PageSummaries, "select", record_alone)
    prompts = {"a": (_prompt(90, 31), 0), "b": (_prompt(71, 32), 2), "c": (_prompt(100, 33), 3)}
    new = 10
    engine, tokens, _ = _serve_packed(llama, press, {r: (p, s, _engine_chunks(40)) for r, (p, s) in prompts.items()},
                                      new)
    fewer = 0
    for r, (prompt, _) in prompts.items():
        alone.clear()
        host_tokens, host_kept = _alone(llama, press, prompt, new)
        assert engine.kept(r) == host_kept and tokens[r] == host_tokens, (mode, r)
        assert served[r] == alone and len(alone) == len(llama.model.layers), (mode, r)
        assert all(len(steps) == new - 1 for steps in alone.values())  # every decode step of every layer read pages
        held = [-(-n // P) for seq in engine.serving.requests[r].seqs for n in seq.lengths]
        fewer += sum(len(js) < n for steps in alone.values() for per_head in steps for js, n in zip(per_head, held))
    assert fewer > 0  # heads read fewer pages than they hold
    if storage is not None:  # records: each row's reader pages summarised in the pool's own store (their values:
        for layer, pool in enumerate(engine.serving.pools):  # tests/test_quantized_paging.py)
            seqs = [r.seqs[layer] for r in engine.serving.requests.values()]
            assert isinstance(pool, QuantizedPagePool) and all(pool.compressed(seq) for seq in seqs)
            pages = sum(-(-n // P) for seq in seqs for n in seq.lengths)
            assert pool.nbytes(seqs) == (sum(seq.pages_held for seq in seqs) * pool.pages.shape[1]
                                         + pages * 2 * pool.head_dim * 2)  # kmin, kmax in float16
        return
    for pool, layer_seqs in zip(engine.serving.pools, zip(*(r.seqs for r in engine.serving.requests.values()))):
        used = torch.zeros(pool.capacity, dtype=torch.bool)
        for seq in layer_seqs:
            keys, _, present, _ = pool.view([seq])
            for h in range(seq.heads):
                held_keys = keys[0, h][present[0, h]]
                for j, page in enumerate(seq.pages[h]):
                    used[page] = True
                    page_keys = held_keys[j * P:(j + 1) * P]
                    assert _nearest_outward(pool.kmin[page], pool.kmax[page], page_keys.amin(0), page_keys.amax(0))
        assert bool((pool.kmin[~used] == float("inf")).all()) and bool((pool.kmax[~used] == float("-inf")).all())
        D = pool.k_pages.shape[-1]
        assert pool.kmin.dtype == torch.float16  # float32 pages: float16 summaries (2 bytes a channel)
        assert pool.nbytes(list(layer_seqs)) == sum(s.pages_held for s in layer_seqs) * (2 * P * D * 4 + 2 * D * 2)


@pytest.mark.parametrize("storage", [None, Int4(group_size=16, residual=4)], ids=["full", "int4"])
def test_a_request_computed_again_under_a_reader_reads_its_generated_tokens_one_at_a_time(llama, storage):
    """Computed again with what it had generated (as after a preemption), a request under a reader meets each
    generated token as it did the first time (a single query reading selected pages; of int4 records too), so its
    next token is the uninterrupted run's."""
    from kvpress_ada.readers import TopPages

    press = Pipeline(scorer=SnapKV(window=16), compression_ratio=0.5, reader=TopPages(budget=16, page_size=8))
    if storage is not None:
        press = press.replace(storage=storage)
    first, again, token = _run_then_replay(llama, press, _prompt(90, 8), generated=6)
    assert token == first.tokens["r"][6]
    assert again.kept("r") == first.kept("r")
