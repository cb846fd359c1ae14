"""Write the summary of a benchmark result: the same JSON without its per-sample records.

Per-sample records (``records``, ``samples``, per-step ``series``, generated ``tokens``, the per-sample
kept-set overlaps ``overlap_samples`` of a kvpress comparison) stay out of
git; the summary beside them (``X.json`` -> ``X.summary.json``) is what the README tables cite.
A key is dropped at any depth (e.g. ``settings.agnostic.records``) when it holds a list or a map.

    python benchmarks/summarize.py benchmarks/results/quality_agnostic.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PER_SAMPLE = frozenset({"records", "samples", "series", "tokens", "overlap_samples"})


def summary(payload: dict) -> dict:
    """``payload`` without its per-sample lists and maps, at any depth (counts and scalars stay)."""
    return {key: summary(value) if isinstance(value, dict) else value for key, value in payload.items()
            if not (key in PER_SAMPLE and isinstance(value, (list, dict)))}


def summary_path(path: Path) -> Path:
    return path.with_name(path.stem + ".summary.json")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.inputs:
        if path.name.endswith(".summary.json"):
            print(f"summarize.py: {path} is already a summary", file=sys.stderr)
            return 2
        out = summary_path(path)
        common.write_json(out, summary(json.loads(path.read_text())))
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
