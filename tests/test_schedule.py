"""The press runtime's schedule on small integer cases: evictions fall where each mode says, with the budgets the
policy gives, and what a layer keeps of its queries is what its next eviction reads."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpress_ada import AdaLayer, KVzip, Pipeline, SnapKV, preset
from kvpress_ada.runtime import LayerClock, Schedule, Trigger


def _run(schedule: Schedule, prompt: int, steps: list[int]):
    """Advance one clock through ``steps``; ``[(tokens written after the step, due or None, keeps)]``."""
    clock = LayerClock(prompt)
    out = []
    for count in steps:
        step = schedule.advance(clock, count)
        out.append((clock.written, step.due, step.keeps_queries))
    return out


def test_one_shot_evicts_once_at_the_prompt_end_with_the_prompt_queries():
    schedule = Schedule(preset("snapkv", compression_ratio=0.5))
    [(written, due, keeps)] = _run(schedule, 40, [40])
    assert written == 40 and due is not None and keeps
    assert due.trigger is Trigger.PROMPT_END and not due.step_queries and not due.waits and due.seen == 40
    assert _run(schedule, 40, [40, 1, 1])[1:] == [(41, None, False), (42, None, False)]


def test_engine_chunks_of_an_unchunked_press_evict_only_at_the_prompt_end():
    schedule = Schedule(preset("snapkv", compression_ratio=0.5))
    dues = [due for _, due, _ in _run(schedule, 40, [16, 16, 8])]
    assert dues[:2] == [None, None] and dues[2] is not None and dues[2].trigger is Trigger.PROMPT_END
    assert not dues[2].step_queries  # scored with the prompt's recent queries, kept across the engine's chunks


def test_chunked_press_evicts_after_every_chunk_with_its_own_queries_and_a_capped_budget():
    press = preset("snapkv", budget=8, prefill_chunk=4)
    schedule = Schedule(press)
    chunks = schedule.chunks(10)
    assert chunks == [(0, 2), (2, 6), (6, 10)]
    run = _run(schedule, 10, [b - a for a, b in chunks])
    assert [due.trigger for _, due, _ in run] == [Trigger.CHUNK, Trigger.CHUNK, Trigger.PROMPT_END]
    assert all(due.step_queries for _, due, _ in run) and [due.seen for _, due, _ in run] == [2, 6, 10]
    budget = schedule.budget(run[0][1], torch.tensor([10]), seen=torch.tensor([2]))
    assert budget.cap is not None and int(budget.cap[0]) == 2 and int(budget.average[0]) == 8


def test_a_chunked_press_evicts_at_its_own_chunks_ends_whatever_the_hosts_steps():
    """Steps smaller than a chunk (an engine's): an eviction only in the step ending a chunk, scored with the chunk's
    queries (kept across its steps); a step that would cross a chunk's end is refused (a host splits it there)."""
    schedule = Schedule(preset("snapkv", budget=8, prefill_chunk=4))
    assert [schedule.chunk_end(w, 10) for w in range(11)] == [2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 10]
    assert Schedule(preset("snapkv", budget=8)).chunk_end(3, 10) == 10
    run = _run(schedule, 10, [1, 1, 2, 2, 3, 1, 1])
    assert [(written, None if due is None else due.trigger) for written, due, _ in run] == [
        (1, None), (2, Trigger.CHUNK), (4, None), (6, Trigger.CHUNK), (9, None), (10, Trigger.PROMPT_END), (11, None)]
    assert all(keeps for _, _, keeps in run[:6]) and all(due.step_queries for _, due, _ in run if due is not None)
    for steps in ([3], [2, 5], [2, 2, 3]):
        try:
            _run(schedule, 10, steps)
        except RuntimeError as err:
            assert "crosses the end of a prefill chunk" in str(err) and "\n" not in str(err)
        else:
            raise AssertionError(f"steps {steps} crossing a chunk's end were taken")


@given(interval=st.integers(1, 9), window=st.integers(1, 12), prompt=st.integers(1, 30),
       steps=st.lists(st.integers(1, 4), min_size=1, max_size=30))
@settings(max_examples=200, deadline=None)
def test_decode_compactions_fall_every_interval_and_read_the_last_window_queries(interval, window, prompt, steps):
    """Whatever the steps (engine chunks, speculative tokens): one prompt-end eviction, in the step bringing the
    last prompt token; a decode compaction in each step where ``interval`` generated tokens have arrived since the
    last one; and the queries the layer keeps (the steps flagged ``keeps_queries``, cut to ``window``) are the
    last ``window`` of the generated tokens' queries whenever a compaction reads them."""
    press = Pipeline(scorer=SnapKV(window=window, kernel=1), compression_ratio=0.5, decode_budget=4,
                     decode_interval=interval)
    schedule = Schedule(press)
    clock = LayerClock(prompt)
    token, since, kept, generated = 0, 0, [], []
    for count in [prompt] + steps:
        before = token
        step = schedule.advance(clock, count)
        token += count
        new = list(range(before, token))
        if before < prompt <= token:
            assert step.due is not None and step.due.trigger is Trigger.PROMPT_END
            since = token - prompt
            generated, kept = [t for t in new if t >= prompt], []
            continue
        generated += new
        if step.keeps_queries:
            kept = (kept + new)[-window:]
        since += count
        if since >= interval:
            assert step.due is not None and step.due.trigger is Trigger.DECODE and step.due.seen == token
            assert kept == generated[-window:]
            since = 0
        else:
            assert step.due is None
        assert clock.since == since and clock.written == token


def test_a_layer_schedule_comparing_layers_waits_for_every_layer_and_a_model_pass_only_at_the_prompt():
    ada = Schedule(preset("ada_snapkv", compression_ratio=0.5, layers=AdaLayer(), decode_budget=8, decode_interval=4))
    assert ada.waits(Trigger.PROMPT_END) and ada.waits(Trigger.CHUNK) and ada.waits(Trigger.DECODE)
    kvzip = Schedule(Pipeline(scorer=KVzip(), compression_ratio=0.5))
    assert kvzip.prompt_waits and not kvzip.waits(Trigger.DECODE)
    assert not Schedule(preset("snapkv", compression_ratio=0.5)).prompt_waits


def test_decode_only_press_keeps_the_prompt_and_a_ratio_zero_press_evicts_nothing():
    decode_only = Schedule(Pipeline(scorer=SnapKV(window=2, kernel=1), decode_budget=4, decode_interval=2))
    run = _run(decode_only, 6, [6, 1, 1])
    assert run[0][1] is None and run[1][1] is None and run[2][1] is not None and run[2][1].trigger is Trigger.DECODE
    assert _run(Schedule(preset("snapkv", compression_ratio=0.0)), 6, [6, 1]) == [(6, None, False), (7, None, False)]


def test_budgets_are_the_policy_s():
    press = preset("snapkv", compression_ratio=0.75, decode_budget=5, decode_interval=3)
    schedule = Schedule(press)
    lengths, seen = torch.tensor([40, 12]), torch.tensor([44, 16])
    for got, want in ((schedule.budget(Trigger.PROMPT_END, lengths), press.prefill_budget(lengths)),
                      (schedule.budget(Trigger.DECODE, lengths, seen), press.decode_budget_for(seen))):
        assert torch.equal(got.average, want.average) and torch.equal(got.lengths, want.lengths)


def test_a_row_s_schedule_does_not_depend_on_its_partners():
    """Clocks are per sequence: interleaving another sequence's steps changes nothing of this one's evictions."""
    schedule = Schedule(preset("snapkv", compression_ratio=0.5, prefill_chunk=8, decode_budget=4, decode_interval=3))
    alone = _run(schedule, 20, [4, 8, 8, 1, 1, 1, 1])  # the press's chunks of 20 tokens: 4 + 8 + 8
    x, partner = LayerClock(20), LayerClock(7)
    together = []
    for cx, cp in zip([4, 8, 8, 1, 1, 1, 1], [7, 1, 1, 1, 1, 1, 1]):
        schedule.advance(partner, cp)
        step = schedule.advance(x, cx)
        together.append((x.written, step.due, step.keeps_queries))
    assert together == alone


def test_fan_out_refuses_a_press_that_chunks_this_prompt():
    schedule = Schedule(preset("snapkv", budget=4, prefill_chunk=8))
    schedule.check_fan_out(8)
    try:
        schedule.check_fan_out(9)
    except ValueError as err:
        assert "chunks of 8 tokens" in str(err)
    else:
        raise AssertionError("a chunked prompt was accepted by fan-out")
