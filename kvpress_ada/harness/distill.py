"""Train a score surrogate (:mod:`kvpress_ada.surrogate`) for a model: ``kvpress-ada distill``.

For each training text the model is prefilled once (recording every layer's attention input) and the
teacher's model pass (KVzip or KVzip+) measures every entry's raw score; per layer the pairs (hidden
state, ``log(max(score, floor))`` per kv head) are collected, except the teacher's always-kept first
``sinks`` tokens. Texts: task-suite samples from seed ``>= CALIBRATION_SEED`` (evaluation uses seed 0)
and a quarter of plain documentation text (docstrings of a fixed list of Python standard-library
modules: offline and deterministic for a Python version), each framed as the context of a chat
prompt like ``eval``'s. Every fifth text is held out and only measures the fit.

* ``linear``: ridge regression on standardised inputs, in closed form from streamed sufficient
  statistics (``X^T X``, ``X^T Y`` per layer: memory constant in the number of texts); the ridge
  strength is picked per layer on the held-out texts from :data:`LAMBDAS`.
* ``mlp``: ``gelu(h W1 + b1) W2 + b2`` trained with Adam (seeded) on standardised inputs and targets
  (statistics from the same stream), on at most ``max_tokens`` training tokens per layer.
* ``gate``: Fast KVzip's sink-attention gate (:mod:`kvpress_ada.surrogate`), its output in ``(0, 1)`` fitted to
  the teacher's raw score by binary cross-entropy (the authors' ``cnt`` loss) with Adam (seeded), on the same
  subsample as ``mlp`` (:data:`GATE_EPOCHS` passes: the authors train 5,000 SGD steps of 1,000 tokens).

Held-out fit quality per layer: R^2 (pooled over heads, against each head's held-out mean),
Spearman's rank correlation per (text, head) averaged per head, and kept-set recall at each of
:data:`RATIOS` (the fraction of the teacher's per-head top-k entries that the surrogate's top-k
recovers; ``global`` is the same for one top-k over all layers and heads, as the ``kvzip`` preset
selects).
"""

from __future__ import annotations

import datetime
import functools
import importlib
import inspect
import math
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from kvpress_ada.calibration import CALIBRATION_SEED, model_identity
from kvpress_ada.families import family_of
from kvpress_ada.hosts.transformers.fanout import capture_prefill
from kvpress_ada.hosts.transformers.generation import split_prompt
from kvpress_ada.runtime import compressed_layers
from kvpress_ada.scorers import KVzip
from kvpress_ada.surrogate import Surrogate, SurrogateMeta
from kvpress_ada.tokens import encode

TEACHERS = {"kvzip": lambda: KVzip(), "kvzip_plus": lambda: KVzip(plus=True)}
KINDS = ("linear", "mlp", "gate")
FLOOR = 1e-6  # scores below it are clamped to it before the log
LAMBDAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # ridge strengths, relative to the inputs' correlation matrix
RATIOS = (0.5, 0.75)
HELDOUT_EVERY = 5  # texts i with i % 5 == 4 are held out
DOC_EVERY = 4  # texts i with i % 4 == 3 are documentation text
DEFAULT_WIDTH = 64
GATE_WIDTH, GATE_SINKS = 16, 16  # Fast KVzip's released gates: dim16_sink16
GATE_EPOCHS = 40  # the gate's quadratic form fits slowly: 2,560 Adam steps of 512 tokens on 32,768 per layer
GATE_LR = 3e-2
DEFAULT_EPOCHS = 8
DEFAULT_MAX_TOKENS = 32_768
DOC_MODULES = ("abc", "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
               "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools",
               "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client", "inspect", "io",
               "ipaddress", "itertools", "json", "locale", "logging", "mimetypes", "operator", "os", "pathlib",
               "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "socket",
               "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
               "threading", "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse", "uuid",
               "warnings", "weakref", "xml.etree.ElementTree", "zipfile")


# ----------------------------------------------------------------------------- training texts
@functools.lru_cache(maxsize=1)
def documentation_paragraphs() -> tuple[str, ...]:
    """Paragraphs of the docstrings of :data:`DOC_MODULES` and their public members (in name order),
    each once."""
    seen: set[str] = set()
    out: list[str] = []
    for name in DOC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover - a Python built without one of them
            continue
        members = [vars(module)[attr] for attr in sorted(vars(module)) if not attr.startswith("_")]
        for obj in [module] + [m for m in members if inspect.isclass(m) or inspect.isroutine(m)]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                doc = inspect.getdoc(obj)
            for para in (doc or "").split("\n\n"):
                para = para.strip()
                if len(para) >= 40 and para not in seen:
                    seen.add(para)
                    out.append(para)
    return tuple(out)


def documentation_texts(tokenizer: Any, n: int, context: int, seed: int = CALIBRATION_SEED) -> list[str]:
    """``n`` texts of consecutive documentation paragraphs cut to ``context`` tokens; text ``i`` starts
    at a paragraph drawn from ``(seed, i)``."""
    paras = documentation_paragraphs()
    texts = []
    for i in range(n):
        rng = random.Random(f"kvpress_ada:documentation:{seed}:{i}")
        at, parts, chars = rng.randrange(len(paras)), list[str](), 0
        while chars < 8 * context + 200:  # far more characters than ``context`` tokens, then cut
            parts.append(paras[at])
            chars += len(paras[at])
            at = (at + 1) % len(paras)
        ids = tokenizer("\n\n".join(parts), add_special_tokens=False)["input_ids"][:context]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


@dataclass
class TrainingText:
    source: str  # a task name or "documentation"
    prompt: str  # the context part of the chat prompt


def training_texts(tokenizer: Any, n: int, context: int, tasks: Sequence[str], seed: int = CALIBRATION_SEED
                   ) -> list[TrainingText]:
    """``n`` texts: position ``i`` with ``i % DOC_EVERY == DOC_EVERY - 1`` is documentation text, the
    others are calibration samples of ``tasks`` (round robin, seeds from ``seed``)."""
    from kvpress_ada.harness.calibrate import calibration_samples

    n_docs = sum(1 for i in range(n) if i % DOC_EVERY == DOC_EVERY - 1)
    samples = iter(calibration_samples(tokenizer, tasks, n - n_docs, context, seed) if n > n_docs else [])
    docs = iter(documentation_texts(tokenizer, n_docs, context, seed))
    out = []
    for i in range(n):
        if i % DOC_EVERY == DOC_EVERY - 1:
            out.append(TrainingText("documentation", split_prompt(tokenizer, next(docs), "")[0]))
        else:
            s = next(samples)
            out.append(TrainingText(s.task, split_prompt(tokenizer, s.context, s.question)[0]))
    return out


def heldout(n: int) -> list[bool]:
    """Which of ``n`` texts are held out (every :data:`HELDOUT_EVERY`-th; the last one when ``n`` is small)."""
    held = [i % HELDOUT_EVERY == HELDOUT_EVERY - 1 for i in range(n)]
    if not any(held):
        held[-1] = True
    return held


# ----------------------------------------------------------------------------- linear: ridge
@dataclass
class LinearStats:
    """Sufficient statistics of one layer's pairs (float64): ``n``, ``sum x``, ``X^T X``, ``X^T Y``,
    ``sum y``, ``sum y^2``."""

    hidden: int
    heads: int
    n: int = 0
    sx: torch.Tensor = field(init=False)
    sxx: torch.Tensor = field(init=False)
    sxy: torch.Tensor = field(init=False)
    sy: torch.Tensor = field(init=False)
    syy: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        d, h = self.hidden, self.heads
        self.sx, self.sxx = torch.zeros(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
        self.sxy, self.sy, self.syy = (torch.zeros(d, h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64),
                                       torch.zeros(h, dtype=torch.float64))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add pairs ``x [T, hidden]``, ``y [T, heads]``."""
        x, y = x.detach().double().cpu(), y.detach().double().cpu()
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sxx += x.T @ x
        self.sxy += x.T @ y
        self.sy += y.sum(0)
        self.syy += (y * y).sum(0)

    def x_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and standard deviation of the inputs (the deviation floored at 1% of the median one, so
        near-constant inputs stay finite once standardised)."""
        mean = self.sx / self.n
        std = (torch.diagonal(self.sxx) / self.n - mean * mean).clamp_min(0.0).sqrt()
        return mean, std.clamp_min(max(float(std.median()) * 1e-2, 1e-12))

    def y_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.sy / self.n
        return mean, (self.syy / self.n - mean * mean).clamp_min(1e-12).sqrt()

    def solve(self, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Ridge ``(W [hidden, heads], b [heads])`` minimising ``|XW + b - Y|^2 + lam * n * |D W|^2`` with
        ``D`` the inputs' standard deviations (ridge on standardised inputs, unpenalised intercept)."""
        if self.n < 1:
            raise ValueError("no training pairs")
        mean, std = self.x_moments()
        y_mean = self.sy / self.n
        corr = (self.sxx / self.n - torch.outer(mean, mean)) / torch.outer(std, std)
        cross = (self.sxy / self.n - torch.outer(mean, y_mean)) / std[:, None]
        eye = torch.eye(self.hidden, dtype=torch.float64)
        beta = torch.linalg.solve(corr + lam * eye, cross)
        weight = beta / std[:, None]
        return weight, y_mean - mean @ weight


def fit_linear(stats: LinearStats, held_x: list[torch.Tensor], held_y: list[torch.Tensor],
               lambdas: Sequence[float] = LAMBDAS) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Ridge on ``stats`` with the strength of ``lambdas`` whose held-out squared error is least:
    ``(W float32, b float32, lambda)``."""
    x = torch.cat([t.float() for t in held_x]).double()
    y = torch.cat([t.float() for t in held_y]).double()
    best: tuple[float, torch.Tensor, torch.Tensor, float] | None = None
    for lam in lambdas:
        weight, bias = stats.solve(lam)
        error = float(((x @ weight + bias - y) ** 2).sum())
        if best is None or error < best[0]:
            best = (error, weight, bias, lam)
    assert best is not None
    return best[1].float(), best[2].float(), best[3]


# ----------------------------------------------------------------------------- mlp
def fit_mlp(x: torch.Tensor, y: torch.Tensor, x_moments: tuple[torch.Tensor, torch.Tensor],
            y_moments: tuple[torch.Tensor, torch.Tensor], width: int = DEFAULT_WIDTH, epochs: int = DEFAULT_EPOCHS,
            seed: int = 0, batch: int = 512, lr: float = 3e-3, weight_decay: float = 1e-4) -> dict[str, torch.Tensor]:
    """``gelu(h W1 + b1) W2 + b2`` fitted to ``x [N, hidden]`` -> ``y [N, heads]`` (MSE, AdamW with a
    cosine schedule, seeded; the global RNG is left as it was). Inputs and targets are standardised
    with the given ``(mean, std)`` during training and the result folds them into the weights:
    float32 ``{"w1", "b1", "w2", "b2"}``."""
    x_mean, x_std = (t.float() for t in x_moments)
    y_mean, y_std = (t.float() for t in y_moments)
    n = x.shape[0]
    steps = max(1, epochs * math.ceil(n / batch))
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), torch.inference_mode(False):
        torch.manual_seed(seed)
        first, second = torch.nn.Linear(x.shape[1], width), torch.nn.Linear(width, y.shape[1])
        net = torch.nn.Sequential(first, torch.nn.GELU(), second)
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / steps, 1))))
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, batch):
                idx = order[start:start + batch]
                inputs = (x[idx].float() - x_mean) / x_std
                targets = (y[idx].float() - y_mean) / y_std
                loss = torch.nn.functional.mse_loss(net(inputs), targets)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                schedule.step()
        a, a_bias = first.weight.detach().T.clone(), first.bias.detach().clone()  # [hidden, width], [width]
        b, b_bias = second.weight.detach().T.clone(), second.bias.detach().clone()  # [width, heads], [heads]
    w1 = a / x_std[:, None]
    b1 = a_bias - (x_mean / x_std) @ a
    return {"w1": w1, "b1": b1, "w2": b * y_std, "b2": b_bias * y_std + y_mean}


# ----------------------------------------------------------------------------- gate
def fit_gate(x: torch.Tensor, y: torch.Tensor, heads: int, group: int, width: int = GATE_WIDTH,
             sinks: int = GATE_SINKS, epochs: int = GATE_EPOCHS, seed: int = 0, batch: int = 512,
             lr: float = GATE_LR) -> dict[str, torch.Tensor]:
    """Fast KVzip's gate (:func:`kvpress_ada.surrogate.gate_log_scores`) fitted to ``x [N, hidden]`` ->
    ``y [N, heads]`` (the teacher's log score): binary cross-entropy of the gate against ``exp(y)`` (clamped to
    ``[0, 1]``), Adam with a cosine schedule, seeded (the global RNG is left as it was). Initialised as the
    authors' gates: linear layers at torch's default, norms at 1, sink keys and biases at 0. Float32 tensors."""
    from kvpress_ada.surrogate import gate_log_scores

    n, hidden = x.shape
    target = y.float().exp().clamp(0.0, 1.0)
    steps = max(1, epochs * math.ceil(n / batch))
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), torch.inference_mode(False):
        torch.manual_seed(seed)
        q_proj = torch.nn.Linear(hidden, heads * group * width)
        k_proj = torch.nn.Linear(hidden, heads * width, bias=False)
        extra = torch.nn.ParameterDict({"q_norm": torch.nn.Parameter(torch.ones(width)),
                                        "k_norm": torch.nn.Parameter(torch.ones(width)),
                                        "k_base": torch.nn.Parameter(torch.zeros(heads, sinks, width)),
                                        "b": torch.nn.Parameter(torch.zeros(heads, group))})
        params = [*q_proj.parameters(), *k_proj.parameters(), *extra.parameters()]
        opt = torch.optim.Adam(params, lr=lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / steps, 1))))

        def tensors() -> dict[str, torch.Tensor]:
            return {"q_w": q_proj.weight.T, "q_b": q_proj.bias, "k_w": k_proj.weight.T, **dict(extra.items())}

        for _ in range(epochs):
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, batch):
                idx = order[start:start + batch]
                gate = gate_log_scores(tensors(), x[idx].float(), heads, group).exp().clamp(1e-7, 1 - 1e-7)
                loss = torch.nn.functional.binary_cross_entropy(gate, target[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                schedule.step()
        return {k: v.detach().clone().contiguous() for k, v in tensors().items()}


# ----------------------------------------------------------------------------- fit quality
def _ranks(v: torch.Tensor) -> torch.Tensor:
    return v.argsort(-1).argsort(-1).double()


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman's rank correlation of ``a`` and ``b`` along the last dimension (ties broken by order)."""
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1)).clamp_min(1e-12)


def kept_recall(pred: torch.Tensor, target: torch.Tensor, ratio: float) -> torch.Tensor:
    """Along the last dimension: the fraction of ``target``'s top-k entries that ``pred``'s top-k also
    holds, ``k = round((1 - ratio) * n)`` (at least 1)."""
    k = max(1, round((1.0 - ratio) * target.shape[-1]))
    mine = torch.zeros_like(pred, dtype=torch.bool).scatter_(-1, pred.topk(k, dim=-1).indices, True)
    theirs = torch.zeros_like(target, dtype=torch.bool).scatter_(-1, target.topk(k, dim=-1).indices, True)
    return (mine & theirs).sum(-1).double() / k


def fit_quality(preds: list[list[torch.Tensor]], targets: list[list[torch.Tensor]],
                ratios: Sequence[float] = RATIOS) -> dict[str, Any]:
    """Held-out fit quality from ``preds[layer][text]`` and ``targets[layer][text]`` (``[heads, T]``
    each): per layer ``r2``, ``spearman`` (per head), ``recall`` (per ratio), ``global_recall`` (per
    ratio, over texts) and a ``summary`` (means over layers)."""
    r2: list[float] = []
    rho: list[list[float]] = []
    recall: dict[str, list[float]] = {str(r): [] for r in ratios}
    for layer_preds, layer_targets in zip(preds, targets):
        p = torch.cat(layer_preds, dim=-1).double()
        t = torch.cat(layer_targets, dim=-1).double()
        sse = float(((p - t) ** 2).sum())
        sst = float(((t - t.mean(-1, keepdim=True)) ** 2).sum())
        r2.append(round(1.0 - sse / max(sst, 1e-300), 4))
        rho.append([round(float(v), 4) for v in torch.stack([spearman(a, b) for a, b in
                                                             zip(layer_preds, layer_targets)]).mean(0)])
        for r in ratios:
            recall[str(r)].append(round(float(torch.cat([kept_recall(a, b, r) for a, b in
                                                         zip(layer_preds, layer_targets)]).mean()), 4))
    global_recall = {}
    for r in ratios:
        per_text = [kept_recall(torch.cat([layer[i].reshape(-1) for layer in preds]),
                                torch.cat([layer[i].reshape(-1) for layer in targets]), r)
                    for i in range(len(preds[0]))]
        global_recall[str(r)] = round(float(torch.stack(per_text).mean()), 4)

    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 4)

    summary = {"r2": mean(r2), "spearman": mean([sum(h) / len(h) for h in rho]),
               **{f"recall@{r}": mean(v) for r, v in recall.items()},
               **{f"global_recall@{r}": v for r, v in global_recall.items()}}
    return {"summary": summary, "r2": r2, "spearman": rho, "recall": recall, "global_recall": global_recall}


# ----------------------------------------------------------------------------- distill
def teacher_scorer(teacher: str | KVzip) -> KVzip:
    if isinstance(teacher, KVzip):
        return teacher
    if teacher not in TEACHERS:
        raise ValueError(f"unknown teacher {teacher!r}; valid teachers: {', '.join(TEACHERS)}")
    return TEACHERS[teacher]()


@dataclass
class Pairs:
    """What :func:`collect_pairs` gathered, per layer: the training pairs' :class:`LinearStats`, the
    held-out pairs (``x [T, hidden]`` compact, ``y [heads, T]`` per text) and, when asked for, a
    subsample of the training pairs (``x [k, hidden]`` compact, ``y [k, heads]`` per text)."""

    stats: list[LinearStats]
    held_x: list[list[torch.Tensor]]
    held_y: list[list[torch.Tensor]]
    fit_x: list[list[torch.Tensor]]
    fit_y: list[list[torch.Tensor]]
    tokens: dict[str, int]
    skip: int


@torch.no_grad()
def collect_pairs(model: Any, tokenizer: Any, scorer: KVzip, texts: Sequence[TrainingText], held: Sequence[bool],
                  keep_per_text: int = 0, seed: int = CALIBRATION_SEED, progress: bool = True,
                  on_text: Callable[[int, Pairs], None] | None = None) -> Pairs:
    """Prefill every text, run ``scorer``'s model pass, and gather each layer's pairs (hidden state
    entering attention, ``log(max(score, FLOOR))`` per kv head) past the scorer's sinks; of a
    training text, ``keep_per_text`` random tokens (seeded by ``seed + i``) are also kept as pairs."""
    layers, hidden = int(model.config.num_hidden_layers), int(model.config.hidden_size)
    heads = model_identity(model.config).num_kv_heads
    device = next(model.parameters()).device
    def empty() -> list[list[torch.Tensor]]:
        return [[] for _ in range(layers)]

    pairs = Pairs([LinearStats(hidden, heads) for _ in range(layers)], empty(), empty(), empty(), empty(),
                  tokens={"train": 0, "fit": 0, "heldout": 0}, skip=scorer.sinks)
    for i, text in enumerate(tqdm(texts, disable=not progress, desc="distilling", unit="text")):
        ids = encode(tokenizer, text.prompt, device)
        prefill = capture_prefill(model, ids, hidden_states=True)
        scores = prefill.pass_scores(scorer)
        T = ids.shape[1] - pairs.skip
        if T < 1:
            raise ValueError(f"text {i} has {ids.shape[1]} tokens, none beyond the teacher's {pairs.skip} sinks")
        pick = None
        if keep_per_text and not held[i]:
            pick = torch.randperm(T, generator=torch.Generator().manual_seed(seed + i))[:keep_per_text].sort().values
        for layer in range(layers):
            h = prefill.layers[layer].hidden
            assert h is not None
            x = h[0, pairs.skip:].float()
            y = scores[layer][0, :, pairs.skip:].float().clamp_min(FLOOR).log()  # [heads, T]
            if held[i]:
                pairs.held_x[layer].append(_compact(x))
                pairs.held_y[layer].append(y.cpu())
                continue
            pairs.stats[layer].add(x, y.T)
            if pick is not None:
                pairs.fit_x[layer].append(_compact(x[pick.to(x.device)]))
                pairs.fit_y[layer].append(y.T[pick.to(y.device)].cpu())
        pairs.tokens["heldout" if held[i] else "train"] += T
        pairs.tokens["fit"] += 0 if held[i] else T if pick is None else pick.numel()
        del prefill, scores
        if on_text is not None:
            on_text(i, pairs)
    return pairs


def fit_layers(pairs: Pairs, kind: str, width: int = DEFAULT_WIDTH, epochs: int = DEFAULT_EPOCHS, seed: int = 0,
               n_texts: int | None = None, progress: bool = True, group: int = 1,
               sinks: int = GATE_SINKS) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Every layer's weights (float32) and, for ``linear``, the chosen ridge strengths; ``mlp`` and ``gate`` read
    the subsampled pairs of the first ``n_texts`` training texts (all by default); ``group``: the model's query
    heads per kv head (``gate``)."""
    weights: list[dict[str, torch.Tensor]] = []
    lambdas: list[float] = []
    for layer in tqdm(range(len(pairs.stats)), disable=not progress, desc="fitting", unit="layer"):
        if kind == "linear":
            w, b, lam = fit_linear(pairs.stats[layer], pairs.held_x[layer], [t.T for t in pairs.held_y[layer]])
            weights.append({"weight": w, "bias": b})
            lambdas.append(lam)
        else:
            x = torch.cat(pairs.fit_x[layer][:n_texts])
            y = torch.cat(pairs.fit_y[layer][:n_texts])
            if kind == "gate":
                weights.append(fit_gate(x, y, y.shape[1], group, width, sinks, epochs, seed=seed + layer))
                continue
            weights.append(fit_mlp(x, y, pairs.stats[layer].x_moments(), pairs.stats[layer].y_moments(), width,
                                   epochs, seed=seed + layer))
    return weights, lambdas


def predict_heldout(surrogate: Surrogate, pairs: Pairs) -> list[list[torch.Tensor]]:
    """``[heads, T]`` predictions for every held-out text of every layer."""
    return [[surrogate.predict(x.float()[None], layer)[0] for x in pairs.held_x[layer]]
            for layer in range(surrogate.n_layers)]


def distill(model: Any, tokenizer: Any, teacher: str | KVzip = "kvzip", kind: str = "linear", n: int = 40,
            context: int = 1000, tasks: Sequence[str] | None = None, seed: int = CALIBRATION_SEED,
            width: int | None = None, epochs: int | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
            model_name: str | None = None, progress: bool = True, sinks: int = GATE_SINKS) -> Surrogate:
    """A surrogate of ``teacher``'s scores for ``model``, trained on ``n`` texts of ``context`` tokens
    (see the module docstring); ``width``: the MLP's hidden width or the gate's dimension (defaults
    :data:`DEFAULT_WIDTH`, :data:`GATE_WIDTH`), ``sinks``: the gate's sink keys."""
    from kvpress_ada import __version__
    from kvpress_ada.harness.eval.tasks import TASKS

    scorer = teacher_scorer(teacher)
    if kind not in KINDS:
        raise ValueError(f"unknown surrogate kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if n < 2:
        raise ValueError(f"distilling needs n >= 2 texts (one is held out to measure the fit), got n={n}")
    if seed < CALIBRATION_SEED:
        raise ValueError(f"training seeds start at {CALIBRATION_SEED} (evaluation uses seed 0); got seed={seed}")
    width = width if width is not None else GATE_WIDTH if kind == "gate" else DEFAULT_WIDTH
    epochs = epochs if epochs is not None else GATE_EPOCHS if kind == "gate" else DEFAULT_EPOCHS
    if width < 1 or epochs < 1 or max_tokens < 1 or sinks < 1:
        raise ValueError(f"width, epochs, max_tokens and sinks must be >= 1, got {width}, {epochs}, {max_tokens}, "
                         f"{sinks}")
    group = int(model.config.num_attention_heads) // model_identity(model.config).num_kv_heads
    tasks = list(tasks) if tasks else list(TASKS)
    start = time.perf_counter()
    texts = training_texts(tokenizer, n, context, tasks, seed)
    held = heldout(n)
    n_train = n - sum(held)
    per_text = math.ceil(max_tokens / n_train) if kind in ("mlp", "gate") else 0
    pairs = collect_pairs(model, tokenizer, scorer, texts, held, per_text, seed, progress)
    collected = time.perf_counter() - start
    weights, lambdas = fit_layers(pairs, kind, width, epochs, seed, progress=progress, group=group, sinks=sinks)
    dtype = torch.float32
    if kind in ("mlp", "gate"):  # half the bytes; kept only when every weight stays finite in float16
        half = [{k: v.half() for k, v in layer.items()} for layer in weights]
        if all(bool(torch.isfinite(v).all()) for layer in half for v in layer.values()):
            weights, dtype = half, torch.float16
    fitted = time.perf_counter() - start - collected
    counts: dict[str, int] = {}
    for text in texts:
        counts[text.source] = counts.get(text.source, 0) + 1
    training: dict[str, Any] = {
        "tasks": tasks, "n": n, "n_train": n_train, "n_heldout": n - n_train, "context": context, "texts": counts,
        "seeds": {"seed": seed, "note": f"task samples: calibration_samples(tokenizer, tasks, k, context, "
                                        f"seed={seed}); evaluation uses seed 0"},
        "documentation": {"source": "docstrings of Python standard-library modules and their public members",
                          "modules": list(DOC_MODULES), "python": sys.version.split()[0],
                          "texts": f"text i with i % {DOC_EVERY} == {DOC_EVERY - 1}"},
        "heldout": f"text i with i % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1}",
        "tokens_per_layer": pairs.tokens, "seconds_collect": round(collected, 1), "seconds_fit": round(fitted, 1)}
    if kind == "linear":
        training["ridge"] = {"lambdas": list(LAMBDAS), "chosen": lambdas,
                             "note": "ridge on standardised inputs, strength picked per layer on the held-out texts"}
    elif kind == "gate":
        training["gate"] = {"epochs": epochs, "batch": 512, "lr": GATE_LR, "optimizer": "Adam", "schedule": "cosine",
                            "loss": "binary cross-entropy against exp(target), clamped to [0, 1]",
                            "seed": f"{seed} + layer", "max_tokens": max_tokens, "tokens_per_text": per_text}
    else:
        training["mlp"] = {"epochs": epochs, "batch": 512, "lr": 3e-3, "weight_decay": 1e-4, "optimizer": "AdamW",
                           "schedule": "cosine", "seed": f"{seed} + layer", "max_tokens": max_tokens,
                           "tokens_per_text": per_text}
    meta: dict[str, Any] = dict(
        model=model_identity(model.config, model_name), teacher=scorer.model_dump(mode="json"), kind=kind,
        hidden_size=int(model.config.hidden_size), width=width if kind in ("mlp", "gate") else None,
        sinks=sinks if kind == "gate" else None,
        dtype=str(dtype).removeprefix("torch."),
        target={"quantity": "log(max(score, floor)) of the teacher's raw measured score (Prefill.pass_scores)",
                "floor": FLOOR, "excluded": f"the first {pairs.skip} tokens of each text (the teacher's sinks, "
                                            "always kept)"},
        training=training, fit={}, library_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    surrogate = Surrogate(weights, SurrogateMeta.model_validate(meta))
    # a hybrid model's sliding-window layers are never scored by a press (their targets are the floor): the fit is
    # measured over the layers a press compresses
    scope = compressed_layers(family_of(model))
    predicted = predict_heldout(surrogate, pairs)
    meta["fit"] = {**fit_quality([predicted[i] for i in scope], [pairs.held_y[i] for i in scope]),
                   "layers": list(scope)}
    meta["seconds"] = round(time.perf_counter() - start, 1)
    return Surrogate(weights, SurrogateMeta.model_validate(meta))


def _compact(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the CPU in float16 when that holds it (half the memory), else float32."""
    x = x.detach().cpu()
    return x.half() if bool(x.abs().max() < 6e4) else x.float()
