"""How a score surrogate's held-out fit grows with its training texts, and what training costs.

One collection (``kvpress_ada.harness.distill.collect_pairs``, teacher KVzip) over the texts
``kvpress-ada distill`` would use for ``n = n_train_max + heldout`` (the same seeds, every fifth text
held out), then fits on the first k training texts for every k of ``--n-train`` (linear: ridge from
the statistics of those k texts; mlp: at most 32,768 tokens per layer of those k texts, as the
command does), each measured on the same held-out texts. Also reads the shipped surrogates' own
records (training seconds, fit) when they exist.

    python benchmarks/surrogate_fit.py          # default model, 64 + 16 texts of 1k tokens (~30 min on 1 thread)
    python benchmarks/surrogate_fit.py --quick  # tiny random model, a few texts (smoke run)
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _tiny():
    sys.path.insert(0, str(common.ROOT / "tests"))
    from conftest import build_model, build_tokenizer

    return build_model("llama", max_position_embeddings=4096), build_tokenizer()


def _surrogate(weights, model, kind, width):
    from kvpress_ada.calibration import model_identity
    from kvpress_ada.surrogate import Surrogate

    return Surrogate(weights, {"model": model_identity(model.config), "teacher": {"name": "kvzip"}, "kind": kind,
                               "hidden_size": int(model.config.hidden_size), "width": width, "dtype": "float32",
                               "target": {}, "training": {}, "fit": {}, "library_version": "-", "created": "-"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-train", default="8,16,32,64", help="training texts of each linear fit")
    parser.add_argument("--n-train-mlp", default="16,32,64", help="training texts of each mlp fit")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--teacher", default="kvzip", choices=["kvzip", "kvzip_plus"])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32_768)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny random model, 300 tokens, 2 / 4 training texts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from kvpress_ada import surrogate as sur
    from kvpress_ada.harness import distill as D
    from kvpress_ada.harness.eval.tasks import TASKS

    common.set_threads(args.threads)
    info = common.machine_info()
    if args.quick:
        model, tok = _tiny()
        args.context, args.n_train, args.n_train_mlp, args.epochs = 300, "2,4", "4", 2
        tasks = ["passkey"]
    else:
        model, tok = common.load_model("default")
        tasks = list(TASKS)
    out = Path(args.out or (common.QUICK_DIR if args.quick else common.RESULTS) / "surrogate_fit.summary.json")
    linear_at = sorted(int(k) for k in args.n_train.split(","))
    mlp_at = sorted(int(k) for k in args.n_train_mlp.split(","))
    n_train = max(linear_at + mlp_at)
    n = n_train * D.HELDOUT_EVERY // (D.HELDOUT_EVERY - 1)  # every fifth text held out
    texts, held = D.training_texts(tok, n, args.context, tasks), D.heldout(n)
    assert n - sum(held) == n_train
    snapshots: dict[int, list] = {}
    seen = [0]

    def on_text(i: int, pairs) -> None:
        if not held[i]:
            seen[0] += 1
            if seen[0] in linear_at + mlp_at:
                snapshots[seen[0]] = copy.deepcopy(pairs.stats)

    start = time.perf_counter()
    pairs = D.collect_pairs(model, tok, D.teacher_scorer(args.teacher), texts, held, keep_per_text=10**9,
                            on_text=on_text)
    collect_seconds = time.perf_counter() - start
    rows = []
    for kind, points in (("linear", linear_at), ("mlp", mlp_at)):
        for k in points:
            view = copy.copy(pairs)
            view.stats = snapshots[k]
            if kind == "mlp":  # as the command: at most max_tokens per layer, spread over the k texts
                per_text = math.ceil(args.max_tokens / k)
                keep = [torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(i))[:per_text]
                        for i, x in enumerate(pairs.fit_x[0][:k])]
                view.fit_x = [[x[p] for x, p in zip(layer[:k], keep)] for layer in pairs.fit_x]
                view.fit_y = [[y[p] for y, p in zip(layer[:k], keep)] for layer in pairs.fit_y]
            t0 = time.perf_counter()
            weights, _ = D.fit_layers(view, kind, args.width, args.epochs, seed=D.CALIBRATION_SEED, n_texts=k,
                                      progress=False)
            if kind == "mlp":
                weights = [{key: v.half() for key, v in layer.items()} for layer in weights]  # as shipped
            seconds = time.perf_counter() - t0
            made = _surrogate(weights, model, kind, args.width if kind == "mlp" else None)
            fit = D.fit_quality(D.predict_heldout(made, view), pairs.held_y)
            tokens = sum(x.shape[0] for x in (view.fit_x[0][:k] if kind == "mlp" else pairs.fit_x[0][:k]))
            rows.append({"kind": kind, "n_train_texts": k, "tokens_per_layer": tokens, "fit_seconds": round(seconds, 1),
                         **fit["summary"], "r2_per_layer": fit["r2"]})
            print(f"{kind:<7} k={k:<3} tokens {tokens:>6}  fit {seconds:6.1f}s  " +
                  "  ".join(f"{key} {fit['summary'][key]:.3f}" for key in fit["summary"]))
    shipped = {}
    if not args.quick:
        for path in (sur.SHIPPED_LINEAR, sur.SHIPPED_MLP):
            try:
                meta = sur.load(path).meta
            except sur.SurrogateError:
                continue
            shipped[path] = {"command": meta.command, "seconds": meta.seconds, "training": {
                key: meta.training[key] for key in ("n", "n_train", "n_heldout", "context", "texts", "tokens_per_layer",
                                                    "seconds_collect", "seconds_fit")},
                "fit": meta.fit["summary"], "bytes": sur.resolve(path).stat().st_size}
    payload = {"benchmark": "surrogate_fit", "date": common.now_iso(), "machine": info,
               "loadavg_at_end": list(os.getloadavg()), "args": vars(args), "teacher": args.teacher,
               "texts": {"n": n, "n_train": n_train, "n_heldout": sum(held), "context": args.context,
                         "heldout_tokens_per_layer": pairs.tokens["heldout"]},
               "collect_seconds": round(collect_seconds, 1),
               "collect_seconds_per_text": round(collect_seconds / n, 2), "rows": rows, "shipped": shipped}
    common.write_json(out, payload)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
