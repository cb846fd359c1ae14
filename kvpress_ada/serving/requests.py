"""A press applied to the requests a serving engine runs: their pages per (layer, kv head), their
attention, and their eviction as they advance, for any engine that packs tokens the usual way
(``q [T, H_q, D]``, each request's new tokens contiguous and in order).

An engine host calls, per layer and step, :meth:`PagedServing.attend` with the layer's post-RoPE
tensors of the step's tokens; it appends each request's keys and values to its pages, runs
:func:`~kvpress_ada.kernels.paged.ops.paged_attention`, and evicts where the press says so, exactly as the
transformers host's handlers do (through :meth:`Pipeline.keep <kvpress_ada.Pipeline.keep>`):

* end of a request's prefill (the step that brings its last prompt token): the one-shot budget of its
  prompt length, scored with its last ``query_window()`` queries;
* a press with ``prefill_chunk=N``: at the end of each of the press's own chunks of a longer prompt, whatever the
  engine's chunks (those of the transformers host: aligned on the prompt's end, every chunk but the first of
  ``N`` tokens, :meth:`Schedule.chunks <kvpress_ada.runtime.Schedule.chunks>`), the one-shot budget capped at the
  tokens seen, scored with the chunk's queries. Engine steps smaller than a chunk accumulate (the chunk's queries
  are kept across them); a step that crosses a chunk's end runs in parts, one per chunk, in every layer, so each
  part meets what the eviction before it kept: the kept positions and tokens are the transformers host's however
  the engine chunks the prompt. A layer schedule comparing layers (``AdaLayer``) evicts every layer at the end of
  the step, so there a step must not cross a chunk's end (refused in one line: the engine ends its steps there,
  as the vLLM host's scheduler does);
* a press with ``decode_budget``: every ``decode_interval`` generated tokens, its decode budget.

A layer schedule that compares layers (``AdaLayer``) waits for :meth:`PagedServing.end_step`, which
evicts every layer of the due requests at once. Pages freed by an eviction return to the layer's pool
at once (what lets an engine admit more requests); :meth:`PagedServing.release` returns a finished or
aborted request's pages. Positions are the engine's (true sequence positions), so RoPE continues from
the true length while a row holds fewer entries.

Under a press with a ``reader``, the pools keep their pages' summaries and a request decoding one token over
what the press kept reads only the pages the reader selects (the transformers host's compressed layer reads a
single-query step so): a full-precision pool attends over its rows' page tables cut to them, a quantized pool
(:class:`~.record_pages.QuantizedPagePool`) over the records of those pages of its rows (pages of as many entries,
summarised over what they read back as, as the transformers host's quantized layer does); the reader's
``page_size`` must be the pools' page size (:func:`reading_pages_of` makes it so).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..observation import Budget, LayerView
from ..readers import select_pages
from ..runtime import EndOfStep, FixedInputs, HeldEntries, LayerClock, Schedule, Trigger, layer_view, window_of
from .pages import PagedSequence, PagePool

if TYPE_CHECKING:
    from ..pipeline import Pipeline

LayerInfo = Callable[[int], Mapping[str, Any]]


def check_servable(press: Pipeline) -> None:
    """Raise a one-line ``ValueError`` for a press a serving engine cannot apply yet (whatever its pools)."""
    scorer = type(press.scorer)
    if scorer.needs_model_pass:
        raise ValueError(f"scorer {scorer.__name__} scores with its own model pass over each request's context, "
                         "which a serving engine does not run: use a one-pass attention scorer (snapkv, ...)")
    if press.evictor.merge is not None:
        raise ValueError(f"the evictor merges dropped entries into kept ones ({type(press.evictor.merge).__name__}), "
                         "which a serving engine's pages do not: serve without merge, or run the press through the "
                         "transformers host")
    if press.key_channels is not None:
        raise ValueError(f"key_channels={type(press.key_channels).__name__} zeroes channels of the kept keys, which a "
                         "serving engine's pages do not: serve without key_channels, or run the press through the "
                         "transformers host")
    if press.evictor.rerotate:
        raise ValueError("the evictor re-rotates the keys it keeps (rerotate=True), which a serving engine's pages "
                         "do not: serve with rerotate=False, or run the press through the transformers host")


def reading_pages_of(press: Pipeline, page_size: int) -> Pipeline:
    """``press`` with its reader reading pages of ``page_size`` entries (an engine's page: its kernel reads whole
    pages), its budget in tokens unchanged; warns when that changes the reader's ``page_size``. A budget that
    cannot hold a row's first and newest pages of that size is refused in one line."""
    reader = press.reader
    if reader is None or reader.page_size == page_size:
        return press
    try:
        paged = type(reader).model_validate({**reader.model_dump(), "page_size": page_size})
    except ValueError as err:
        errors = getattr(err, "errors", None)
        reason = errors()[0]["msg"] if callable(errors) else str(err).splitlines()[0]
        raise ValueError(f"reader page_size={reader.page_size}: this engine reads whole pages of {page_size} "
                         f"entries, and the reader at that page size is refused: {reason}") from None
    warnings.warn(f"reader page_size={reader.page_size}: this engine reads whole pages of {page_size} entries; the "
                  f"reader reads pages of {page_size} (its budget in tokens unchanged)", stacklevel=2)
    return press.replace(reader=paged)


@dataclass
class ServedRequest:
    """One request's state: its pages per layer, each layer's clock (tokens written, generated tokens since its
    last compaction: the runtime's :class:`~kvpress_ada.runtime.LayerClock`) and recent queries (what its next
    eviction scores with)."""

    prompt_len: int
    seqs: list[PagedSequence]
    clocks: list[LayerClock]
    queries: list[torch.Tensor | None]
    evicted: bool = False  # whether the press has evicted from it (it then holds fewer pages than tokens)
    whole: bool = False  # too short for the press's scorer: served without eviction

    @property
    def pages_held(self) -> int:
        return sum(seq.pages_held for seq in self.seqs)


@dataclass
class _Due:
    """Requests of one layer that evict in this step, and the budget they evict to."""

    ids: list[str]
    budget: Budget
    step_queries: list[torch.Tensor] | None = None  # what each request scores with (None: its recent queries)
    waits: bool = False  # evicted with every layer at the end of the step

    def part(self, members: list[int]) -> _Due:
        """The requests at indices ``members`` of this group, with their budgets and queries."""
        if members == list(range(len(self.ids))):
            return self
        index = torch.tensor(members, device=self.budget.average.device)
        cap = self.budget.cap
        budget = Budget(average=self.budget.average[index], lengths=self.budget.lengths[index],
                        cap=None if cap is None else cap[index])
        queries = None if self.step_queries is None else [self.step_queries[m] for m in members]
        return _Due([self.ids[m] for m in members], budget, queries, self.waits)


@dataclass
class PagedServing:
    """Every layer's :class:`PagePool` (one per layer, or one shared by all) and the :class:`ServedRequest` of
    every running request under ``press`` (see the module docstring). ``layer_info(layer_idx)`` gives what
    some scorers read besides the tensors (``output_weight``, ``rope_inv_freq``); ``None`` when the press's
    scorer reads neither."""

    press: Pipeline
    pools: list[PagePool]
    n_kv_heads: int
    layer_info: LayerInfo | None = None
    requests: dict[str, ServedRequest] = field(default_factory=dict)
    _pending: EndOfStep[tuple[_Due, float]] = field(init=False)  # groups waiting for the step's end, with scaling

    def __post_init__(self) -> None:
        check_servable(self.press)
        self.schedule = Schedule(self.press)
        self._pending = EndOfStep(len(self.pools))
        storage = self.press.storage
        if not all(pool.stores(storage) for pool in self.pools):
            raise ValueError(f"storage={storage.label!r}: these pools keep entries as {self.pools[0].storage_label}; "
                             "a quantized storage needs QuantizedPagePool pools of its bits, group and residual")
        reader = self.press.reader
        if reader is not None:
            sizes = sorted({pool.page_size for pool in self.pools})
            if sizes != [reader.page_size]:
                raise ValueError(f"reader page_size={reader.page_size} differs from these pools' pages of {sizes} "
                                 "entries: give the reader the pools' page size (reading_pages_of)")
            for pool in {id(p): p for p in self.pools}.values():
                pool.summarise()

    # ------------------------------------------------------------------ requests
    def add(self, request_id: str, prompt_len: int) -> None:
        """A new request with a prompt of ``prompt_len`` tokens (no page taken yet). A prompt shorter than the press's
        scorer needs (:meth:`Pipeline.check_context <kvpress_ada.Pipeline.check_context>`) is served whole: a
        server answers it rather than failing it."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already running")
        L = len(self.pools)
        self.requests[request_id] = ServedRequest(prompt_len, [PagedSequence(self.n_kv_heads) for _ in range(L)],
                                                  [LayerClock(prompt_len) for _ in range(L)], [None] * L,
                                                  whole=prompt_len < self.press.scorer.min_context())

    def release(self, request_id: str) -> int:
        """Return every page of a finished, aborted or preempted request; the pages returned."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return 0
        held = request.pages_held
        for pool, seq in zip(self.pools, request.seqs):
            pool.release(seq)
        return held

    def pages_held(self) -> int:
        return sum(r.pages_held for r in self.requests.values())

    def free_pages(self) -> int:
        """Free pages over the distinct pools (every layer may share one pool)."""
        return sum(pool.free_pages for pool in {id(p): p for p in self.pools}.values())

    def pages_per_layer(self, request_id: str) -> int:
        """What request ``request_id`` holds, in pages of one layer: its pages over all layers spread evenly when
        every layer shares one pool (a page serves any layer), else its fullest layer's."""
        seqs = self.requests[request_id].seqs
        if all(pool is self.pools[0] for pool in self.pools):
            return -(-sum(seq.pages_held for seq in seqs) // len(seqs))
        return max(seq.pages_held for seq in seqs)

    # ------------------------------------------------------------------ one layer, one step
    def attend(self, layer_idx: int, request_ids: list[str], query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, positions: torch.Tensor, counts: list[int], scaling: float,
               hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``layer_idx`` of one engine step: request ``request_ids[n]`` brings the next ``counts[n]`` of the
        packed ``query [T, H_q, D]``, ``key``/``value [T, H_kv, D]`` and ``positions [T]`` (and ``hidden [T,
        hidden_size]``, the hidden states entering the attention, for a scorer that reads them: each entry is
        scored once, as it arrives). Writes them, returns the attention output ``[T, H_q, D]`` and evicts what
        is due in this layer (see the module docstring).

        Under ``prefill_chunk`` a step that crosses the end of one of the press's chunks of a prompt runs in parts,
        each up to a chunk's end, the press evicting after each (see the module docstring). A step that brings a
        prompt's end and tokens after it (a preempted request computed again with what it had generated, in one
        step or in several of vLLM's chunks) runs in two parts, up to the prompt's end and then the rest, so the
        rest meets the evicted layer as it did the first time (exact for a press that evicts layer by layer); the
        rest goes one token at a time, as it was generated, where that changes what a token meets: decode
        compression (an eviction every ``decode_interval`` tokens; a layer schedule comparing layers still evicts
        once, at the end of the step) and a quantized storage (each row's newest entries read from its residual
        ring, older ones from records)."""
        requests = [self.requests[i] for i in request_ids]
        replay = self.press.compresses_decode or self.press.storage.quantized or self.press.reader is not None

        def part(request: ServedRequest, left: int) -> int:
            """The tokens of the request's next part, of the ``left`` it brings that no part has run yet."""
            written, prompt = request.clocks[layer_idx].written, request.prompt_len
            if written < prompt:  # up to the end of the press's chunk of the prompt (without chunks: the prompt's)
                end = prompt if request.whole else self.schedule.chunk_end(written, prompt)
                if left > end - written and end < prompt and self.schedule.prompt_waits:
                    raise ValueError(f"a step bringing prompt tokens {written}..{written + left} crosses the end of "
                                     f"a prefill chunk at {end} (prefill_chunk={self.press.prefill_chunk}) under "
                                     f"layers={type(self.press.layers).__name__}, which evicts every layer at the end "
                                     "of a step: end the request's steps at its chunks' ends (Schedule.chunks)")
                return min(left, end - written)
            return 1 if replay else left  # generated tokens only (a recompute split by vLLM's chunks)

        scores = None
        if self.press.scorer.reads_hidden_states:
            if hidden is None:
                raise ValueError(f"{type(self.press.scorer).__name__} scores entries from the hidden states entering "
                                 "attention: pass them to attend(hidden=...)")
            with torch.no_grad():
                scores = self.press.scorer.entry_scores(hidden[None], layer_idx)[0].float().transpose(0, 1)
        if all(part(r, c) == c for r, c in zip(requests, counts)):
            return self._attend(layer_idx, request_ids, query, key, value, positions, counts, scaling, scores)
        starts = list(itertools.accumulate(counts, initial=0))
        done = [0] * len(counts)
        out = torch.empty_like(query)
        while True:  # the next part of every request with tokens left, in one call
            parts = [(n, part(requests[n], c - done[n])) for n, c in enumerate(counts) if c > done[n]]
            if not parts:
                return out
            at = torch.cat([torch.arange(starts[n] + done[n], starts[n] + done[n] + p) for n, p in parts])
            at = at.to(query.device)
            part_scores = None if scores is None else scores[at]
            out[at] = self._attend(layer_idx, [request_ids[n] for n, _ in parts], query[at], key[at], value[at],
                                   positions[at], [p for _, p in parts], scaling, part_scores)
            for n, p in parts:
                done[n] += p

    def _attend(self, layer_idx: int, request_ids: list[str], query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, positions: torch.Tensor, counts: list[int], scaling: float,
                scores: torch.Tensor | None) -> torch.Tensor:
        pool = self.pools[layer_idx]
        requests = [self.requests[i] for i in request_ids]
        seqs = [r.seqs[layer_idx] for r in requests]
        table, lengths = pool.append(seqs, key, value, positions, counts, scores)
        start = torch.tensor([0] + counts, device=query.device).cumsum(0).to(torch.int32)
        if self.press.reader is not None:
            table, lengths = self._read_table(layer_idx, request_ids, requests, query, table, lengths, counts, start,
                                              scaling)
        out = pool.attend(query, table, lengths, start, scaling)
        due = self._advance(layer_idx, request_ids, requests, query, counts)
        with torch.no_grad():
            for group in due:
                if group.waits:  # viewed at the end of the step (what it holds then)
                    self._pending.wait(layer_idx, (group, scaling))
                    continue
                for members in self._alike({layer_idx: group}):
                    part = group.part(members)
                    view = self._view(layer_idx, part, scaling)
                    self._keep(layer_idx, part, self.press.keep([view], part.budget)[0])
        return out

    def end_step(self) -> None:
        """After every layer of a step: a layer schedule comparing layers evicts the due requests here."""
        if not self._pending:
            return
        with torch.no_grad():
            for waiting in self._pending.drain():  # every layer's group of the same requests, its own queries
                groups = {i: group for i, (group, _) in enumerate(waiting)}
                for members in self._alike(groups):
                    parts = {i: group.part(members) for i, group in groups.items()}
                    views = [self._view(i, parts[i], waiting[i][1]) for i in parts]
                    masks = self.press.keep(views, parts[0].budget)
                    for i, keep in enumerate(masks):
                        self._keep(i, parts[i], keep)

    # ------------------------------------------------------------------ sparse reads
    def _read_table(self, layer_idx: int, ids: list[str], requests: list[ServedRequest], query: torch.Tensor,
                    table: torch.Tensor, lengths: torch.Tensor, counts: list[int], start: torch.Tensor,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table, lengths)`` for :meth:`PagePool.attend` with each request that decodes one token over what the
        press kept (as the transformers host's compressed layer reads a single-query step) reading only the pages the
        reader selects for it (:meth:`PagePool.read_selected`: full-precision pools cut its rows' page tables, a
        quantized pool reads the selected pages' records); a request whose longest row the reader reads whole keeps
        its rows (dense reads: the same entries)."""
        reader = self.press.reader
        assert reader is not None
        reads = [n for n, (r, c) in enumerate(zip(requests, counts))
                 if c == 1 and r.evicted and not reader.reads_every_page(max(r.seqs[layer_idx].lengths))]
        if not reads:
            return table, lengths
        pool = self.pools[layer_idx]
        N, H = len(ids), self.n_kv_heads
        M = table.shape[1]
        at = torch.tensor(reads, device=table.device)
        rows_l = lengths.view(N, H)[at].reshape(-1)
        pages = pool.summary_pages([requests[n].seqs[layer_idx] for n in reads], table.view(N, H, M)[at].reshape(-1, M))
        q = query[start[at].long()][:, :, None]  # [n, H_q, 1, D]
        selected = self._pages_read(layer_idx, [ids[n] for n in reads], q, pages, rows_l, scaling)
        return pool.read_selected(table, lengths, at, selected)

    def _pages_read(self, layer_idx: int, ids: list[str], query: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, scaling: float) -> torch.Tensor:
        """``[n, H_kv, W]`` bool: the pages the reader reads for requests ``ids`` (their single queries ``[n, H_q, 1,
        D]``, their rows' reader pages ``table [n * H_kv, W]``: :meth:`PagePool.summary_pages`, and ``lengths``),
        from the pool's page summaries (``ids``: for a caller that records what each request reads)."""
        pool, reader = self.pools[layer_idx], self.press.reader
        assert reader is not None
        kmin, kmax = pool.summaries()
        return select_pages(reader, query, kmin, kmax, table.long(), lengths, scaling, layer_idx)

    # ------------------------------------------------------------------ internals
    def _advance(self, layer_idx: int, ids: list[str], requests: list[ServedRequest], query: torch.Tensor,
                 counts: list[int]) -> list[_Due]:
        """Count the step's tokens on each request's clock (the runtime's schedule), keep each request's recent
        queries where the schedule says so, and group the requests that evict now by what triggered it."""
        window = self.press.scorer.query_window()
        due: dict[Trigger, list[tuple[str, torch.Tensor | None]]] = {}
        t = 0
        for rid, request, c in zip(ids, requests, counts):
            q = query[t:t + c].detach().transpose(0, 1)  # [H_q, c, D]
            t += c
            clock = request.clocks[layer_idx]
            if request.whole:  # too short for the scorer: counted, never evicted
                clock.written += c
                continue
            step = self.schedule.advance(clock, c)
            if step.keeps_queries:
                held = request.queries[layer_idx]
                recent = q if held is None else torch.cat([held, q], dim=1)
                request.queries[layer_idx] = recent if window is None else recent[:, max(0, recent.shape[1] - window):]
            if step.due is None:
                continue
            # the queries it scores with now (a decode compaction reads the recent ones when it is viewed): the
            # prompt's (kept exactly when its end is due) or, under prefill_chunk, the chunk's (kept since its start)
            ends_prompt = step.due.trigger is Trigger.PROMPT_END
            now = request.queries[layer_idx] if ends_prompt or step.due.step_queries else None
            due.setdefault(step.due.trigger, []).append((rid, now))
            if ends_prompt or step.due.step_queries:
                request.queries[layer_idx] = None  # the next chunk, or decode compactions, score with their own
        groups = []
        device = query.device
        for trigger, members in due.items():
            group = [self.requests[i] for i, _ in members]
            lengths = torch.tensor([r.prompt_len for r in group], device=device)
            seen = torch.tensor([r.clocks[layer_idx].written for r in group], device=device)
            queries = [q for _, q in members if q is not None]
            groups.append(_Due([i for i, _ in members], self.schedule.budget(trigger, lengths, seen),
                               queries if len(queries) == len(members) else None, waits=self.schedule.waits(trigger)))
        return groups

    def _queries(self, layer_idx: int, group: _Due) -> list[torch.Tensor]:
        """What each request of ``group`` scores with in layer ``layer_idx``: its last ``min(w, queries, entries
        held by its fullest kv head)`` queries for a scorer's window ``w`` (the transformers host's window), each
        request's own whatever the others bring."""
        queries = []
        for i, rid in enumerate(group.ids):
            request = self.requests[rid]
            q = group.step_queries[i] if group.step_queries is not None else request.queries[layer_idx]
            if q is None:
                raise RuntimeError(f"layer {layer_idx}: a request evicts before any of its queries reached the layer")
            n = window_of(self.press.scorer, q.shape[1], max(request.seqs[layer_idx].lengths))
            queries.append(q[:, q.shape[1] - n:])
        return queries

    def _alike(self, groups: dict[int, _Due]) -> list[list[int]]:
        """The requests of ``groups`` (layer -> that layer's group of the same requests) split into those that score
        with as many queries in every layer: indices into the groups. A view stacks its requests' queries, so it is
        batched where the counts agree and never cuts one request's queries to another's."""
        parts: dict[tuple[int, ...], list[int]] = {}
        counts = [[q.shape[1] for q in self._queries(i, group)] for i, group in groups.items()]
        for m in range(len(counts[0])):
            parts.setdefault(tuple(c[m] for c in counts), []).append(m)
        return list(parts.values())

    def _view(self, layer_idx: int, group: _Due, scaling: float) -> LayerView:
        """The view of ``group``'s requests in layer ``layer_idx`` (they score with as many queries: :meth:`_alike`)."""
        pool = self.pools[layer_idx]
        seqs = [self.requests[i].seqs[layer_idx] for i in group.ids]
        held = HeldEntries(*pool.view(seqs))
        scorer = self.press.scorer
        inputs = FixedInputs(lambda i: self._info(i, "output_weight"), lambda i: self._info(i, "rope_inv_freq"))
        return layer_view(scorer, held, torch.stack(self._queries(layer_idx, group)), layer_idx=layer_idx,
                          n_layers=len(self.pools), scaling=scaling, inputs=inputs,
                          entry_scores=pool.view_scores(seqs) if scorer.reads_hidden_states else None)

    def _info(self, layer_idx: int, name: str) -> torch.Tensor:
        """``layer_info(layer_idx)[name]``, refused in one line when the engine host gives none."""
        value = None if self.layer_info is None else self.layer_info(layer_idx).get(name)
        if value is None:
            raise ValueError(f"{type(self.press.scorer).__name__} reads the layer's {name}, which this engine host "
                             f"does not give for layer {layer_idx}")
        return value

    def _keep(self, layer_idx: int, group: _Due, keep: torch.Tensor) -> None:
        pool = self.pools[layer_idx]
        pool.retain([self.requests[i].seqs[layer_idx] for i in group.ids], keep)
        for i in group.ids:
            self.requests[i].evicted = True
