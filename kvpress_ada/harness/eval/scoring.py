"""Scoring rules of RULER (Hsieh et al. 2024) and LongBench (Bai et al. 2023).

Every metric in :data:`METRICS` has the signature ``metric(pred, refs, **meta) -> float``
with a score in ``[0, 1]`` for one prediction against its list of references (multiply
by 100 for the papers' tables). LongBench metrics score each reference and keep the
best (``max`` over references), as LongBench's ``eval.py`` does.

RULER
    ``string_match_all``: fraction of the references found in the prediction
    (case-insensitive substring test); used by the NIAH variants, variable tracking,
    common/frequent-word extraction and all of our synthetic tasks.
    ``string_match_part``: 1 if any reference is found in the prediction, else 0; used by
    RULER's QA tasks (qa_1, qa_2).

LongBench (subset -> metric, as in LongBench's ``dataset2metric``)
    ``qa_f1``: narrativeqa, qasper, multifieldqa_en, hotpotqa, 2wikimqa, musique,
    triviaqa -- token F1 after SQuAD normalisation (lowercase, drop punctuation and the
    articles a/an/the, collapse whitespace).
    ``qa_f1_zh``: multifieldqa_zh -- F1 over Chinese characters (LongBench segments words
    with jieba; we use characters, so scores can differ slightly).
    ``rouge_l``: gov_report, qmsum, multi_news, samsum -- ROUGE-L F1 (beta = 1) of the
    longest common subsequence of whitespace tokens after lowercasing and dropping
    punctuation. LongBench calls the ``rouge`` package, whose tokenisation differs in
    details, so values are close to but not identical with published ones.
    ``rouge_l_zh``: dureader, vcsum -- the same over Chinese characters (approximate).
    ``classification``: trec, lsht -- with the row's ``all_classes``: the class names
    found in the prediction, dropping those that are strict substrings of the reference;
    score 1/len(found) if the reference is among them, else 0. Without ``all_classes`` it
    falls back to a substring match of the reference.
    ``retrieval``: passage_retrieval_en (reference "Paragraph N"); ``retrieval_zh``:
    passage_retrieval_zh (reference "段落N") -- the share of the numbers in the prediction
    that equal N.
    ``count``: passage_count -- the share of the numbers in the prediction that equal the
    reference.
    ``code_sim``: lcc, repobench-p -- edit similarity (``difflib`` ratio, LongBench uses
    fuzzywuzzy's) between the reference and the first prediction line that is not a
    comment or a code fence.
    For trec, triviaqa, samsum and lsht LongBench scores only the first line of the
    prediction (``FIRST_LINE_ONLY``); :func:`score` applies that when given the subset.

Generic
    ``exact_match``: 1 if the normalised prediction equals a normalised reference.
    ``substring_match``: 1 if a normalised reference occurs in the normalised prediction.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Any, Callable, Sequence

__all__ = [
    "METRICS", "LONGBENCH_METRICS", "FIRST_LINE_ONLY", "score", "score_sample",
    "string_match_all", "string_match_part", "normalize_answer", "qa_f1_score",
    "qa_f1", "qa_f1_zh", "rouge_l", "rouge_l_zh", "classification", "retrieval",
    "retrieval_zh", "count", "code_sim", "exact_match", "substring_match",
]


def _refs(refs: str | Sequence[str]) -> list[str]:
    return [refs] if isinstance(refs, str) else [str(r) for r in refs]


# ------------------------------------------------------------------------ RULER


def string_match_all(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """RULER: fraction of ``refs`` contained in ``pred`` (case-insensitive)."""
    refs = _refs(refs)
    if not refs:
        return 0.0
    p = pred.lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """RULER: 1 if any of ``refs`` is contained in ``pred`` (case-insensitive), else 0."""
    p = pred.lower()
    return float(any(r.lower() in p for r in _refs(refs)))


# -------------------------------------------------------------------- LongBench


_PUNCT = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD/LongBench normalisation: lowercase, no punctuation/articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_ZH_PUNCT = set("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』"
                "【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")


def _normalize_zh(s: str) -> str:
    return "".join(ch for ch in s.lower()
                   if ch not in _ZH_PUNCT and ch not in _PUNCT and not ch.isspace())


def _f1(pred_tokens: Sequence[str], ref_tokens: Sequence[str]) -> float:
    same = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(pred: str, ref: str) -> float:
    """LongBench/SQuAD token F1 of one prediction against one reference."""
    return _f1(normalize_answer(pred).split(), normalize_answer(ref).split())


def qa_f1(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """LongBench single/multi-doc QA: best token F1 over the references."""
    return max((qa_f1_score(pred, r) for r in _refs(refs)), default=0.0)


def qa_f1_zh(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """LongBench multifieldqa_zh: best character-level F1 (approximates jieba words)."""
    return max((_f1(list(_normalize_zh(pred)), list(_normalize_zh(r))) for r in _refs(refs)),
               default=0.0)


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _rouge_l_tokens(p: Sequence[str], r: Sequence[str]) -> float:
    if not p or not r:
        return 0.0
    lcs = _lcs(p, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


def rouge_l(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """LongBench summarisation: best ROUGE-L F1 over whitespace tokens (see module doc)."""
    def toks(s: str) -> list[str]:
        return "".join(" " if ch in _PUNCT else ch for ch in s.lower()).split()

    return max((_rouge_l_tokens(toks(pred), toks(r)) for r in _refs(refs)), default=0.0)


def rouge_l_zh(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """LongBench dureader/vcsum: best character-level ROUGE-L F1 (approximate)."""
    return max((_rouge_l_tokens(list(_normalize_zh(pred)), list(_normalize_zh(r)))
                for r in _refs(refs)), default=0.0)


def _classification_one(pred: str, ref: str, all_classes: Sequence[str] | None) -> float:
    if not all_classes:
        return float(ref in pred)
    found = [c for c in all_classes if c in pred]
    found = [c for c in found if not (c in ref and c != ref)]
    return 1.0 / len(found) if ref in found else 0.0


def classification(pred: str, refs: str | Sequence[str],
                   all_classes: Sequence[str] | None = None, **_: Any) -> float:
    """LongBench trec/lsht: class-name matching against ``all_classes`` (module doc)."""
    return max((_classification_one(pred, r, all_classes) for r in _refs(refs)), default=0.0)


def _number_share(pred: str, target: str) -> float:
    numbers = re.findall(r"\d+", pred)
    if not numbers:
        return 0.0
    return sum(n == str(target) for n in numbers) / len(numbers)


def _paragraph_share(pred: str, refs: str | Sequence[str], paragraph: str) -> float:
    """Best over the references that name a paragraph (``paragraph``: a regex whose group is its id) of the
    share of numbers in ``pred`` equal to that id."""
    best = 0.0
    for r in _refs(refs):
        ids = re.findall(paragraph, r)
        if ids:
            best = max(best, _number_share(pred, ids[0]))
    return best


def retrieval(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """LongBench passage_retrieval_en: share of numbers in ``pred`` equal to the
    paragraph id of the reference ("Paragraph N")."""
    return _paragraph_share(pred, refs, r"Paragraph (\d+)")


def retrieval_zh(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """LongBench passage_retrieval_zh: as :func:`retrieval` with "段落N" references."""
    return _paragraph_share(pred, refs, r"段落(\d+)")


def count(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """LongBench passage_count: share of numbers in ``pred`` equal to the reference."""
    return max((_number_share(pred, r.strip()) for r in _refs(refs)), default=0.0)


def code_sim(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """LongBench lcc/repobench-p: edit similarity of the first real code line."""
    line = ""
    for candidate in pred.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return max((difflib.SequenceMatcher(None, line, r).ratio() for r in _refs(refs)),
               default=0.0)


# ---------------------------------------------------------------------- generic


def exact_match(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """1 if the normalised prediction equals a normalised reference."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(r) for r in _refs(refs)))


def substring_match(pred: str, refs: str | Sequence[str], **_: Any) -> float:
    """1 if a normalised reference occurs in the normalised prediction."""
    p = normalize_answer(pred)
    return float(any(normalize_answer(r) in p for r in _refs(refs) if normalize_answer(r)))


Metric = Callable[..., float]

METRICS: dict[str, Metric] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_l_zh": rouge_l_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
    "exact_match": exact_match,
    "substring_match": substring_match,
}

LONGBENCH_METRICS: dict[str, str] = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh", "hotpotqa": "qa_f1", "2wikimqa": "qa_f1",
    "musique": "qa_f1", "dureader": "rouge_l_zh", "gov_report": "rouge_l",
    "qmsum": "rouge_l", "multi_news": "rouge_l", "vcsum": "rouge_l_zh",
    "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge_l",
    "lsht": "classification", "passage_retrieval_en": "retrieval", "passage_count": "count",
    "passage_retrieval_zh": "retrieval_zh", "lcc": "code_sim", "repobench-p": "code_sim",
}
"""LongBench subset -> metric name (LongBench-E subsets drop their ``_e`` suffix)."""

FIRST_LINE_ONLY = frozenset({"trec", "triviaqa", "samsum", "lsht"})
"""LongBench subsets whose predictions are cut to their first non-empty line."""


def score(metric: str, pred: str, refs: str | Sequence[str], *, subset: str | None = None,
          **meta: Any) -> float:
    """Score ``pred`` with the metric named ``metric`` (see :data:`METRICS`).

    ``subset`` (a LongBench subset name) applies LongBench's first-line rule; ``meta``
    goes to the metric (e.g. ``all_classes`` for ``classification``).
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid metrics: {', '.join(METRICS)}")
    if subset is not None and _base_subset(subset) in FIRST_LINE_ONLY:
        pred = pred.lstrip("\n").split("\n")[0]
    return METRICS[metric](pred, refs, **meta)


def _base_subset(name: str) -> str:
    return name[:-2] if name.endswith("_e") else name


def score_sample(sample: Any, pred: str) -> float:
    """Score ``pred`` for a :class:`~kvpress_ada.harness.eval.tasks.Sample` with its metric."""
    meta = dict(getattr(sample, "meta", {}) or {})
    subset = meta.get("subset") if meta.get("benchmark") == "longbench" else None
    extra = {"all_classes": meta["all_classes"]} if meta.get("all_classes") else {}
    return score(sample.metric, pred, sample.answers, subset=subset, **extra)
