"""Why kvpress_ada's ExpectedAttention (+ Ada) and kvpress's disagree: one factor at a time.

Answers the samples of ``kvpress_compare.py`` (same tasks, n, context, seed) with kvpress_ada
pipelines only: our ``expected_attention`` / ``ada_expected_attention``, the exact replicas of
kvpress's presses (``*~kvpress``: their kept sets match kvpress's with Jaccard 1.000 in
``results/kvpress_compare.json``, so their accuracy stands in for kvpress's) and the one-factor
variants in between (``kvpress_compare.DIAGNOSTICS``). No kvpress virtualenv needed.

    python benchmarks/ea_ablation.py                 # n=12 per task, r in {0.25, 0.5}, both settings
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import kvpress_compare  # noqa: E402

METHODS = ("expected_attention", "ada_expected_attention")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="passkey,multikey")
    parser.add_argument("--n", type=int, default=12, help="samples per task (as kvpress_compare.py)")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--settings", default="agnostic,aware")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(common.RESULTS / "ea_ablation.json"))
    args = parser.parse_args(argv)

    from kvpress_ada.harness.eval.report import format_table
    from kvpress_ada.harness.eval.runner import evaluate, grid
    from kvpress_ada.harness.eval.tasks import make_samples

    common.set_threads(args.threads)
    model, tok = common.load_model("default")
    ratios = [float(r) for r in args.ratios.split(",")]
    samples = [s for t in args.tasks.split(",") for s in make_samples(t, tok, args.n, args.context, seed=0)]
    entries = grid(list(METHODS), ratios) + kvpress_compare.diagnostic_entries(ratios, METHODS, ea_ablation=True)
    payload = {"machine": common.machine_info(), "date": common.now_iso(), "args": vars(args),
               "variants": {k: v[1] for k, v in kvpress_compare.DIAGNOSTICS.items() if k.split("~")[0] in METHODS},
               "settings": {}}
    for setting in args.settings.split(","):
        start = time.perf_counter()
        result = evaluate(model, tok, samples, entries, question_aware=setting == "aware",
                          max_new_tokens=args.max_new_tokens)
        summary = result.summary()
        print(f"\n== {setting} ==\n{format_table(summary)}")
        payload["settings"][setting] = {"wall_seconds": time.perf_counter() - start, "summary": summary,
                                        "records": result.to_dict()["records"]}
        common.write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
