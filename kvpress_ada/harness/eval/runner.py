"""Evaluate a grid of presses x compression ratios on samples, with fan-out.

Fan-out: each sample is prefilled once (:func:`capture_prefill`); every press's compressed
cache is derived from the same observations (except presses with ``prefill_chunk`` shorter than
the prompt: they run their own chunked prefill, and their eviction loss is NaN), which gives
exactly the answers a separate run per press would give (tested) at a fraction of the cost (prefill dominates on CPU).
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from kvpress_ada.evictors import TopK
from kvpress_ada.harness.eval.scoring import score_sample
from kvpress_ada.harness.eval.signals import eviction_loss, fidelity
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.generation import (
    continue_rows,
    decode_rows,
    eos_ids,
    generate,
    split_prompt,
)
from kvpress_ada.hosts.transformers.hf import cache_kwarg, output_cache
from kvpress_ada.pipeline import Pipeline
from kvpress_ada.presets import preset
from kvpress_ada.runtime import Schedule
from kvpress_ada.tokens import encode

ENTRY_BATCH = 16  # entries decoded together in one batch (memory: 16 compressed caches of a sample)


@dataclass(frozen=True)
class Entry:
    """One cell of the grid: a label (preset name or config), a ratio and the press (None = full)."""

    label: str
    ratio: float
    press: Pipeline | None


def grid(presets: list[str] | dict[str, Pipeline], ratios: list[float]) -> list[Entry]:
    """Entries for every preset x ratio; ``presets`` may map labels to Pipelines (ratio overridden)."""
    entries = []
    items = presets.items() if isinstance(presets, dict) else ((name, None) for name in presets)
    for label, base in items:
        for ratio in ratios:
            if base is None:
                press = preset(label, compression_ratio=ratio)
            else:
                press = base.replace(compression_ratio=ratio, budget=None)
            entries.append(Entry(label, ratio, press))
    return entries


@dataclass
class Record:
    sample: int
    task: str
    label: str
    ratio: float
    answer: str
    score: float
    kv_bytes: int
    full_kv_bytes: int
    kl: float | None = None
    top1: float | None = None
    hidden_error: list[float] = field(default_factory=list)
    eviction_loss: list[float] = field(default_factory=list)
    achieved_ratio: float | None = None  # fraction of the context's entries evicted (all layers and kv heads)
    # bytes of KV the answer's decode steps read, mean per step, as measured by the cache (RaggedCache.bytes_read:
    # every kept entry read densely, or the pages a reader selects, with their summaries); None: not measured (a
    # cache that counts no reads, e.g. the full cache, or no decode step)
    read_bytes_per_step: float | None = None


def _routed(press, model):
    return press(model) if press is not None and not press.is_noop else nullcontext()


def _crop_to(cache, length: int) -> None:
    cache.crop(length - cache.get_seq_length())


def _decoding(press, cache=None) -> bool:
    """Whether answering and teacher-forcing run on a copy of ``cache``: decode compression compacts while
    generating, and a sliding-window layer lets old tokens go, which a crop cannot undo."""
    return (press is not None and press.compresses_decode) or any(getattr(cache, "is_sliding", ()))


@torch.inference_mode()
def _teacher_forced(model, press, cache, tokens: torch.Tensor, decode_from: int = 0):
    """Logits ``[B, T, V]`` and per-layer hidden states ``[B, T, H]`` of ``tokens [B, T]`` fed over ``cache``
    (left as it was). Under a press with a reader (sparse reads at single-token decode steps) the tokens from
    ``decode_from`` on are fed one per forward, as the answer is generated, those before in one forward (the
    question's prefill): what is measured is what the answer read."""
    length = cache.get_seq_length()
    copied = _decoding(press, cache)
    if copied:
        cache = copy.deepcopy(cache)
    parts = [tokens]
    if press is not None and press.reader is not None and tokens.shape[1] - decode_from > 1:
        parts = ([tokens[:, :decode_from]] if decode_from else []) + list(tokens[:, decode_from:].split(1, dim=1))
    logits, hidden = [], []
    with _routed(press, model):
        for part in parts:
            out = model(input_ids=part, use_cache=True, output_hidden_states=True, **{cache_kwarg(model): cache})
            cache = output_cache(out)
            logits.append(out.logits)
            hidden.append(out.hidden_states)
    if not copied:
        _crop_to(cache, length)
    if len(logits) == 1:
        return logits[0], hidden[0]
    return torch.cat(logits, 1), tuple(torch.cat(layer, 1) for layer in zip(*hidden))


def _row(logits: torch.Tensor, hidden, e: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Batch row ``e`` of :func:`_teacher_forced`'s output."""
    return logits[e], [h[e] for h in hidden]


@torch.inference_mode()
def evaluate_sample(model, tokenizer, sample, entries: list[Entry], index: int = 0, question_aware: bool = False,
                    max_new_tokens: int = 16, window: int = 64, on_entry=None,
                    batch_entries: int = ENTRY_BATCH) -> list[Record]:
    """All entries on one sample from a single prefill; the full cache is recorded as ``label='full'``.

    Entries whose cache is a plain ragged cache derived from the prefill (evictor ``TopK``, no
    chunked prefill, no decode compression) answer ``batch_entries`` at a time: their caches become
    the rows of one batch (:meth:`Prefill.compressed_batch`), decoded and teacher-forced together.
    Each row attends to exactly its own press's entries, so answers and signals are the ones a
    batch-1 run gives, up to float summation order (``batch_entries=1``: one entry at a time)."""
    device = next(model.parameters()).device
    eos = eos_ids(model, tokenizer)
    head, tail = split_prompt(tokenizer, sample.context, sample.question)
    head_ids, tail_ids = encode(tokenizer, head, device), encode(tokenizer, tail, device)
    prompt = torch.cat([head_ids, tail_ids], 1) if question_aware else head_ids
    prefill = capture_prefill(model, prompt, hidden_states=any(
        e.press is not None and e.press.scorer.reads_hidden_states for e in entries))
    length = prefill.seq_len

    def answer(press, cache, logits=None, rows: int = 1) -> tuple[list[list[int]], list[float | None]]:
        """Greedy answer tokens of each of the cache's ``rows`` batch rows and the bytes each row's decode steps
        read, mean per step (:func:`_read_per_step`); the cache is left as it was."""
        copied = _decoding(press, cache)
        if copied:
            cache = copy.deepcopy(cache)
        if hasattr(cache, "count_reads"):
            cache.count_reads()  # from zero: this answer's decode steps
        with _routed(press, model):
            if question_aware:
                first = prefill.logits if logits is None else logits
                tokens, cache = decode_rows(model, first.expand(rows, -1), cache, max_new_tokens, eos)
            else:
                tokens, cache = continue_rows(model, tail_ids.expand(rows, -1), cache, max_new_tokens, eos)
        reads = _read_per_step(cache, rows)
        if not copied:
            _crop_to(cache, length)
        return tokens, reads

    full_cache = prefill.full_cache
    full_bytes = prefill.nbytes
    full_tokens = answer(None, full_cache)[0][0]
    first = [int(prefill.logits.argmax(-1))]
    continuation = (full_tokens or first) if question_aware else full_tokens
    forced = torch.tensor([continuation], device=device, dtype=torch.long)
    decode_from = 0 if question_aware else tail_ids.shape[1]  # the answer's tokens (decode steps) start here
    if not question_aware:
        forced = torch.cat([tail_ids, forced], 1)
    full_logits, full_hidden = _row(*_teacher_forced(model, None, full_cache, forced))
    full_text = tokenizer.decode(full_tokens, skip_special_tokens=True).strip()
    records = [Record(index, sample.task, "full", 0.0, full_text, score_sample(sample, full_text), full_bytes,
                      full_bytes, 0.0, 1.0, [0.0] * len(prefill.layers), [0.0] * len(prefill.layers), 0.0)]
    results: dict[int, Record] = {}
    entries_in_context = float(prefill.key_mask.sum()) * sum(c.keys.shape[1] for c in prefill.layers)

    def record(i: int, text: str, kv_bytes: int, logits, hidden, keep, kept: int, read: float | None) -> None:
        entry = entries[i]
        signal = fidelity(full_logits, logits, full_hidden, hidden)
        # eviction loss compares keep masks over the dense prefill: not defined for chunked prefill
        loss = eviction_loss(prefill, keep, window=window).tolist() if keep is not None else [float("nan")] * len(
            prefill.layers)
        results[i] = Record(index, sample.task, entry.label, entry.ratio, text, score_sample(sample, text),
                            kv_bytes, full_bytes, signal["kl"], signal["top1"], signal["hidden_error"], loss,
                            1.0 - kept / entries_in_context, read)
        if on_entry is not None:
            on_entry()

    batched = [i for i, e in enumerate(entries) if batch_entries > 1 and _batchable(e.press, length)]
    for group in _batches(entries, batched, batch_entries):
        presses = [entries[i].press for i in group]
        keeps = [prefill.keep_masks(p) for p in presses]
        cache = prefill.compressed_batch(presses, keeps)
        row_bytes = cache.batch_nbytes()
        # decode routing is the same for every press of the group: any of them routes the batch
        rows, reads = answer(presses[0], cache, rows=len(group))
        logits, hidden = _teacher_forced(model, presses[0], cache, forced.expand(len(group), -1), decode_from)
        for e, i in enumerate(group):
            text = tokenizer.decode(rows[e], skip_special_tokens=True).strip()
            row_logits, row_hidden = _row(logits, hidden, e)
            record(i, text, row_bytes[e], row_logits, row_hidden, keeps[e], sum(int(k.sum()) for k in keeps[e]),
                   reads[e])
        del cache, logits, hidden
    for i, entry in enumerate(entries):
        if i in results:
            continue
        keep: list[torch.Tensor] | None = None
        if entry.press is not None and Schedule(entry.press).chunked(length):
            # fan-out cannot derive it from the dense prefill: run the press on the prompt
            cache, next_logits = _chunked_prefill(model, entry.press, prompt)
        else:
            keep = prefill.keep_masks(entry.press)
            cache, next_logits = prefill.compressed_cache(entry.press, keep), None
        kv_bytes = cache.nbytes() if hasattr(cache, "nbytes") else full_bytes
        kept = (sum(int(k.sum()) for k in keep) if keep is not None
                else sum(int(cache.head_lengths(j).sum()) for j in range(len(prefill.layers))))
        tokens, reads = answer(entry.press, cache, next_logits)
        text = tokenizer.decode(tokens[0], skip_special_tokens=True).strip()
        logits, hidden = _row(*_teacher_forced(model, entry.press, cache, forced, decode_from))
        record(i, text, kv_bytes, logits, hidden, keep, kept, reads[0])
        del cache
    records += [results[i] for i in range(len(entries))]
    return records


def _read_per_step(cache, rows: int) -> list[float | None]:
    """Bytes of KV each of the cache's ``rows`` batch rows read per decode step since its counters were reset, as
    the cache measured them (:meth:`~kvpress_ada.hosts.transformers.ragged_cache.RaggedCache.bytes_read`); ``None``
    for a cache that counts no reads or when no decode step ran. A batch decodes until its last row is done: a row
    that finished earlier is counted over the batch's steps (its mean per step is what it read per step)."""
    per_row, steps = cache.bytes_read() if hasattr(cache, "bytes_read") else ([], 0)
    if not steps or len(per_row) != rows:
        return [None] * rows
    return [b / steps for b in per_row]


def _batches(entries: list[Entry], batched: list[int], size: int) -> list[list[int]]:
    """``batched`` (indices into ``entries``) in groups of at most ``size`` of one storage and one reader each (a
    batch cache holds one storage, settings included, and every row reads alike)."""
    by_storage: dict[str, list[int]] = {}
    for i in batched:
        press = entries[i].press
        assert press is not None
        reader = "" if press.reader is None else press.reader.model_dump_json()
        by_storage.setdefault(f"{press.storage.label}|{press.storage.model_dump_json()}|{reader}", []).append(i)
    return [members[s:s + size] for members in by_storage.values() for s in range(0, len(members), size)]


def _batchable(press: Pipeline | None, length: int) -> bool:
    """Whether the entry's cache can be a row of :meth:`Prefill.compressed_batch`."""
    return (press is not None and not press.is_noop and type(press.evictor) is TopK and not _decoding(press)
            and not Schedule(press).chunked(length) and not press.rewrites_kept)


@torch.inference_mode()
def _chunked_prefill(model, press: Pipeline, prompt: torch.Tensor):
    """The compressed cache and next-token logits ``[1, V]`` of a chunked-prefill press on ``prompt``."""
    with press(model):
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): None})
    return output_cache(out), out.logits[:, -1]


def evaluate(model, tokenizer, samples, entries: list[Entry], question_aware: bool = False, max_new_tokens: int = 16,
             progress: bool = True, skip=frozenset(), on_sample=None, batch_entries: int = ENTRY_BATCH) -> "EvalResult":
    """Fan-out evaluation of ``entries`` on ``samples`` (one prefill per sample; ``batch_entries``
    entries decoded together, see :func:`evaluate_sample`).

    ``skip``: indices of samples not to run (done by an earlier, resumed run); ``on_sample(i, records)``
    is called after each sample with its records (for checkpoints)."""
    start = time.perf_counter()
    records: list[Record] = []
    todo = [i for i in range(len(samples)) if i not in skip]
    per_sample = len(entries) + 1
    bar = tqdm(total=len(samples) * per_sample, initial=(len(samples) - len(todo)) * per_sample,
               disable=not progress, desc="evaluating", unit="run")
    try:
        for i in todo:
            new = evaluate_sample(model, tokenizer, samples[i], entries, i, question_aware, max_new_tokens,
                                  on_entry=bar.update, batch_entries=batch_entries)
            records += new
            bar.update(1)
            if on_sample is not None:
                on_sample(i, new)
    finally:  # an interrupt (Ctrl-C) must not leave a half-drawn bar over the caller's message
        bar.close()
    return EvalResult(records, time.perf_counter() - start, question_aware)


def evaluate_separately(model, tokenizer, samples, entries: list[Entry], question_aware: bool = False,
                        max_new_tokens: int = 16, progress: bool = True) -> list[list[str]]:
    """Answers with one full prefill per (sample, entry): the slow path fan-out must match."""
    answers = []
    bar = tqdm(total=len(samples) * len(entries), disable=not progress, desc="separate runs", unit="run")
    for sample in samples:
        row = []
        for entry in entries:
            answer = generate(model, tokenizer, sample.context, [sample.question], press=entry.press,
                              max_new_tokens=max_new_tokens, question_aware=question_aware)[0]
            assert isinstance(answer, str)  # one context: one answer per question
            row.append(answer)
            bar.update(1)
        answers.append(row)
    bar.close()
    return answers


@dataclass
class EvalResult:
    records: list[Record]
    seconds: float
    question_aware: bool

    def summary(self) -> list[dict]:
        """Per (label, ratio): accuracy with a 95% CI, fidelity, eviction loss, KV bytes, the fraction of
        entries evicted (``achieved_ratio``: what a threshold press reached; a fixed ratio's own), the KV bytes
        read per decode step (``read_bytes_per_step``; ``None`` where no record measured them)."""
        cells: dict[tuple[str, float], list[Record]] = {}
        for r in self.records:
            cells.setdefault((r.label, r.ratio), []).append(r)
        rows = []
        for (label, ratio), recs in cells.items():
            scores = [r.score for r in recs]
            n = len(scores)
            mean = sum(scores) / n
            var = sum((s - mean) ** 2 for s in scores) / max(n - 1, 1)
            n_layers = len(recs[0].eviction_loss)
            rows.append({
                "label": label, "ratio": ratio, "n": n, "accuracy": mean,
                "ci95": 1.96 * math.sqrt(var / n) if n > 1 else float("nan"),
                "kl": _mean([r.kl for r in recs]), "top1": _mean([r.top1 for r in recs]),
                "eviction_loss": _mean([_mean(r.eviction_loss) for r in recs]),
                "eviction_loss_per_layer": [_mean([r.eviction_loss[i] for r in recs]) for i in range(n_layers)],
                "hidden_error_per_layer": [_mean([r.hidden_error[i] for r in recs]) for i in range(n_layers)],
                "kv_bytes": _mean([r.kv_bytes for r in recs]),
                "kv_fraction": _mean([r.kv_bytes / r.full_kv_bytes for r in recs]),
                "achieved_ratio": _mean([r.achieved_ratio for r in recs]),
                "read_bytes_per_step": _mean([r.read_bytes_per_step for r in recs]),
            })
        return rows

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "question_aware": self.question_aware, "summary": self.summary(),
                "records": [asdict(r) for r in self.records]}


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
