"""Seeded synthetic long-context tasks in the style of RULER (Hsieh et al. 2024).

Needles (pass keys, "special magic numbers", variable-assignment chains) are hidden in
a haystack of real English text: the prose of the Python reference manual that every
Python ships (``pydoc_data.topics``). The haystack is cut so that each context is
``context_tokens`` tokens long *for the given tokenizer* (never longer, at most a few
tokens shorter), and needles go in at sentence boundaries at seeded depths.

Tasks (see :data:`TASKS`):

* ``passkey`` -- one needle "The pass key is 71432. Remember it."; asks for the key.
* ``multikey`` -- needles "One of the special magic numbers for {key} is: {value}." for
  several keys; asks for one key (the others are distractors). RULER niah_multikey.
* ``multivalue`` -- one key with several values; asks for all. RULER niah_multivalue.
* ``multiquery`` -- several keys asked at once; asks for all. RULER niah_multiquery.
* ``vartrack`` -- chains "VAR ABCDE = 12345." ... "VAR FGHIJ = VAR ABCDE."; asks for all
  variables holding the value, with a distractor chain of another value. RULER vt.
* ``cwe`` -- a numbered list of (manual) words where a few appear many times; asks for
  the most frequent ones. RULER cwe. Its context is the list, not prose.

Each :class:`Sample` splits the prompt into ``context`` (a one-line instruction followed
by the long text, as in RULER's templates) and ``question`` (short and direct, placed
after the context), so a KV-cache press can compress the context before it sees the
question. Samples are deterministic given (task, seed, index) and the Python version
(the manual's text changes between Python releases); ``make_samples(n=5)`` is a prefix
of ``make_samples(n=10)`` for the same seed.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Sample", "TaskSpec", "TASKS", "ContextTooSmall", "make_samples",
           "haystack_sentences", "count_tokens"]


@dataclass(frozen=True)
class Sample:
    """One evaluation example.

    ``answers`` are the reference strings scored by ``metric`` (a name in
    :data:`kvpress_ada.harness.eval.scoring.METRICS`); ``meta`` holds extras a metric may need
    (e.g. LongBench's ``all_classes``) and provenance, and is ignored by ``==``.
    """

    context: str
    question: str
    answers: list[str]
    task: str
    metric: str
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


Builder = Callable[[Any, random.Random, int], tuple[str, str, list[str], dict]]


@dataclass(frozen=True)
class TaskSpec:
    """A synthetic task: its metric, a one-line description (listed by ``kvpress-ada eval
    --help``) and its builder.

    ``build(tokenizer, rng, context_tokens)`` returns ``(context, question, answers,
    meta)``; it raises :class:`ContextTooSmall` when ``context_tokens`` cannot hold the task.
    """

    name: str
    metric: str
    description: str
    build: Builder


# ------------------------------------------------------------------- tokenizer


def count_tokens(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    """Token counts of ``texts`` without special tokens, for any tokenizer.

    Accepts Hugging Face tokenizers (``tokenizer(texts, add_special_tokens=False)``), raw
    ``tokenizers.Tokenizer`` objects and anything with ``encode(text)``.
    """
    texts = list(texts)
    if not texts:
        return []
    if hasattr(tokenizer, "encode_batch") and not hasattr(tokenizer, "pad_token"):
        return [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    if callable(tokenizer):
        try:
            ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
            return [len(x) for x in ids]
        except TypeError:
            pass
    out = []
    for t in texts:
        enc = tokenizer.encode(t, add_special_tokens=False)
        out.append(len(getattr(enc, "ids", enc)))
    return out


def _count(tokenizer: Any, text: str) -> int:
    return count_tokens(tokenizer, [text])[0]


# -------------------------------------------------------------------- haystack


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple[tuple[str, ...], str]:
    """Prose sentences of the Python reference manual, and the whole manual's text."""
    from pydoc_data.topics import topics

    sentences: list[str] = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            lines = block.split("\n")
            # keep plain paragraphs: no code (indented), no headings (underlined)
            if any(line[:1].isspace() for line in lines):
                continue
            if len(lines) >= 2 and set(lines[-1].strip()) <= set("*=-^~"):
                continue
            if any(line.startswith(("+", "|")) or "---" in line or "===" in line
                   for line in lines):  # tables
                continue
            para = " ".join(line.strip() for line in lines)
            for sent in re.split(r"(?<=[.!?])\s+(?=[A-Z\"(])", para):
                sent = sent.strip()
                words = sent.split()
                if len(words) >= 4 and sent[-1] in ".!?" and max(map(len, words)) <= 40:
                    sentences.append(sent)
    whole = "\n".join(topics[k] for k in sorted(topics))
    return tuple(sentences), whole


def haystack_sentences() -> tuple[str, ...]:
    """The haystack: ~2,000 prose sentences (~50k tokens) of the Python manual."""
    return _corpus()[0]


def _in_corpus(s: str) -> bool:
    return s in _corpus()[1]


@functools.lru_cache(maxsize=1)
def _manual_words() -> tuple[str, ...]:
    """Distinct lowercase words (4-10 letters) of the manual's prose, sorted."""
    words: set[str] = set()
    for sent in haystack_sentences():
        words.update(w for w in re.findall(r"[A-Za-z]+", sent) if w.islower())
    return tuple(sorted(w for w in words if 4 <= len(w) <= 10))


class ContextTooSmall(ValueError):
    """``context_tokens`` cannot hold a task; ``minimum`` is a size that fits (almost) every seed."""

    def __init__(self, task: str, context_tokens: int, needed: int):
        # needles differ between samples: suggest a size that fits (almost) every seed
        self.task, self.context_tokens, self.minimum = task, context_tokens, -(-needed * 5 // 4) + 8
        super().__init__(
            f"context_tokens={context_tokens} is too small for task {task!r}: its instruction "
            f"and needles alone take about {needed} tokens with this tokenizer; use "
            f"context_tokens >= {self.minimum}")


_MIN_HAYSTACK_TOKENS = 32


def _haystack_context(task: str, tokenizer: Any, rng: random.Random, context_tokens: int,
                      preface: str, needles: Sequence[str], depths: Sequence[float]) -> str:
    """``preface`` + haystack with ``needles`` at ``depths`` (fractions in [0, 1]),
    cut to at most ``context_tokens`` tokens and filled to within a word of it."""
    sents = haystack_sentences()
    fixed = _count(tokenizer, preface + " ".join(needles))
    needed = fixed + _MIN_HAYSTACK_TOKENS
    if context_tokens < needed:
        raise ContextTooSmall(task, context_tokens, needed)
    start = rng.randrange(len(sents))

    def hay(i: int) -> str:
        return sents[(start + i) % len(sents)]

    # Upper bound on the number of whole sentences from per-sentence counts.
    budget, hi, used = context_tokens - fixed, 0, 0
    chunk = 64
    while used <= budget:
        counts = count_tokens(tokenizer, [hay(hi + j) for j in range(chunk)])
        for c in counts:
            used += c + 1
            hi += 1
            if used > budget:
                break
    hi += 1

    def assemble(k: int, tail: str = "") -> str:
        units = [hay(i) for i in range(k)]
        # insert deepest first so earlier insertion points stay valid
        for needle, depth in sorted(zip(needles, depths), key=lambda nd: -nd[1]):
            units.insert(round(depth * k), needle)
        if tail:
            units.append(tail)
        return preface + " ".join(units)

    lo = 0  # invariant: assemble(lo) fits (checked above through `needed`)
    while _count(tokenizer, assemble(hi)) <= context_tokens:  # estimate was short
        lo, hi = hi, hi + max(1, hi // 4)
    lo = _largest(lo, hi, lambda k: _count(tokenizer, assemble(k)) <= context_tokens)
    words = hay(lo).split(" ")
    w = _largest(0, len(words), lambda m: _count(tokenizer, assemble(lo, " ".join(words[:m]))) <= context_tokens)
    return assemble(lo, " ".join(words[:w]))


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The largest ``m`` in ``[lo, hi]`` with ``fits(m)`` (binary search; ``fits`` monotone and true at ``lo``)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------- needle values

_ADJECTIVES = (
    "amber", "ancient", "brave", "bright", "calm", "candid", "clever", "cosmic", "crimson",
    "curious", "daring", "dusty", "eager", "elegant", "fancy", "fierce", "frosty", "gentle",
    "gilded", "glossy", "golden", "graceful", "hollow", "humble", "icy", "jolly", "lively",
    "lucky", "lunar", "mellow", "misty", "noble", "olive", "patient", "polite", "quiet",
    "rapid", "rustic", "scarlet", "silent", "silver", "sleepy", "smoky", "snowy", "solar",
    "stormy", "sunny", "tidy", "velvet", "witty",
)
_NOUNS = (
    "anchor", "badger", "balloon", "beacon", "canyon", "castle", "cello", "comet", "cottage",
    "dolphin", "falcon", "fern", "garden", "glacier", "harbor", "harp", "island", "jaguar",
    "kettle", "lantern", "lemon", "lighthouse", "maple", "meadow", "mirror", "orchard",
    "otter", "panda", "parrot", "pebble", "piano", "pillow", "quartz", "rabbit", "river",
    "saddle", "salmon", "squirrel", "teapot", "thistle", "tiger", "trumpet", "tulip",
    "valley", "violin", "walnut", "whistle", "willow", "window", "zebra",
)


def _number(rng: random.Random, digits: int, taken: set[str]) -> str:
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if v not in taken and not _in_corpus(v):
            taken.add(v)
            return v


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample(range(len(_ADJECTIVES) * len(_NOUNS)), n)
    return [f"{_ADJECTIVES[p // len(_NOUNS)]}-{_NOUNS[p % len(_NOUNS)]}" for p in pairs]


def _varnames(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in names and not _in_corpus(v):
            names.append(v)
    return names


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


_MAGIC = "One of the special magic numbers for {key} is: {value}."
_MAGIC_PREFACE = ("Some special magic numbers are hidden within the following text. Make "
                  "sure to memorize them. I will quiz you about {what} afterwards.\n\n")


def _magic_context(task: str, tok, rng: random.Random, n_tokens: int, keys: Sequence[str], values: Sequence[str],
                   what: str) -> str:
    """The haystack with one magic-number needle per ``(key, value)`` pair, each at a seeded depth."""
    needles = [_MAGIC.format(key=k, value=v) for k, v in zip(keys, values)]
    depths = [rng.random() for _ in needles]
    return _haystack_context(task, tok, rng, n_tokens, _MAGIC_PREFACE.format(what=what), needles, depths)


# ----------------------------------------------------------------------- tasks


def _passkey(tok, rng, n_tokens):
    key = _number(rng, 5, set())
    preface = ("There is a pass key hidden inside the following text. Find it and memorize "
               "it. I will ask you about it afterwards.\n\n")
    needle = f"The pass key is {key}. Remember it."
    ctx = _haystack_context("passkey", tok, rng, n_tokens, preface, [needle], [rng.random()])
    return ctx, "What is the pass key? Answer with the number only.", [key], {}


def _multikey(tok, rng, n_tokens, num_keys: int = 4):
    taken: set[str] = set()
    keys = _keys(rng, num_keys)
    values = [_number(rng, 7, taken) for _ in keys]
    ctx = _magic_context("multikey", tok, rng, n_tokens, keys, values, "one of them")
    q = f"What is the special magic number for {keys[0]}? Answer with the number only."
    return ctx, q, [values[0]], {"distractors": values[1:]}


def _multivalue(tok, rng, n_tokens, num_values: int = 4):
    taken: set[str] = set()
    keys = _keys(rng, 1)
    values = [_number(rng, 7, taken) for _ in range(num_values)]
    ctx = _magic_context("multivalue", tok, rng, n_tokens, keys * num_values, values, "them")
    q = (f"What are all the special magic numbers for {keys[0]}? Answer with the numbers "
         "only, separated by commas.")
    return ctx, q, values, {}


def _multiquery(tok, rng, n_tokens, num_keys: int = 4):
    taken: set[str] = set()
    keys = _keys(rng, num_keys)
    values = [_number(rng, 7, taken) for _ in keys]
    ctx = _magic_context("multiquery", tok, rng, n_tokens, keys, values, "them")
    q = (f"What are the special magic numbers for {_join(keys)}? Answer with the numbers "
         "only, separated by commas.")
    return ctx, q, values, {}


def _vartrack(tok, rng, n_tokens, num_chains: int = 2, num_hops: int = 4):
    taken: set[str] = set()
    names = _varnames(rng, num_chains * (num_hops + 1))
    needles: list[str] = []
    depths: list[float] = []
    values = []
    for c in range(num_chains):
        chain = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        value = _number(rng, 5, taken)
        values.append(value)
        needles.append(f"VAR {chain[0]} = {value}.")
        needles += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        depths += sorted(rng.random() for _ in chain)  # assignments in chain order
    preface = ("Memorize and track the chains of variable assignments hidden in the "
               "following text.\n\n")
    ctx = _haystack_context("vartrack", tok, rng, n_tokens, preface, needles, depths)
    q = (f"Which variables are assigned the value {values[0]}, directly or through other "
         "variables? Answer with the variable names only, separated by commas.")
    answers = names[:num_hops + 1]
    return ctx, q, answers, {"distractors": names[num_hops + 1:]}


_CWE_PREFACE = ("Below is a numbered list of words. Some words appear much more often than "
                "others. Memorize the ones that appear most often.\n\n")
_CWE_QUESTION = ("What are the {k} most common words in the list above? Answer with the "
                 "words only, separated by commas.")


def _cwe(tok, rng, n_tokens, num_common: int = 3, freq_uncommon: int = 2):
    prompt = (_CWE_PREFACE + _CWE_QUESTION).lower()
    pool = [w for w in _manual_words() if w not in prompt]  # no answer in the question
    common: list[str] = []
    others: list[str] = []
    for i in rng.sample(range(len(pool)), len(pool)):
        w = pool[i]  # no listed word may contain a common word (substring scoring)
        if len(common) < num_common:
            if not any(c in w or w in c for c in common):
                common.append(w)
        elif not any(c in w for c in common):
            others.append(w)
    preface = _CWE_PREFACE
    per_entry = max(1.0, _count(tok, "\n".join(f"{i + 101}. {w}" for i, w in
                                              enumerate(others[:50]))) / 50)
    capacity = max(0, int((n_tokens - _count(tok, preface)) / per_entry))
    # long lists repeat the uncommon words more often rather than run out of words
    freq_uncommon = max(freq_uncommon, -(-capacity // max(1, len(others) - 64)))
    freq_common = max(3 * freq_uncommon, capacity // 30)
    shuffle_seed = rng.random()

    def assemble(m: int, singles: Sequence[str] = ()) -> str:
        entries = common * freq_common + others[:m] * freq_uncommon + list(singles)
        random.Random(shuffle_seed).shuffle(entries)
        return preface + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(entries))

    needed = _count(tok, assemble(num_common))
    if needed > n_tokens:
        raise ContextTooSmall("cwe", n_tokens, needed)
    lo = _largest(num_common, min(len(others) - 64, capacity + 1), lambda m: _count(tok, assemble(m)) <= n_tokens)
    singles: list[str] = []  # fill the last few tokens with words listed once
    for w in others[lo:lo + 16]:
        if _count(tok, assemble(lo, singles + [w])) <= n_tokens:
            singles.append(w)
    q = _CWE_QUESTION.format(k=num_common)
    return assemble(lo, singles), q, list(common), {
        "distractors": others[:lo] + singles, "freq_common": freq_common}


TASKS: dict[str, TaskSpec] = {
    spec.name: spec for spec in (
        TaskSpec("passkey", "string_match_all", "single pass key in real text", _passkey),
        TaskSpec("multikey", "string_match_all",
                 "one of several keyed magic numbers (others are distractors)", _multikey),
        TaskSpec("multivalue", "string_match_all", "all magic numbers of one key",
                 _multivalue),
        TaskSpec("multiquery", "string_match_all", "the magic numbers of several keys",
                 _multiquery),
        TaskSpec("vartrack", "string_match_all",
                 "variables bound to a value through assignment chains", _vartrack),
        TaskSpec("cwe", "string_match_all", "most common words of a numbered word list",
                 _cwe),
    )
}


def make_samples(task: str, tokenizer: Any, n: int, context_tokens: int,
                 seed: int = 0) -> list[Sample]:
    """``n`` seeded samples of ``task`` whose contexts are ``context_tokens`` long.

    The length is measured with ``tokenizer`` on the context alone (no special tokens,
    no question, no chat template): never more than ``context_tokens``, and short of it
    by at most about one word. Sample ``i`` depends only on ``(task, seed, i)``.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got n={n!r}")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) \
            or context_tokens < 1:
        raise ValueError(f"context_tokens must be a positive integer, got "
                         f"context_tokens={context_tokens!r}")
    spec = TASKS[task]
    samples = []
    for i in range(n):
        rng = random.Random(f"kvpress_ada:{task}:{seed}:{i}")
        context, question, answers, meta = spec.build(tokenizer, rng, context_tokens)
        meta = {"seed": seed, "index": i, "context_tokens": context_tokens, **meta}
        samples.append(Sample(context, question, list(answers), task, spec.metric, meta))
    return samples
