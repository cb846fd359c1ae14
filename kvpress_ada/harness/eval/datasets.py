"""Loaders for the public RULER (Hsieh et al. 2024) and LongBench (Bai et al. 2023) data.

Both yield :class:`~kvpress_ada.harness.eval.tasks.Sample` objects, so the same evaluation loop
runs synthetic tasks (:mod:`kvpress_ada.harness.eval.tasks`) and published benchmarks.

LongBench
    Rows of ``THUDM/LongBench`` (the jsonl files of its ``data.zip``, one per subset):
    ``input`` (the question; empty for lcc and passage_count), ``context``, ``answers``,
    ``length``, ``dataset``, ``language``, ``all_classes``, ``_id``. The sample's context
    is a short task instruction followed by ``context``; its question is ``input`` wrapped
    in a short instruction (our own wording, in the spirit of LongBench's per-subset
    prompts; published numbers use LongBench's exact prompts). The metric comes from
    :data:`~kvpress_ada.harness.eval.scoring.LONGBENCH_METRICS`; ``meta`` keeps ``subset``,
    ``all_classes``, ``length``, ``_id`` and ``language``.

RULER
    Rows written by RULER's ``prepare.py``: ``index``, ``input`` (the task template with
    the context and query filled in, wrapped in the chosen model template), ``outputs``
    (the references), ``length``, and in recent versions ``answer_prefix`` and
    ``token_position_answer``. ``input`` is split before the question of the RULER
    template (NIAH "What is/are all the special magic ...", variable tracking / common
    words / frequent words "Question: ...", QA's closing instruction + "Question:"), so
    the instruction and the long text form the context. When no known question is found
    (custom templates), the whole ``input`` is the context and the question is empty.
    Prepare data with ``--model_template_type base`` so that the chat template can be
    applied afterwards; otherwise the model template's closing tokens stay in the
    question. Rows with ``context``/``question``/``answer`` columns (RULER as re-published
    on the hub, e.g. by NVIDIA kvpress) are accepted as they are. Metric: RULER's
    ``string_match_part`` for the QA tasks, ``string_match_all`` for the others.

Sources are local jsonl files (or a directory holding them), or hub datasets loaded
through ``datasets.load_dataset`` (imported only then: ``pip install datasets``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from kvpress_ada.harness.eval.scoring import LONGBENCH_METRICS
from kvpress_ada.harness.eval.tasks import Sample

__all__ = ["load_longbench", "load_ruler", "read_jsonl", "split_ruler_input",
           "LONGBENCH_SUBSETS", "RULER_TASKS"]

LONGBENCH_SUBSETS = tuple(LONGBENCH_METRICS)

RULER_TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
    "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1",
    "qa_2",
)


# ------------------------------------------------------------------------ io


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Rows of a jsonl file (blank lines skipped); errors name the file and line."""
    path = Path(path)
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line")
            yield row


def _load_hub(name: str, config: str | None, split: str,
              hint: str = "") -> Iterable[Mapping[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{name!r} is not a local file, and loading it from the Hugging Face hub needs "
            "the `datasets` package: `pip install datasets`, or download the jsonl file "
            "and pass its path.") from None
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        raise RuntimeError(
            f"Could not load {name!r} (config {config!r}, split {split!r}) from the hub "
            f"({type(exc).__name__}: {exc}). Download the data as jsonl and pass the path "
            f"of the file instead.{hint}") from exc


def _require(row: Mapping[str, Any], fields: Iterable[str], where: str) -> None:
    missing = [f for f in fields if f not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)} "
                         f"(row has {', '.join(sorted(row)) or 'no fields'})")


def _take(rows: Iterable[Mapping[str, Any]], limit: int | None) -> Iterator[Mapping]:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got limit={limit}")
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            return
        yield row


# ------------------------------------------------------------------ LongBench

_QA_EN = ("Answer the question based on the text above. Answer as concisely as possible, "
          "with a short phrase if you can, and give no explanation.\n\nQuestion: {input}\n"
          "Answer:")
_QA_ZH = "请根据上面的文字回答问题，只给出答案，不要解释。\n\n问题：{input}\n回答："

# subset -> (context instruction, question template); {input} is the row's input
_LONGBENCH_PROMPTS: dict[str, tuple[str, str]] = {
    "narrativeqa": ("Read the story below (a novel or a film script); a question about it "
                    "follows.\n\n", _QA_EN),
    "qasper": ("Read the scientific article below; a question about it follows.\n\n",
               "Answer the question based on the article above, as concisely as possible. "
               "If it cannot be answered from the article, write \"unanswerable\"; if it is "
               "a yes/no question, answer \"yes\", \"no\" or \"unanswerable\".\n\n"
               "Question: {input}\nAnswer:"),
    "multifieldqa_en": ("Read the text below; a question about it follows.\n\n", _QA_EN),
    "multifieldqa_zh": ("阅读下面的文字，之后回答一个问题。\n\n", _QA_ZH),
    "hotpotqa": ("Read the passages below; a question about them follows.\n\n", _QA_EN),
    "2wikimqa": ("Read the passages below; a question about them follows.\n\n", _QA_EN),
    "musique": ("Read the passages below; a question about them follows.\n\n", _QA_EN),
    "dureader": ("阅读下面的文章，之后回答一个问题。\n\n", _QA_ZH),
    "gov_report": ("Read the government report below; you will be asked to summarise "
                   "it.\n\n", "Write a one-page summary of the report above.\n\nSummary:"),
    "qmsum": ("Read the meeting transcript below; a query about it follows.\n\n",
              "Answer the query about the transcript above in one or more sentences.\n\n"
              "Query: {input}\nAnswer:"),
    "multi_news": ("Read the news articles below; you will be asked to summarise them.\n\n",
                   "Write a one-page summary of all the news above.\n\nSummary:"),
    "vcsum": ("阅读下面的会议记录，之后需要总结。\n\n", "请用中文写一段上面会议记录的总结。\n\n总结："),
    "trec": ("Classify each question by the type of its answer. Examples:\n\n",
             "Classify this question the same way.\n\n{input}"),
    "triviaqa": ("Answer each question based on its passage. Examples:\n\n",
                 "Answer this one the same way.\n\n{input}"),
    "samsum": ("Summarise each dialogue. Examples:\n\n",
               "Summarise this dialogue the same way.\n\n{input}"),
    "lsht": ("请判断每条新闻的类别。示例如下：\n\n", "请用同样的方式判断这条新闻的类别。\n\n{input}"),
    "passage_count": ("Below are several paragraphs, some of which may be duplicates.\n\n",
                      "How many different paragraphs are there above, counting duplicates "
                      "once? Answer with one number only.\n\nThe answer is:"),
    "passage_retrieval_en": ("Below are several paragraphs, each with its number.\n\n",
                             "Which paragraph above does this summary describe? Answer in "
                             "the form \"Paragraph N\" only.\n\nSummary: {input}\n\n"
                             "The answer is:"),
    "passage_retrieval_zh": ("以下是若干段落，每段都有编号。\n\n",
                             "下面的摘要出自上面的哪一段？请只用\"段落N\"的格式回答。\n\n摘要："
                             "{input}\n\n答案是："),
    "lcc": ("Complete the code below.\n\n", "{input}Next line of code:\n"),
    "repobench-p": ("Complete the code below.\n\n", "{input}Next line of code:\n"),
}


def _longbench_sample(row: Mapping[str, Any], where: str, subset: str | None) -> Sample:
    _require(row, ("context", "input", "answers"), where)
    name = str(row.get("dataset") or subset or "")
    base = name[:-2] if name.endswith("_e") else name
    if base not in LONGBENCH_METRICS:
        raise ValueError(f"{where}: unknown LongBench subset {name!r}; known subsets: "
                         f"{', '.join(LONGBENCH_SUBSETS)} (and their '_e' versions)")
    answers = row["answers"]
    answers = [answers] if isinstance(answers, str) else [str(a) for a in answers]
    preface, question = _LONGBENCH_PROMPTS[base]
    meta = {"benchmark": "longbench", "subset": name,
            "all_classes": list(row.get("all_classes") or []) or None,
            "length": row.get("length"), "_id": row.get("_id"),
            "language": row.get("language")}
    return Sample(context=preface + str(row["context"]),
                  question=question.format(input=str(row["input"] or "")),
                  answers=answers, task=f"longbench/{name}",
                  metric=LONGBENCH_METRICS[base], meta=meta)


def load_longbench(source: str | os.PathLike, *, split: str = "test", limit: int | None = None,
                   hub_id: str = "THUDM/LongBench") -> list[Sample]:
    """LongBench samples from a local jsonl file, or a subset name from the hub.

    ``source`` is a path to a LongBench jsonl file (e.g. ``data/hotpotqa.jsonl`` from the
    dataset's ``data.zip``; the subset comes from each row's ``dataset`` field, else the
    file name), or a subset name such as ``"hotpotqa"`` loaded with
    ``datasets.load_dataset(hub_id, name, split=split)``. ``limit`` keeps the first rows.
    """
    path = Path(source)
    if path.is_file():
        stem = path.stem
        return [_longbench_sample(row, f"{path}:row {i}", stem)
                for i, row in enumerate(_take(read_jsonl(path), limit))]
    name = str(source)
    if os.sep in name or name.endswith(".jsonl"):
        raise FileNotFoundError(f"LongBench file {name!r} does not exist")
    base = name[:-2] if name.endswith("_e") else name
    if base not in LONGBENCH_METRICS:
        raise ValueError(f"unknown LongBench subset {name!r}; known subsets: "
                         f"{', '.join(LONGBENCH_SUBSETS)} (and their '_e' versions), or "
                         "pass the path of a jsonl file")
    rows = _load_hub(hub_id, name, split, hint=(
        " THUDM/LongBench is published as data.zip with a loading script that recent "
        "`datasets` releases no longer run: fetch data.zip (e.g. huggingface_hub."
        "hf_hub_download('THUDM/LongBench', 'data.zip', repo_type='dataset')), unzip it "
        f"and pass data/{name}.jsonl."))
    return [_longbench_sample(row, f"{hub_id}/{name}:row {i}", name)
            for i, row in enumerate(_take(rows, limit))]


# ---------------------------------------------------------------------- RULER

# Where the question of each RULER task template starts (the last match wins).
_RULER_QUESTION = {
    "niah": re.compile(r"\s+(?=What (?:is|are all) the special magic )"),
    "vt": re.compile(r"\s+(?=Question: Find all variables that are assigned the value)"),
    "cwe": re.compile(r"\s+(?=Question: What are the \d+ most common words)"),
    "fwe": re.compile(r"\s+(?=Question: Do not provide any explanation\. Please ignore the "
                      r"dots)"),
    "qa": re.compile(r"\s+(?=Answer the question based on the given documents\. Only give "
                     r"me the answer and do not output any other words\.\s+Question:)"),
}


def split_ruler_input(text: str) -> tuple[str, str, str | None]:
    """Split a RULER ``input`` into ``(context, question, task family)``.

    The question starts at the last match of a known RULER question (see the module
    docstring). Without a match, returns ``(text, "", None)``.
    """
    best: tuple[int, int, str] | None = None
    for family, pattern in _RULER_QUESTION.items():
        for m in pattern.finditer(text):
            if best is None or m.start() > best[0]:
                best = (m.start(), m.end(), family)
    if best is None:
        return text, "", None
    start, end, family = best
    return text[:start], text[end:], family


def _ruler_task_from_path(path: Path) -> str | None:
    for candidate in (path.parent.name, path.stem):
        if candidate in RULER_TASKS or re.match(r"(niah|vt|cwe|fwe|qa)", candidate):
            return candidate
    return None


def _ruler_metric(task: str) -> str:
    return "string_match_part" if task.startswith("qa") else "string_match_all"


def _ruler_sample(row: Mapping[str, Any], where: str, task: str | None,
                  answer_prefix: bool) -> Sample:
    if "input" in row:
        _require(row, ("input", "outputs"), where)
        context, question, family = split_ruler_input(str(row["input"]))
        refs = row["outputs"]
    else:  # re-published form with context/question columns
        _require(row, ("context", "question"), where)
        if "answer" not in row and "answers" not in row and "outputs" not in row:
            raise ValueError(f"{where}: missing field answer/answers/outputs")
        context, question = str(row["context"]), str(row["question"])
        family = None
        refs = row.get("answer", row.get("answers", row.get("outputs")))
        task = task or row.get("task")
    if answer_prefix and row.get("answer_prefix"):
        question = question + str(row["answer_prefix"])
    refs = [refs] if isinstance(refs, str) else [str(r) for r in refs]
    name = task or family or "unknown"
    meta = {"benchmark": "ruler", "index": row.get("index"), "length": row.get("length"),
            "answer_prefix": row.get("answer_prefix"),
            "max_new_tokens": row.get("max_new_tokens")}
    return Sample(context=context, question=question, answers=refs, task=f"ruler/{name}",
                  metric=_ruler_metric(name), meta=meta)


def load_ruler(source: str | os.PathLike, *, task: str | None = None,
               split: str = "validation", limit: int | None = None,
               config: str | None = None, answer_prefix: bool = False) -> list[Sample]:
    """RULER samples from a jsonl file made by RULER's ``prepare.py``, or from the hub.

    ``source`` is a jsonl file, a directory holding ``{split}.jsonl`` (RULER writes
    ``<save_dir>/<task>/validation.jsonl``), or a hub dataset id loaded with
    ``datasets.load_dataset(source, config, split=split)``. The task name (for the metric
    and ``Sample.task``) is ``task``, else the RULER directory name, else the template
    family found in ``input``. ``answer_prefix=True`` appends the row's RULER answer
    prefix (e.g. " The special magic number for X mentioned in the provided text is") to
    the question.
    """
    path = Path(source)
    if path.is_dir():
        path = path / f"{split}.jsonl"
    if path.is_file():
        task = task or _ruler_task_from_path(path)
        return [_ruler_sample(row, f"{path}:row {i}", task, answer_prefix)
                for i, row in enumerate(_take(read_jsonl(path), limit))]
    name = str(source)
    if name.endswith(".jsonl") or Path(name).is_absolute() or name.startswith("."):
        raise FileNotFoundError(f"RULER file {str(path)!r} does not exist")
    rows = _load_hub(name, config, split)
    return [_ruler_sample(row, f"{name}:row {i}", task, answer_prefix)
            for i, row in enumerate(_take(rows, limit))]
