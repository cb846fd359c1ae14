"""Do the shipped Q-filters point where the default model's queries look? (``kvpress_ada/qfilters``)

On a held-out documentation text (seed 30,000; the filters were made from seeds 10,000 on) the default model is
prefilled once; per (layer, kv head) the entries the last ``--window`` queries pay the most attention to (mean
over the window and the query group; the top half) are compared with the top half by the Q-filter score
``-(filter . k)``, by its opposite (a wrongly signed filter) and by KNorm's ``-||k||``: recall, mean over layers
and heads. ``--other FILE``: also the cosine between the filters and another file's (e.g. made from other
texts: ``kvpress-ada qfilters --seed 20000``), per (layer, kv head).

    python benchmarks/qfilters_check.py [--filters builtin:smollm2_135m] [--other FILE] [--context 1024]
"""

from __future__ import annotations

import argparse

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--filters", default="builtin:smollm2_135m")
    parser.add_argument("--other", default=None, help="a second Q-filters file of the same model")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--seed", type=int, default=30_000)
    args = parser.parse_args(argv)

    from kvpress_ada import qfilters
    from kvpress_ada.harness.distill import documentation_texts
    from kvpress_ada.harness.models import load
    from kvpress_ada.hosts.transformers.fanout import capture_prefill
    from kvpress_ada.tokens import encode

    filters = qfilters.load(args.filters).filters
    if args.other:
        cos = torch.nn.functional.cosine_similarity(filters, qfilters.load(args.other).filters, dim=-1)
        print(f"cosine with {args.other}: min {cos.min():.4f}, median {cos.median():.4f}")
    model, tok = load("default")
    qfilters.load(args.filters).check_model(model.config)
    ids = encode(tok, documentation_texts(tok, 1, args.context, seed=args.seed)[0])
    with torch.inference_mode():
        prefill = capture_prefill(model, ids)
    recalls: dict[str, list[float]] = {"qfilter": [], "opposite sign": [], "knorm": []}
    for i, c in enumerate(prefill.layers):
        k, q = c.keys[0].float(), c.queries[0].float()
        H, L, D = k.shape
        w = min(args.window, L)
        q = q.view(H, -1, L, D)[:, :, L - w:]
        visible = torch.arange(L)[None, :] <= torch.arange(L - w, L)[:, None]
        logits = torch.einsum("hgqd,hld->hgql", q, k) * c.scaling
        attention = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).mean(dim=(1, 2))
        n = L // 2
        truth = torch.zeros(H, L, dtype=torch.bool).scatter_(-1, attention.topk(n, -1).indices, True)
        score = -(k * filters[i][:, None]).sum(-1)
        for name, s in (("qfilter", score), ("opposite sign", -score), ("knorm", -k.norm(dim=-1))):
            top = torch.zeros(H, L, dtype=torch.bool).scatter_(-1, s.topk(n, -1).indices, True)
            recalls[name].append(float((top & truth).sum() / truth.sum()))
    print(f"{ids.shape[1]} tokens; recall of the top half by the last {args.window} queries' attention, "
          "mean over layers and heads:")
    for name, values in recalls.items():
        print(f"  {name:14s} {sum(values) / len(values):.3f}")


if __name__ == "__main__":
    main()
