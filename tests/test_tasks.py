"""kvpress_ada.harness.eval: synthetic tasks, scoring rules, RULER/LongBench loaders.

Runs offline with a small BPE tokenizer trained here on the Python manual; the SmolLM2
tokenizer is used too when the default model is already converted in the cache.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpress_ada.harness.eval import (
    TASKS,
    ContextTooSmall,
    Sample,
    load_longbench,
    load_ruler,
    make_samples,
    score,
    score_sample,
    scoring,
    split_ruler_input,
    string_match_all,
    string_match_part,
)
from kvpress_ada.harness.eval.tasks import count_tokens, haystack_sentences

FIXTURES = Path(__file__).parent / "fixtures"
HYPO = settings(max_examples=8, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _train_bpe(vocab_size: int = 600):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(haystack_sentences()[:400], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


TOKENIZER = _train_bpe()


def _ntok(text: str, tok=TOKENIZER) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _min_tokens(task: str) -> int:
    """Smallest context the task accepts with TOKENIZER (read from its error)."""
    with pytest.raises(ValueError) as ei:
        make_samples(task, TOKENIZER, 1, 8)
    return int(re.search(r">= (\d+)", str(ei.value)).group(1))


# --------------------------------------------------------------- validation


def test_unknown_task_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown task 'nope'") as ei:
        make_samples("nope", TOKENIZER, 1, 256)
    for name in ("passkey", "multikey", "multivalue", "multiquery", "vartrack", "cwe"):
        assert name in str(ei.value)
    assert set(TASKS) == {"passkey", "multikey", "multivalue", "multiquery", "vartrack",
                          "cwe"}


@pytest.mark.parametrize("n", [0, -3, 1.5, True])
def test_bad_n(n):
    with pytest.raises(ValueError, match="n="):
        make_samples("passkey", TOKENIZER, n, 256)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_context_too_small(task):
    with pytest.raises(ContextTooSmall, match="context_tokens=16") as ei:
        make_samples(task, TOKENIZER, 1, 16)
    assert (ei.value.task, ei.value.context_tokens) == (task, 16)
    assert len(make_samples(task, TOKENIZER, 2, ei.value.minimum)) == 2  # the suggested size fits
    with pytest.raises(ValueError, match="context_tokens=0"):
        make_samples(task, TOKENIZER, 1, 0)


# ------------------------------------------------------------ task properties


_LONGEST_WORD = max(_ntok(w) for w in {w for s in haystack_sentences() for w in s.split(" ")})


def _check_sample(s: Sample, task: str, target: int, tok=TOKENIZER, tol: float = 0.03):
    assert s.task == task and s.metric == TASKS[task].metric
    n = _ntok(s.context, tok)
    # the contract: at most `target` tokens, filled to within one haystack word of it
    slack = max(tol * target, _LONGEST_WORD if tok is TOKENIZER else 0) + 2
    assert target - slack <= n <= target, (n, target, slack)
    assert s.answers and len(set(s.answers)) == len(s.answers)
    for a in s.answers:
        assert a in s.context
        assert a not in s.question  # the question never gives the answer away
    distractors = s.meta.get("distractors", [])
    assert not set(distractors) & set(s.answers)
    for d in distractors:
        assert d in s.context
    assert score_sample(s, ", ".join(s.answers)) == 1.0
    assert score_sample(s, "I do not know.") == 0.0
    if distractors:
        assert score_sample(s, ", ".join(distractors)) < 1.0


@pytest.mark.parametrize("task", sorted(TASKS))
@HYPO
@given(seed=st.integers(0, 10_000), extra=st.integers(0, 400))
def test_task_properties(task, seed, extra):
    target = _min_tokens(task) + extra
    first = make_samples(task, TOKENIZER, 2, target, seed=seed)
    again = make_samples(task, TOKENIZER, 2, target, seed=seed)
    assert first == again  # deterministic
    assert first[0].context != first[1].context  # samples differ within a seed
    for s in first:
        _check_sample(s, task, target)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_seeds_differ_and_prefix_stable(task):
    a = make_samples(task, TOKENIZER, 3, 400, seed=0)
    b = make_samples(task, TOKENIZER, 3, 400, seed=1)
    assert all(x.context != y.context for x, y in zip(a, b))
    assert make_samples(task, TOKENIZER, 1, 400, seed=0) == a[:1]


def test_needles_at_sentence_boundaries():
    for s in make_samples("multikey", TOKENIZER, 5, 600, seed=3):
        body = s.context.split("\n\n", 1)[1]
        for m in re.finditer(r"One of the special magic numbers for [a-z-]+ is: \d+\.", body):
            before, after = body[:m.start()], body[m.end():]
            assert before == "" or re.search(r"[.!?] $", before), before[-30:]
            assert after == "" or after.startswith(" "), after[:30]


def test_vartrack_chain_in_order():
    for s in make_samples("vartrack", TOKENIZER, 4, 700, seed=5):
        chain = s.answers
        assert s.context.index(f"VAR {chain[0]} = ") >= 0
        positions = [s.context.index(f"VAR {chain[0]} = ")]
        positions += [s.context.index(f"VAR {b} = VAR {a}.") for a, b in zip(chain, chain[1:])]
        assert positions == sorted(positions)
        value = re.search(r"VAR %s = (\d+)\." % chain[0], s.context).group(1)
        assert value in s.question


def test_cwe_answers_are_most_frequent():
    for s in make_samples("cwe", TOKENIZER, 3, 500, seed=2):
        entries = re.findall(r"^\d+\. (\S+)$", s.context, flags=re.M)
        counts = Counter(entries)
        top = {w for w, _ in counts.most_common(len(s.answers))}
        assert top == set(s.answers)
        assert min(counts[a] for a in s.answers) > max(
            c for w, c in counts.items() if w not in s.answers)


def test_passkey_question_is_short_and_direct():
    (s,) = make_samples("passkey", TOKENIZER, 1, 300)
    assert s.question == "What is the pass key? Answer with the number only."
    assert re.search(r"The pass key is \d{5}\. Remember it\.", s.context)


def test_multiquery_asks_every_key():
    (s,) = make_samples("multiquery", TOKENIZER, 1, 500, seed=9)
    keys = re.findall(r"magic numbers for ([a-z]+-[a-z]+) is", s.context)
    assert len(keys) == len(s.answers) == 4
    for k in keys:
        assert k in s.question


def test_other_tokenizer_kinds():
    """A raw `tokenizers.Tokenizer` and a word-level tokenizer both work."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = TOKENIZER.backend_tokenizer
    (s,) = make_samples("multivalue", raw, 1, 300, seed=4)
    assert len(raw.encode(s.context, add_special_tokens=False).ids) <= 300
    wl = Tokenizer(models.WordLevel({"<unk>": 0, "the": 1}, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    (s,) = make_samples("passkey", wl, 1, 200, seed=4)
    n = count_tokens(wl, [s.context])[0]
    assert 190 <= n <= 200


def _smollm2_tokenizer():
    from kvpress_ada import models

    path = models.default_model_dir()
    if not models._is_converted(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_smollm2_tokenizer_lengths(task):
    tok = _smollm2_tokenizer()
    if tok is None:
        pytest.skip("default model not converted yet (kvpress_ada.models.load())")
    for s in make_samples(task, tok, 2, 1024, seed=1):
        _check_sample(s, task, 1024, tok=tok, tol=0.01)


# ------------------------------------------------------------------ scoring


def test_string_match_rules():
    refs = ["4821937", "1234567"]
    assert string_match_all("4821937 and 1234567", refs) == 1.0
    assert string_match_all("only 4821937", refs) == 0.5
    assert string_match_all("nothing", refs) == 0.0
    assert string_match_part("only 4821937", refs) == 1.0
    assert string_match_part("nothing", refs) == 0.0
    assert string_match_all("the word is APPLE", ["apple"]) == 1.0  # case-insensitive


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1,
                        max_size=8), min_size=1, max_size=5, unique=True),
       st.text(max_size=20))
def test_string_match_properties(refs, noise):
    pred = noise + " " + ", ".join(refs)
    assert string_match_all(pred, refs) == 1.0
    assert string_match_part(pred, refs) == 1.0
    assert 0.0 <= string_match_all(noise, refs) <= string_match_part(noise, refs) <= 1.0


def test_longbench_metrics():
    assert scoring.qa_f1("The Eiffel Tower", ["eiffel tower"]) == 1.0
    f1 = scoring.qa_f1("Paris France", ["Paris"])  # precision 1/2, recall 1
    assert f1 == pytest.approx(2 / 3)
    assert scoring.qa_f1("London", ["Paris"]) == 0.0
    assert scoring.qa_f1("paris", ["London", "Paris"]) == 1.0  # best reference
    assert scoring.normalize_answer("The  Cat, sat!") == "cat sat"
    assert scoring.exact_match("the cat.", ["Cat"]) == 1.0
    assert scoring.substring_match("I think it is the cat", ["Cat"]) == 1.0
    assert scoring.rouge_l("a b c d", ["a b c d"]) == 1.0
    assert scoring.rouge_l("x y", ["a b"]) == 0.0
    assert scoring.rouge_l("a x c", ["a b c"]) == pytest.approx(2 / 3)
    classes = ["Individual", "City", "Country"]
    assert scoring.classification("City", ["City"], all_classes=classes) == 1.0
    assert scoring.classification("City or Country", ["City"], all_classes=classes) == 0.5
    assert scoring.classification("Individual", ["City"], all_classes=classes) == 0.0
    assert scoring.retrieval("Paragraph 2", ["Paragraph 2"]) == 1.0
    assert scoring.retrieval("Paragraph 2 or 3", ["Paragraph 2"]) == 0.5
    assert scoring.retrieval_zh("段落5", ["段落5"]) == 1.0
    assert scoring.count("There are 7 paragraphs", ["7"]) == 1.0
    assert scoring.count("none", ["7"]) == 0.0
    assert scoring.code_sim("```\n# comment\n    return x", ["    return x"]) == 1.0
    assert scoring.qa_f1_zh("北京", ["北京"]) == 1.0
    assert scoring.rouge_l_zh("今天天气很好", ["今天天气很好"]) == 1.0
    assert score("qa_f1", "Paris\nsecond line", ["Paris"], subset="triviaqa") == 1.0
    with pytest.raises(ValueError, match="unknown metric"):
        score("bleu", "x", ["x"])


def test_every_longbench_subset_has_a_metric_and_prompt():
    from kvpress_ada.harness.eval import datasets

    assert set(datasets._LONGBENCH_PROMPTS) == set(scoring.LONGBENCH_METRICS)
    assert set(scoring.LONGBENCH_METRICS.values()) <= set(scoring.METRICS)
    for task in TASKS.values():
        assert task.metric in scoring.METRICS


# ------------------------------------------------------------------ loaders


def test_load_ruler_niah():
    samples = load_ruler(FIXTURES / "ruler" / "niah_single_1" / "validation.jsonl")
    assert len(samples) == 2
    for s in samples:
        assert s.task == "ruler/niah_single_1" and s.metric == "string_match_all"
        assert s.question.startswith("What is the special magic number for sleepy-otter")
        assert s.context.startswith("A special magic number is hidden")
        assert "What is" not in s.context and s.answers == ["4821937"]
        assert "4821937" in s.context
        assert score_sample(s, "It is 4821937.") == 1.0
    with_prefix = load_ruler(FIXTURES / "ruler" / "niah_single_1", answer_prefix=True)
    assert with_prefix[0].question.endswith("mentioned in the provided text is")
    assert load_ruler(FIXTURES / "ruler" / "niah_single_1", limit=1) == samples[:1]


@pytest.mark.parametrize("task,question_start,metric", [
    ("niah_multivalue", "What are all the special magic numbers", "string_match_all"),
    ("vt", "Question: Find all variables", "string_match_all"),
    ("cwe", "Question: What are the 10 most common words", "string_match_all"),
    ("qa_1", "Answer the question based on the given documents", "string_match_part"),
])
def test_load_ruler_tasks(task, question_start, metric):
    (s,) = load_ruler(FIXTURES / "ruler" / task)
    assert s.task == f"ruler/{task}" and s.metric == metric
    assert s.question.startswith(question_start)
    assert s.context and not s.context.endswith("\n")
    if task == "qa_1":
        assert "Document 1" in s.context and "Eiffel Tower?" in s.question
        assert score_sample(s, "Paris") == 1.0
    else:
        assert all(a in s.context for a in s.answers)


def test_load_ruler_unknown_template_goes_to_context():
    (s,) = load_ruler(FIXTURES / "ruler" / "custom.jsonl")
    assert s.question == "" and s.context.startswith("Tell me") and s.task == "ruler/unknown"
    assert split_ruler_input("plain text") == ("plain text", "", None)


def test_load_longbench_fixtures():
    hp = load_longbench(FIXTURES / "longbench" / "hotpotqa.jsonl")
    assert [s.metric for s in hp] == ["qa_f1", "qa_f1"]
    assert hp[0].task == "longbench/hotpotqa" and hp[0].meta["_id"] == "hp-0001"
    assert hp[0].context.endswith("Brest is a port city in France.")
    assert "Which city is the lighthouse keeper's harbor in?" in hp[0].question
    assert score_sample(hp[0], "Brest") == 1.0
    assert score_sample(hp[1], "boat names") == 1.0

    (trec,) = load_longbench(FIXTURES / "longbench" / "trec.jsonl")
    assert trec.metric == "classification" and "City" in trec.meta["all_classes"]
    assert score_sample(trec, "City\nQuestion: next one") == 1.0  # first line only
    assert score_sample(trec, "Country") == 0.0

    (pr,) = load_longbench(FIXTURES / "longbench" / "passage_retrieval_en.jsonl")
    assert pr.metric == "retrieval" and score_sample(pr, "Paragraph 2") == 1.0

    (lcc,) = load_longbench(FIXTURES / "longbench" / "lcc_e.jsonl")
    assert lcc.metric == "code_sim" and lcc.task == "longbench/lcc_e"
    assert score_sample(lcc, "    return result\n") == 1.0
    assert load_longbench(FIXTURES / "longbench" / "hotpotqa.jsonl", limit=1) == hp[:1]


def test_loader_errors(tmp_path, monkeypatch):
    bad = tmp_path / "hotpotqa.jsonl"
    bad.write_text('{"input": "q", "context": "c", "answers": ["a"]}\n{oops\n')
    with pytest.raises(ValueError, match=r"hotpotqa.jsonl:2"):
        load_longbench(bad)
    missing = tmp_path / "qasper.jsonl"
    missing.write_text('{"input": "q", "context": "c"}\n')
    with pytest.raises(ValueError, match="missing field"):
        load_longbench(missing)
    unknown = tmp_path / "mystery.jsonl"
    unknown.write_text('{"input": "q", "context": "c", "answers": ["a"]}\n')
    with pytest.raises(ValueError, match="unknown LongBench subset 'mystery'"):
        load_longbench(unknown)
    with pytest.raises(ValueError, match="unknown LongBench subset"):
        load_longbench("not_a_subset")
    with pytest.raises(FileNotFoundError):
        load_ruler(tmp_path / "none.jsonl")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        load_longbench("hotpotqa")
    with pytest.raises(ImportError, match="pip install datasets"):
        load_ruler("someone/ruler", config="4096")


def test_load_ruler_hub_rows(monkeypatch):
    """Hub datasets (via datasets.load_dataset) in either RULER schema."""
    import types

    rows = [{"context": "ctx with 42", "question": "What number?", "answer": ["42"],
             "task": "niah_single_1", "answer_prefix": " Answer:", "max_new_tokens": 8}]
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split: rows
    monkeypatch.setitem(sys.modules, "datasets", fake)
    (s,) = load_ruler("someone/ruler", config="4096", split="test")
    assert (s.context, s.question, s.answers, s.task) == ("ctx with 42", "What number?", ["42"],
                                                           "ruler/niah_single_1")


def test_hub_failure_says_what_to_do(monkeypatch):
    import types

    def unreachable(name, config, split):
        raise ConnectionError("hub unreachable")

    fake = types.ModuleType("datasets")
    fake.load_dataset = unreachable
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(RuntimeError, match=r"hub unreachable.*data/hotpotqa\.jsonl"):
        load_longbench("hotpotqa")
    with pytest.raises(RuntimeError, match="pass the path"):
        load_ruler("someone/ruler")
