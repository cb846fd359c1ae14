"""Full-cache accuracy of a named model under prompt formats (no press): which format a base model needs.

A prompt format is a chat template given to the tokenizer: every prompt the library builds goes through
``split_prompt`` (context part, then question part), so the format decides what surrounds the context and
the question. Each sample is scored by the eval runner's full-cache row (``evaluate_sample`` with no press:
one prefill of the context part, then the question part and greedy decoding, question-agnostic), on the
synthetic tasks of ``kvpress-ada eval``. Formats: ``model`` (the named model's own: its source's
``prompt_template``, else the checkpoint's chat template), ``none`` (no template: the context, then
``Question: ... Answer:``, no special tokens) and the alternatives of :data:`FORMATS`.

    python benchmarks/prompt_formats.py --model gemma-3-270m --formats model,none,bos,turns,fewshot,fewshot_word \
        --tasks passkey,multikey --n 8 --context 4000 --out benchmarks/results/gemma-3-270m_prompt_formats_4k.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _text(text: str) -> str:
    """``text`` as a Jinja expression (chat templates trim the newline after a block tag: write them as strings)."""
    return "{{ " + json.dumps(text) + " }}"


_CONTENT = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
_READ = "Read the text, then answer the question that follows it.\n\n"
_DEMO = (_READ + "Text: The committee met on Tuesday. The new budget code is 4718. The minutes were approved.\n\n"
         "What is the new budget code? Answer with the number only.\nAnswer: 4718\n\n")
_DEMO_WORD = (_READ + "Text: The committee met on Tuesday in the blue room. The minutes were approved.\n\n"
              "In which room did the committee meet? Answer with the colour only.\nAnswer: blue\n\n")


def _framed(before: str, after: str) -> str:
    """``<bos>`` + ``before`` + the message + (when a reply is asked for) ``after``."""
    return "{{ bos_token }}" + (_text(before) if before else "") + _CONTENT + \
        "{% if add_generation_prompt %}" + _text(after) + "{% endif %}"


FORMATS: dict[str, str] = {
    # <bos>, the context, the question, "Answer:"
    "bos": _framed("", "\nAnswer:"),
    # Gemma's turn markers (the instruction-tuned models' template)
    "turns": ("{{ bos_token }}{% for message in messages %}<start_of_turn>"
              "{{ 'model' if message['role'] == 'assistant' else message['role'] }}" + _text("\n") +
              "{{ message['content'] | trim }}<end_of_turn>" + _text("\n") +
              "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model" + _text("\n") + "{% endif %}"),
    # an instruction, the context labelled "Text:", the question, "Answer:"
    "instruction": _framed(_READ + "Text: ", "\nAnswer:"),
    # the same, asking for words copied from the text
    "instruction_copy": _framed(_READ.replace("follows it.", "follows it with words copied from the text.")
                                + "Text: ", "\nAnswer:"),
    # one worked example (a number) before the instruction's frame
    "fewshot": _framed(_DEMO + "Text: ", "\nAnswer:"),
    # one worked example whose answer is a word
    "fewshot_word": _framed(_DEMO_WORD + "Text: ", "\nAnswer:"),
}


def main(argv: list[str] | None = None) -> int:
    from kvpress_ada.harness.model_sources import SOURCES, source_names

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma-3-270m", choices=source_names())
    p.add_argument("--formats", default="model,none", help=f"comma-separated: model, none, {', '.join(FORMATS)}")
    p.add_argument("--tasks", default="passkey,multikey,vartrack")
    p.add_argument("--n", type=int, default=8, help="samples per task")
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="JSON summary: accuracy per format and task, time")
    p.add_argument("--records", type=Path, default=None, help="JSON of every answer (keep it out of git)")
    args = p.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in ("model", "none", *FORMATS)]
    if bad:
        p.error(f"unknown format(s) {', '.join(bad)}; choose from model, none, {', '.join(FORMATS)}")

    from kvpress_ada.harness.eval.runner import evaluate_sample
    from kvpress_ada.harness.eval.tasks import make_samples

    common.set_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = common.load_model(args.model)
    own = tokenizer.chat_template
    samples = [s for task in args.tasks.split(",") for s in make_samples(task, tokenizer, args.n, args.context,
                                                                          seed=args.seed)]
    print(f"model and {len(samples)} samples ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    templates = {"model": own, "none": None, **FORMATS}
    rows, records, summary = [], [], {}
    for fmt in formats:
        tokenizer.chat_template = templates[fmt]
        scores: dict[str, list[float]] = {}
        start = time.perf_counter()
        for sample in samples:
            t1 = time.perf_counter()
            full = evaluate_sample(model, tokenizer, sample, [], max_new_tokens=args.max_new_tokens)[0]
            scores.setdefault(sample.task, []).append(full.score)
            records.append({"format": fmt, "task": sample.task, "index": sample.meta["index"],
                            "answers": sample.answers, "answer": full.answer, "score": full.score,
                            "seconds": round(time.perf_counter() - t1, 1)})
            print(json.dumps(records[-1]), file=sys.stderr, flush=True)
        seconds = time.perf_counter() - start
        every = [s for task in scores.values() for s in task]
        summary[fmt] = {"accuracy": {task: sum(v) / len(v) for task, v in scores.items()},
                        "all": sum(every) / len(every), "n": {task: len(v) for task, v in scores.items()},
                        "seconds_per_sample": seconds / len(every)}
        rows.append([fmt] + [f"{sum(v) / len(v):.2f}" for v in scores.values()]
                    + [f"{sum(every) / len(every):.2f}", f"{seconds / len(every):.0f}"])
    tasks = list(dict.fromkeys(s.task for s in samples))
    table = common.fmt_table(["format", *tasks, "all", "s / sample"], rows)
    print(table)
    run = {"machine": common.machine_info(), "git": common.git_state(), "date": common.now_iso(),
           "model": args.model, "source_template": SOURCES[args.model].prompt_template, "tasks": tasks,
           "n": args.n, "context": args.context, "seed": args.seed, "threads": args.threads,
           "max_new_tokens": args.max_new_tokens, "formats": {f: templates[f] for f in formats}}
    if args.out is not None:
        common.write_json(args.out, {**run, "summary": summary, "table": table})
    if args.records is not None:
        common.write_json(args.records, {**run, "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
