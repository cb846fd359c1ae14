"""When a press evicts: the schedule of every mode, written once for every host.

A host tells the schedule what each step writes to a layer of a sequence (:meth:`Schedule.advance` on that
layer's :class:`LayerClock`); the schedule answers with the eviction due now (:class:`Due`: what triggered it,
which queries it scores with, whether it waits for every layer of the step) or ``None``, and
:meth:`Schedule.budget` gives its :class:`~kvpress_ada.observation.Budget`. The modes:

* **prompt end** (the step that writes the last prompt token; a press that compresses the prefill or prefills
  in chunks): the
  one-shot budget of the prompt length, scored with the prompt's last ``query_window()`` queries (a press with
  ``prefill_chunk``: the step's own queries, as every chunk);
* **chunk** (a press with ``prefill_chunk``, a step that ends one of the prompt's chunks before its last,
  :meth:`Schedule.chunks`): the one-shot budget capped at the tokens seen, scored with the chunk's queries. A
  host whose steps are not the press's chunks (a serving engine's) splits a step where it crosses a chunk's end
  (:meth:`Schedule.chunk_end`) and scores with the queries of the steps since the last chunk's end;
* **decode** (a press with ``decode_budget`` or ``decode_ratio``): every ``decode_interval`` generated tokens,
  the decode budget, scored with the last ``query_window()`` generated tokens' queries.

An eviction waits for the end of the step (:attr:`Due.waits`) when its layer schedule compares layers
(``AdaLayer``) or, at prompt end, when the scorer runs a model pass of its own. Nothing here reads a tensor
but the budgets: hosts keep storage, attention and hooks (``docs/design.md``, "The press runtime").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from ..observation import Budget

if TYPE_CHECKING:
    from ..pipeline import Pipeline


class Trigger(str, Enum):
    """What makes an eviction due."""

    PROMPT_END = "prompt_end"
    CHUNK = "chunk"
    DECODE = "decode"


@dataclass(frozen=True)
class Due:
    """An eviction due after a step: its ``trigger``; ``step_queries``: scored with the step's own queries (a
    prefill chunk's: those of every step since the chunk began, where a host's steps are smaller than the chunk;
    else with the recent queries the host kept, see :attr:`Step.keeps_queries`); ``waits``: evicted with every
    layer at the end of the step; ``seen``: tokens the layer has been written after the step."""

    trigger: Trigger
    step_queries: bool
    waits: bool
    seen: int


@dataclass(frozen=True)
class Step:
    """What one step of one layer brings: the eviction it makes ``due`` (``None``: none) and whether the host
    keeps the step's queries among the layer's recent ``query_window()`` ones (``keeps_queries``)."""

    due: Due | None
    keeps_queries: bool


@dataclass
class LayerClock:
    """What has been written to one layer of one sequence: its ``prompt`` length, the tokens ``written`` so far
    (prompt and generated), and the generated tokens ``since`` the layer's last decode compaction (or since the
    prompt's end). ``compressed``: whether the press compresses this layer (False: a sliding-window layer of a
    hybrid model, :func:`~kvpress_ada.runtime.compressed_layers`; no eviction is ever due there)."""

    prompt: int
    written: int = 0
    since: int = 0
    compressed: bool = True


class Schedule:
    """The schedule of ``press`` (see the module docstring); stateless: the clocks hold the state."""

    def __init__(self, press: Pipeline):
        self.press = press

    # ---------------------------------------------------------------- the prompt
    def chunks(self, length: int) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` of a chunked prefill of ``length`` tokens, aligned on the end: every chunk
        but the first holds ``prefill_chunk`` tokens (one chunk without chunking)."""
        n = self.press.prefill_chunk
        if n is None or length <= n:
            return [(0, length)]
        bounds = list(range(length, 0, -n))[::-1]
        return list(zip([0] + bounds[:-1], bounds))

    def chunk_end(self, written: int, length: int) -> int:
        """The end of the chunk of a prompt of ``length`` tokens that holds token ``written`` (the next eviction of a
        chunked prefill once ``written`` tokens are in; ``length`` without ``prefill_chunk``)."""
        n = self.press.prefill_chunk
        if n is None or written >= length:
            return length
        return length - (length - written - 1) // n * n

    def chunked(self, length: int) -> bool:
        """Whether a prompt of ``length`` tokens is prefilled in more than one chunk."""
        return len(self.chunks(length)) > 1

    def check_fan_out(self, length: int) -> None:
        """Raise when fan-out (one dense prefill serving many presses) cannot derive this press's cache for a
        prompt of ``length`` tokens: a chunked prefill changes the prefill itself."""
        if self.chunked(length):
            raise ValueError(f"fan-out derives caches from one dense prefill, but this press prefills in chunks of "
                             f"{self.press.prefill_chunk} tokens ({length} here): run it with `with press(model)`")

    # ---------------------------------------------------------------- waiting
    @property
    def prompt_waits(self) -> bool:
        """Whether the prompt's eviction waits for every layer (a model-scope layer schedule, or a scorer with a
        model pass of its own: the full cache of every layer is then held until the end of the prefill)."""
        press = self.press
        return bool(type(press.layers).needs_all_layers or type(press.scorer).needs_model_pass)

    def waits(self, trigger: Trigger) -> bool:
        """Whether an eviction of ``trigger`` waits for every layer of its step."""
        return self.prompt_waits if trigger is not Trigger.DECODE else bool(type(self.press.layers).needs_all_layers)

    # ---------------------------------------------------------------- one step of one layer
    def due(self, clock: LayerClock, count: int) -> Due | None:
        """The eviction a step writing ``count`` more tokens to ``clock``'s layer makes due (``None``: none),
        without advancing the clock."""
        press, before, prompt = self.press, clock.written, clock.prompt
        if not clock.compressed:
            return None
        after = before + count
        trigger: Trigger | None = None
        chunked = press.prefill_chunk is not None
        end = self.chunk_end(before, prompt)
        if chunked and after > end and end < prompt:  # it would skip the chunk's eviction
            raise RuntimeError(f"a step writing tokens {before}..{after} crosses the end of a prefill chunk at {end} "
                               f"(prefill_chunk={press.prefill_chunk}): the host must split it there")
        if before < prompt <= after:
            trigger = Trigger.PROMPT_END if press.compresses_prefill or chunked else None
        elif after < prompt:  # the end of a chunk before the last
            trigger = Trigger.CHUNK if chunked and after == end else None
        elif press.compresses_decode:
            assert press.decode_interval is not None
            trigger = Trigger.DECODE if clock.since + count >= press.decode_interval else None
        if trigger is None:
            return None
        step = trigger is Trigger.CHUNK or (trigger is Trigger.PROMPT_END and press.prefill_chunk is not None)
        return Due(trigger, step_queries=step, waits=self.waits(trigger), seen=after)

    def advance(self, clock: LayerClock, count: int) -> Step:
        """Count a step writing ``count`` tokens to ``clock``'s layer: the eviction it makes due and whether the
        host keeps the step's queries. A decode eviction restarts the count of generated tokens; the prompt's end
        starts it at the generated tokens of the same step."""
        due = self.due(clock, count)
        keeps = self._keeps_queries(clock, count, due)
        before = clock.written
        clock.written += count
        if before < clock.prompt <= clock.written:
            clock.since = clock.written - clock.prompt
        elif before >= clock.prompt:
            clock.since = 0 if due is not None and due.trigger is Trigger.DECODE else clock.since + count
        return Step(due, keeps)

    def _keeps_queries(self, clock: LayerClock, count: int, due: Due | None) -> bool:
        """Whether a step writing ``count`` tokens to ``clock``'s layer (not advanced yet) brings queries a later
        eviction (or its own ``due``) may read: prompt queries of a press that compresses the prefill, generated
        tokens' queries of a press that compacts while generating once fewer than ``query_window()`` tokens
        remain before its next compaction (earlier ones leave the window before it)."""
        press = self.press
        if not clock.compressed:
            return False
        if clock.written < clock.prompt:
            return press.compresses_prefill or press.prefill_chunk is not None
        if not press.compresses_decode:
            return False
        window = press.scorer.query_window()
        assert press.decode_interval is not None and window is not None  # refused at Pipeline construction
        return due is not None or press.decode_interval - (clock.since + count) < window

    # ---------------------------------------------------------------- budgets
    def budget(self, due: Due | Trigger, lengths: torch.Tensor, seen: torch.Tensor | None = None) -> Budget:
        """The budget of an eviction of rows whose prompts hold ``lengths [B]`` real tokens and that have seen
        ``seen [B]`` tokens (a chunk's cap; the decode budget's context)."""
        trigger = due.trigger if isinstance(due, Due) else due
        if trigger is Trigger.DECODE:
            assert seen is not None
            return self.press.decode_budget_for(seen)
        if trigger is Trigger.CHUNK:
            assert seen is not None
            return self.press.prefill_budget(lengths, seen=seen)
        return self.press.prefill_budget(lengths)
