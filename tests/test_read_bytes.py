"""Bytes of KV read per decode step (``RaggedCache.bytes_read``, counted after ``count_reads()``; off by default):
measured where a step attends or where its reader selects pages, checked against independent counts from the rows'
kept lengths (dense reads, a covering read budget, a small one over full precision and int4 records), batch rows
against the row alone, a compiled step against the eager ones, and the eval record's ``read_bytes_per_step``."""

import pytest
import torch
from conftest import build_model, left_padded_batch
from torch._dynamo.utils import counters

from kvpress_ada import AdaHead, Pipeline, SnapKV
from kvpress_ada.harness.eval import Sample
from kvpress_ada.harness.eval.report import format_table
from kvpress_ada.harness.eval.runner import Entry, EvalResult, Record, evaluate_sample
from kvpress_ada.hosts.transformers import compiled
from kvpress_ada.hosts.transformers.caches import new_cache
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.generation import split_prompt
from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache
from kvpress_ada.kernels.quantized.scheme import record_width
from kvpress_ada.readers import TopPages
from kvpress_ada.tokens import encode

torch.set_num_threads(1)
STEPS = 6  # decode forwards per generation (the first token comes from the prefill)
INT4 = {"name": "int4", "group_size": 16, "residual": 4}


def _generate(model, press, ids, mask=None, compile=False, count=True, tokens=False):
    """The cache after ``STEPS`` decode steps of greedy generation (every step runs: no early stop), counting what
    they read when ``count`` (and the tokens generated, when ``tokens``)."""
    cache, key = new_cache(press, model.config), cache_kwarg(model)  # before the press wraps the forward
    if count:
        cache.count_reads()
    with torch.inference_mode(), press(model, compile=compile):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0, **{key: cache})
    assert output_cache(out) is cache
    return (cache, out.sequences) if tokens else cache


def _ids(L=120, seed=0):
    return torch.randint(5, 100, (1, L), generator=torch.Generator().manual_seed(seed))


def _geometry(model, cache):
    """``(D, itemsize, bytes per entry, side bytes per row)`` of the cache's storage, from the model and the
    storage's own record definition (not from the layers' buffers)."""
    D = model.config.hidden_size // model.config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    layout = cache.storage.layout
    if layout is None:
        return D, itemsize, 2 * D * itemsize, 0
    dtype = next(model.parameters()).dtype
    return D, itemsize, 2 * record_width(D, layout, dtype), (3 + 2 * layout.residual) * D * itemsize


def _step_lengths(cache, layer, t):
    """``[B, H_kv]`` entries each row held at decode step ``t`` (1 .. STEPS): what it keeps after the last step, less
    the ``STEPS - t`` tokens appended after step ``t``."""
    return cache.head_lengths(layer) - (STEPS - t)


def _expected(model, cache, reader=None, summaries_when_covered=False):
    """Independent count of the bytes each batch row read over the ``STEPS`` decode steps: every held entry (dense),
    or under ``reader`` (``TopPages``) ``min(H_kv * ceil(budget / P), pages held)`` pages of each layer's batch row,
    each row's newest (partial) page among them (its real entries), the rest full; plus ``kmin, kmax`` of every page
    holding an entry. A layer whose rows all fit the read budget reads densely without scoring pages (eager), unless
    ``summaries_when_covered`` (the selection forced)."""
    D, _, per_entry, per_side = _geometry(model, cache)
    # 16-bit summaries: the cache's dtype when 16-bit, float16 over float32 keys or records read back in float32
    summary = 2 * D * torch.finfo(torch.float16).bits // 8
    total = torch.zeros(cache.head_lengths(0).shape[0], dtype=torch.long)
    for layer in range(len(cache.layers)):
        for t in range(1, STEPS + 1):
            n = _step_lengths(cache, layer, t)
            H = n.shape[1]
            side = H * per_side
            if reader is None:
                total += n.sum(-1) * per_entry + side
                continue
            P = reader.page_size
            pages = (n + P - 1) // P
            if int(pages.max()) <= reader.pages_per_head and not summaries_when_covered:
                total += n.sum(-1) * per_entry + side
                continue
            read = torch.minimum(pages.sum(-1), torch.full_like(pages[:, 0], H * reader.pages_per_head))
            newest = n - (pages - 1) * P  # the newest page's entries (non-empty rows)
            entries = (read - (n > 0).sum(-1)) * P + torch.where(n > 0, newest, 0).sum(-1)
            total += entries * per_entry + side + pages.sum(-1) * summary
    return total.tolist()


@pytest.mark.parametrize("storage", ["full", INT4])
def test_dense_reads_count_every_held_entry(llama, storage):
    ids, mask = left_padded_batch(lengths=(120, 95))
    cache = _generate(llama, Pipeline(scorer=SnapKV(window=8), compression_ratio=0.5, storage=storage), ids, mask)
    per_row, steps = cache.bytes_read()
    assert steps == STEPS
    assert per_row == _expected(llama, cache)
    cache.reset_reads()
    assert cache.bytes_read() == ([0, 0], 0)


@pytest.mark.parametrize("storage", ["full", INT4])
def test_reads_are_not_counted_by_default_and_counting_changes_nothing_else(llama, storage):
    """A cache counts nothing unless asked (no counter moves, ``bytes_read`` says not measured); counting on gives the
    independent count and the same tokens; turned off, it stops (and reads as not measured)."""
    ids, mask = left_padded_batch(lengths=(150, 110))
    press = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.4, storage=storage,
                     reader=TopPages(budget=32, page_size=8, allocator=AdaHead(alpha=0.2)))
    quiet, quiet_tokens = _generate(llama, press, ids, mask, count=False, tokens=True)
    assert quiet.bytes_read() == ([], 0)
    assert all(not layer.counts_reads and not bool(layer.reads.any()) for layer in quiet.layers)
    counted, tokens = _generate(llama, press, ids, mask, tokens=True)
    assert torch.equal(tokens, quiet_tokens)
    per_row, steps = counted.bytes_read()
    assert steps == STEPS and per_row == _expected(llama, counted, press.reader)
    counted.count_reads(False)
    assert counted.bytes_read() == ([], 0)


@pytest.mark.parametrize("storage", ["full", INT4])
def test_covering_read_budget_counts_as_dense_and_forced_selection_adds_the_summaries(llama, storage, monkeypatch):
    """A budget at or above what each row keeps reads every entry densely: the bytes of dense reads, exactly. Forced
    through the selection (every page selected), the same entries plus the summaries of every page held."""
    ids = _ids()
    base = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.5, storage=storage)
    dense = _generate(llama, base, ids).bytes_read()
    reader = TopPages(budget=512)
    covered = _generate(llama, base.replace(reader=reader), ids)
    assert covered.bytes_read() == dense
    monkeypatch.setattr(TopPages, "reads_every_page", lambda self, longest: False)
    forced = _generate(llama, base.replace(reader=reader), ids)
    per_row, steps = forced.bytes_read()
    assert steps == STEPS and per_row == _expected(llama, forced, reader, summaries_when_covered=True)
    assert per_row[0] > dense[0][0]


@pytest.mark.parametrize("storage", ["full", INT4])
@pytest.mark.parametrize("allocator", ["uniform", AdaHead(alpha=0.2)])
def test_small_read_budget_counts_the_pages_read_and_the_summaries(llama, storage, allocator):
    ids, mask = left_padded_batch(lengths=(150, 110))
    reader = TopPages(budget=32, page_size=8, allocator=allocator)
    base = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.4, storage=storage)
    cache = _generate(llama, base.replace(reader=reader), ids, mask)
    assert all(int(cache.head_lengths(i).max()) > 8 * reader.pages_per_head for i in range(len(cache.layers)))
    per_row, steps = cache.bytes_read()
    assert steps == STEPS and per_row == _expected(llama, cache, reader)
    if storage == "full":  # over int4 records of D = 16 the summaries of 8-entry pages cost about as much as reads
        dense = _generate(llama, base, ids, mask).bytes_read()[0]
        assert all(r < d for r, d in zip(per_row, dense))


def test_a_batch_row_reads_what_the_row_reads_alone(llama):
    """Each batch row of a left-padded batch counts the bytes it counts alone (Ada's read split and the summaries
    counted are per batch row; the rows' reserve differs between the two layouts and is not counted)."""
    ids, mask = left_padded_batch(lengths=(150, 110))
    press = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.4,
                     reader=TopPages(budget=32, page_size=8, allocator=AdaHead(alpha=0.2)))
    batch, steps = _generate(llama, press, ids, mask).bytes_read()
    assert steps == STEPS and batch[0] != batch[1]
    for b in range(2):
        alone, alone_steps = _generate(llama, press, ids[b:b + 1, mask[b].bool()]).bytes_read()
        assert alone_steps == STEPS and alone == [batch[b]]


@pytest.mark.parametrize("storage", ["full", INT4])
def test_compiled_step_counts_what_eager_steps_count(monkeypatch, storage):
    """The count is taken inside the compiled decode step (one graph, no graph break): the bytes the eager steps
    count over the same selection."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.delenv(compiled.ENV_VAR, raising=False)
    model = build_model("llama", num_hidden_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    press = Pipeline(scorer="snapkv", compression_ratio=0.5, storage=storage,
                     reader=TopPages(budget=48, allocator="ada"))
    ids = _ids(L=200, seed=1)
    counters.clear()
    eager = _generate(model, press, ids).bytes_read()
    assert eager[1] == STEPS and _generate(model, press, ids, compile=True).bytes_read() == eager
    assert counters["graph_break"] == {}, dict(counters["graph_break"])


SAMPLE = Sample(context="The pass key is 4821. " + "Blue doors and seven gates. " * 6, question="What is the pass key?",
                answers=["4821"], task="passkey", metric="string_match_all")


def test_eval_records_carry_the_bytes_read_per_step(tokenizer):
    """The dense entry's mean read per step lies between the bytes of what it keeps plus one and plus
    ``max_new_tokens`` entries per row (question-aware: nothing else is appended); a small read budget reads less;
    the full cache (a model cache) measures none; batched and batch-1 runs give the same values; the table shows it,
    and a record without the field (an older file) reads as ``-``."""
    model = build_model("llama", seed=5)
    base = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.5)
    entries = [Entry("dense", 0.5, base),
               Entry("read", 0.5, base.replace(reader=TopPages(budget=16, page_size=4, allocator="ada")))]
    new = 5
    one = evaluate_sample(model, tokenizer, SAMPLE, entries, question_aware=True, max_new_tokens=new, batch_entries=1)
    many = evaluate_sample(model, tokenizer, SAMPLE, entries, question_aware=True, max_new_tokens=new)
    assert [r.read_bytes_per_step for r in one] == [r.read_bytes_per_step for r in many]
    full, dense, read = one
    assert full.read_bytes_per_step is None
    head, tail = split_prompt(tokenizer, SAMPLE.context, SAMPLE.question)
    prefill = capture_prefill(model, torch.cat([encode(tokenizer, head, "cpu"), encode(tokenizer, tail, "cpu")], 1))
    kept = sum(int(k.sum()) for k in prefill.keep_masks(base))
    rows = sum(k.shape[1] for k in prefill.keep_masks(base))
    per_entry = 2 * (model.config.hidden_size // model.config.num_attention_heads) * 4
    assert dense.read_bytes_per_step is not None and read.read_bytes_per_step is not None
    assert (kept + rows) * per_entry <= dense.read_bytes_per_step <= (kept + rows * new) * per_entry
    assert read.read_bytes_per_step < dense.read_bytes_per_step
    rows_of_summary = EvalResult(one, 0.0, True).summary()
    assert rows_of_summary[1]["read_bytes_per_step"] == dense.read_bytes_per_step
    old = {k: v for k, v in vars(dense).items() if k != "read_bytes_per_step"}
    table = format_table(EvalResult([Record(**old)], 0.0, True).summary())
    assert "read MB" in table and table.splitlines()[-1].split()[8] == "-"


@pytest.mark.parametrize("decode_from", [0, 3])
def test_teacher_forcing_under_a_reader_reads_as_the_answer_does(decode_from):
    """Under a reader, the eval's teacher-forced logits (KL, top-1, hidden error) are those of the answer's own steps:
    the tokens before ``decode_from`` (the question) in one forward, each later token in a forward of its own (the
    reader reads sparsely only there); they differ from one multi-token forward (dense reads) and leave the cache
    as it was. Without a reader one forward is the same thing."""
    from kvpress_ada.harness.eval.runner import _teacher_forced

    model = build_model("llama", seed=5)
    base = Pipeline(scorer=SnapKV(window=8), compression_ratio=0.5)
    press = base.replace(reader=TopPages(budget=8, page_size=4))
    prefill = capture_prefill(model, _ids(96))
    tokens = _ids(9, seed=1)
    key = cache_kwarg(model)

    def by_hand(stepped: bool):
        cache = prefill.compressed_cache(press, prefill.keep_masks(press))
        parts = ([tokens[:, :decode_from]] if decode_from else []) + [tokens[:, t:t + 1] for t in
                                                                       range(decode_from, tokens.shape[1])]
        out = []
        with torch.inference_mode(), press(model):
            for part in parts if stepped else [tokens]:
                res = model(input_ids=part, use_cache=True, **{key: cache})
                cache = output_cache(res)
                out.append(res.logits)
        return torch.cat(out, 1)

    cache = prefill.compressed_cache(press, prefill.keep_masks(press))
    length = cache.get_seq_length()
    logits, hidden = _teacher_forced(model, press, cache, tokens, decode_from)
    assert cache.get_seq_length() == length
    assert logits.shape[1] == tokens.shape[1] and all(h.shape[1] == tokens.shape[1] for h in hidden)
    torch.testing.assert_close(logits, by_hand(stepped=True))
    assert not torch.allclose(logits, by_hand(stepped=False), atol=1e-4)  # a budget of 8 tokens reads less
    keep = prefill.keep_masks(base)
    with torch.inference_mode(), base(model):
        plain = model(input_ids=tokens, use_cache=True, **{key: prefill.compressed_cache(base, keep)})
    dense = _teacher_forced(model, base, prefill.compressed_cache(base, keep), tokens, decode_from)[0]
    torch.testing.assert_close(dense, plain.logits)
