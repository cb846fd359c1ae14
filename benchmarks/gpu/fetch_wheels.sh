#!/usr/bin/env bash
# Fetch, here, the wheels the GPU machine lacks for benchmarks/gpu/run_all.sh, into .whl/ at the repo root (ignored;
# the device call carries it and run_all.sh installs it with --target). One pinned version of each, CPython 3.12
# manylinux x86_64 or pure Python, then checked against that machine's image (benchmarks/gpu/wheels.py check).
#   bash benchmarks/gpu/fetch_wheels.sh          # PYTHON=... to use another interpreter's pip
# The image has Python 3.12, torch 2.11, Triton 3.6, transformers 5.17 (pyproject.toml admits >= 5.18), numpy,
# safetensors 0.8.0, tokenizers 0.23.2, huggingface-hub 1.33.0, pyyaml; no pydantic.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=(
    transformers==5.18.0        # the oldest release pyproject.toml admits: its huggingface-hub (>=1.31) is the image's
    pydantic==2.14.4            # not on the image
    pydantic-core==2.50.5       # pydantic 2.14.4 pins it (compiled: cp312)
    annotated-types==0.8.0      # pydantic's, not on the image
    typing-inspection==0.4.5    # pydantic's, not on the image
    typing-extensions==4.16.0   # pydantic 2.14.4 needs >= 4.16.0; the image's version is unknown
    regex==2026.11.19           # transformers needs >= 2025.10.22; the image's version is unknown (compiled: cp312)
    tqdm==4.70.1                # transformers needs >= 4.60, kvpress_ada imports it; the image's version is unknown
)
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
"$PY" benchmarks/gpu/wheels.py check .whl
