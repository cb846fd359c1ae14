"""Kept positions of kvpress_ada's key-statistics presses against NVIDIA kvpress 0.5.5, on identical token ids.

For each case (a tiny model of the test suite, seeded token ids, compression ratio 0.5 at an even length, so
kvpress's kept count ``int(L (1 - r))`` and ours ``round(L (1 - r))`` agree) kvpress runs its press in its own
virtualenv (``benchmarks/kvpress_agreement_worker.py``; kvpress pins ``transformers<5.3``) and the positions its
``ScorerPress.compress`` keeps per (layer, kv head) are recorded in ``tests/fixtures/kvpress_agreement.json``,
under a digest of the model's weights; ``tests/test_kvpress_recorded.py`` then compares our presses' kept
positions with the records in any environment, without kvpress.

Only cases where the semantics coincide are recorded: kvpress draws the leverage sketch at random (the worker
hands it ours instead) and downloads Q-filters by model name (both sides get the same seeded random filters for
the tiny model); Compactor's blending is set to the ratio (kvpress's default); non-causal chunks divide
the (inner) context evenly (kvpress's short last chunk attends to zero padding); the Ada variants are left
out (kvpress's safeguard rule differs: ``benchmarks/kvpress_compare.py``'s ``~kvpress`` replicas).

    python benchmarks/kvpress_agreement.py --record   # builds the kvpress venv if needed (~2 min), rewrites the file
    python benchmarks/kvpress_agreement.py --check    # our kept positions against the records (no kvpress)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

FIXTURE = ROOT / "tests" / "fixtures" / "kvpress_agreement.json"
RATIO = 0.5
SEED = 1  # the tiny model's seed (conftest.build_model)
RECORD = "python benchmarks/kvpress_agreement.py --record"


@dataclass(frozen=True)
class Case:
    """One comparison: kvpress's ``press(**kwargs)`` against our scorer ``ours(model)`` (uniform allocation)."""

    arch: str
    length: int
    press: str
    kwargs: dict
    ours: Callable[[Any], Any]  # the model -> our scorer
    sketch: tuple[int, int] | None = None  # (seed, columns) of the leverage sketch both sides use
    qfilters: bool = False  # both sides score with qfilter_tensor(model)


def _cases() -> dict[str, Case]:
    from kvpress_ada.scorers import CAP, CUR, Compactor, Leverage, NonCausalAttention, QFilter

    r = dict(compression_ratio=RATIO)
    return {
        "leverage": Case("llama", 100, "LeverageScorePress", r, lambda m: Leverage(), sketch=(0, 48)),
        "leverage/qwen3": Case("qwen3", 96, "LeverageScorePress", r, lambda m: Leverage(), sketch=(0, 48)),
        "cur": Case("llama", 100, "CURPress", r, lambda m: CUR()),
        "cur/kv_avg_global": Case("llama", 100, "CURPress",
                                  {**r, "leverage_type": "kv_avg", "use_local_approximation": False},
                                  lambda m: CUR(leverage_type="kv_avg", local_window=None)),
        "cur/value_window8": Case("llama", 100, "CURPress", {**r, "leverage_type": "value", "local_window_size": 8},
                                  lambda m: CUR(leverage_type="value", local_window=8)),
        "non_causal_attention": Case("llama", 100, "NonCausalAttnPress", {**r, "chunk_size": 25},
                                     lambda m: NonCausalAttention(chunk_size=25)),
        "compactor": Case("llama", 100, "CompactorPress", {**r, "chunk_size": 22},
                          lambda m: Compactor(chunk_size=22, blending=RATIO), sketch=(0, 48)),
        "compactor/qwen3": Case("qwen3", 108, "CompactorPress", {**r, "chunk_size": 48},
                                lambda m: Compactor(chunk_size=48, blending=RATIO), sketch=(0, 48)),
        "qfilter": Case("llama", 100, "QFilterPress", r, lambda m: QFilter(path=random_qfilters(m)), qfilters=True),
        "cap": Case("llama", 100, "CapPress", r, lambda m: CAP()),
        "cap/tau2_sinks8": Case("llama", 100, "CapPress", {**r, "tau": 2.0, "n_sink": 8},
                                lambda m: CAP(tau=2.0, sinks=8)),
        "cap/qwen3": Case("qwen3", 96, "CapPress", r, lambda m: CAP()),
    }


def qfilter_tensor(model: Any) -> torch.Tensor:
    """Seeded random Q-filters ``[layers, kv heads, D]`` for ``model`` (both sides score with these)."""
    attn = model.model.layers[0].self_attn
    shape = (model.config.num_hidden_layers, model.config.num_key_value_heads, attn.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def random_qfilters(model: Any) -> str:
    """A Q-filters file of :func:`qfilter_tensor` for ``model`` (written once per process, in the temp folder)."""
    from kvpress_ada.calibration import model_identity
    from kvpress_ada.qfilters import QFilters, QFiltersMeta, save

    meta = QFiltersMeta(model=model_identity(model.config), data={"source": "seeded random (agreement test)"},
                        library_version="test", created="test")
    path = Path(tempfile.gettempdir()) / f"kvpress_ada_agreement_qfilters_{meta.model.fingerprint}.safetensors"
    if not path.exists():
        save(QFilters(qfilter_tensor(model), meta), path)
    return str(path)


def _model(arch: str):
    from conftest import build_model

    return build_model(arch, seed=SEED)


def weights_digest(model: Any) -> str:
    """sha256 of the model's parameters (name order), bit for bit: the records hold for these weights only."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def token_ids(length: int) -> torch.Tensor:
    return torch.randint(5, 120, (1, length), generator=torch.Generator().manual_seed(0))


def ours(case: Case, model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What our press keeps on the case's ids (one-shot prefill, fan-out), bool ``[layers, kv heads, L]``, and
    its scorer's scores ``[layers, kv heads, L]``."""
    from kvpress_ada import Pipeline
    from kvpress_ada.hosts.transformers.fanout import capture_prefill

    scorer = case.ours(model)
    press = Pipeline(scorer=scorer, compression_ratio=RATIO)
    with torch.inference_mode():
        prefill = capture_prefill(model, token_ids(case.length))
        kept = torch.stack([m[0] for m in prefill.keep_masks(press)]).cpu()
        scores = torch.stack([scorer.score(prefill.view(scorer, i).observations()[0])[0].float()
                              for i in range(kept.shape[0])]).cpu()
    return kept, scores


def as_mask(positions: list, length: int) -> torch.Tensor:
    """Bool ``[layers, heads, length]`` from kept positions per (layer, head)."""
    mask = torch.zeros(len(positions), len(positions[0]), length, dtype=torch.bool)
    for i, layer in enumerate(positions):
        for h, kept in enumerate(layer):
            mask[i, h, kept] = True
    return mask


def compare(mine: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor, rtol: float = 1e-4) -> dict:
    """Mean Jaccard of the kept sets over (layer, head), the (layer, head) pairs that differ, equal counts, and
    ``untied``: positions kept by one side only whose score (ours) is not within ``rtol`` of the head's last
    kept score (a tie, e.g. a repeated token in the first layer, is broken by rounding on either side)."""
    inter = (mine & theirs).sum(-1).double()
    union = (mine | theirs).sum(-1).double().clamp(min=1)
    boundary = scores.masked_fill(~mine, float("inf")).amin(-1, keepdim=True)
    near = (scores - boundary).abs() <= rtol * boundary.abs().clamp(min=1.0)
    return {"jaccard": float((inter / union).mean()), "differing_heads": int((mine != theirs).any(-1).sum()),
            "same_counts": bool(torch.equal(mine.sum(-1), theirs.sum(-1))),
            "untied": int(((mine != theirs) & ~near).sum())}


def load() -> dict:
    return json.loads(FIXTURE.read_text())


def record() -> dict:
    import kvpress_compare

    from kvpress_ada.scorers.statistics import gaussian_sketch

    cases = _cases()
    python = kvpress_compare.ensure_kvpress_venv(kvpress_compare.DEFAULT_VENV)
    out: dict[str, Any] = {"ratio": RATIO, "seed": SEED, "models": {}, "cases": {}}
    for arch in sorted({c.arch for c in cases.values()}):
        model = _model(arch)
        mine = {label: c for label, c in cases.items() if c.arch == arch}
        head_dim = model.model.layers[0].self_attn.head_dim
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            request = {"model": folder, "cases": [
                {"label": label, "press": c.press, "kwargs": c.kwargs, "ids": token_ids(c.length)[0].tolist(),
                 "sketch": None if c.sketch is None else gaussian_sketch(head_dim, c.sketch[1], c.sketch[0],
                                                                         "cpu").tolist(),
                 "q_filters": qfilter_tensor(model).tolist() if c.qfilters else None}
                for label, c in mine.items()]}
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            res = subprocess.run([str(python), str(ROOT / "benchmarks" / "kvpress_agreement_worker.py")],
                                 input=json.dumps(request), capture_output=True, text=True, env=env,
                                 cwd=tempfile.gettempdir())
            if res.returncode != 0:
                raise SystemExit(f"kvpress worker failed:\n{res.stderr[-3000:]}")
            reply = json.loads(res.stdout.strip().splitlines()[-1])
        out["versions"] = reply["versions"]
        out["models"][arch] = weights_digest(model)
        for label, masks in reply["kept"].items():
            kept = torch.tensor(masks, dtype=torch.bool)
            out["cases"][label] = {"arch": arch, "length": cases[label].length, "kvpress": cases[label].press,
                                   "kwargs": cases[label].kwargs,
                                   "kept": [[torch.nonzero(h).flatten().tolist() for h in layer] for layer in kept]}
    text = json.dumps(out, indent=1)
    text = re.sub(r"\[\s+([\d,\s]*?)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    FIXTURE.write_text(text + "\n")
    return out


def check(recorded: dict) -> dict[str, dict]:
    """``{label: compare(...)}`` of every recorded case, ours computed now."""
    cases = _cases()
    models: dict[str, Any] = {}
    results = {}
    for label, rec in recorded["cases"].items():
        arch = rec["arch"]
        if arch not in models:
            models[arch] = _model(arch)
            if weights_digest(models[arch]) != recorded["models"][arch]:
                raise SystemExit(f"the tiny {arch} model's weights differ from the recorded ones (another torch or "
                                 f"transformers initialises them differently): re-record with `{RECORD}`")
        kept, scores = ours(cases[label], models[arch])
        results[label] = compare(kept, as_mask(rec["kept"], rec["length"]), scores)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="run kvpress in its venv and rewrite the records")
    parser.add_argument("--check", action="store_true", help="compare our kept positions with the records")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    recorded = record() if args.record else load()
    for label, res in check(recorded).items():
        print(f"{label:24s} jaccard {res['jaccard']:.4f}  differing (layer, head) {res['differing_heads']}  "
              f"counts equal {res['same_counts']}  differences not at a tie {res['untied']}")


if __name__ == "__main__":
    main()
