#!/usr/bin/env bash
# Dry run, here, of the GPU call: the wheels of .whl/ installed with --target into a fresh folder, a bare interpreter
# that sees only a stand-in for the GPU machine's image, then `run_all.sh --cpu-smoke` (each GPU script's --cpu-smoke
# path: CPU tensors, the Triton interpreter, tiny shapes). It proves the wheels are complete for `import kvpress_ada`
# and for the scripts' imports; it measures nothing.
#   bash benchmarks/gpu/fetch_wheels.sh && bash benchmarks/gpu/dry_run.sh
# - Wheels: each pure-Python wheel of .whl/ as it is; each compiled one (cp312 there) replaced by this machine's build
#   of the same version (pip download NAME==VERSION for this interpreter).
# - Image stand-in: a fresh venv without site packages; on its PYTHONPATH, this interpreter's packages that the image
#   also holds (benchmarks/gpu/wheels.py base: torch, triton, numpy, ...), under the image's own versions of what
#   transformers checks at import (transformers 5.17.0, huggingface-hub 1.33.0, tokenizers 0.23.2) and no pydantic.
# PYTHON: the interpreter whose packages stand in for the image (default .venv/bin/python, else python3).
# Leaves its output (run_all.log and the four JSONs) in the folder it prints; removes the rest.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo "$REPO/.venv/bin/python" || echo python3)}
IMAGE_PINS=(transformers==5.17.0 huggingface-hub==1.33.0 tokenizers==0.23.2 httpx==0.28.1 httpcore==1.0.9)
[ -d .whl ] || { echo "dry_run.sh: no .whl/ folder: run bash benchmarks/gpu/fetch_wheels.sh first"; exit 1; }
"$PY" benchmarks/gpu/wheels.py check .whl
TMP=$(mktemp -d /tmp/gpu_dry_run.XXXXXX)
pip_get() { "$PY" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check "$@" 2>&1 \
    | grep -v "^WARNING: Location" || true; }

echo "== wheels for this interpreter ($("$PY" -c 'import sys; print(sys.version.split()[0])')) in $TMP/wheels"
mkdir -p "$TMP/wheels"
for w in .whl/*.whl; do
    base=$(basename "$w")
    case "$base" in
        *-none-any.whl) cp "$w" "$TMP/wheels/" ;;
        *) name=${base%%-*}; rest=${base#*-}; version=${rest%%-*}
           pip_get -d "$TMP/wheels" "$name==$version"
           echo "   $base -> $(cd "$TMP/wheels" && ls "$name"-"$version"-*.whl)" ;;
    esac
done
[ "$(ls "$TMP/wheels" | wc -l)" = "$(ls .whl/*.whl | wc -l)" ] || { echo "dry_run.sh: a wheel is missing"; exit 1; }

echo "== image stand-in: a bare venv, $TMP/base (links) under $TMP/pins (${IMAGE_PINS[*]})"
"$PY" -m venv --without-pip "$TMP/venv"
"$PY" benchmarks/gpu/wheels.py base "$TMP/base"
pip_get -d "$TMP/pin_wheels" "${IMAGE_PINS[@]}"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TMP/pins" "$TMP"/pin_wheels/*.whl
export PYTHONPATH=$TMP/pins:$TMP/base
echo "== without the wheels (as on the GPU machine before the install):"
(cd /tmp && "$TMP/venv/bin/python" -c "
import importlib.util, sys, transformers
sys.path.insert(0, '$REPO')
assert importlib.util.find_spec('pydantic') is None, 'the stand-in has pydantic: the image has not'
print('   transformers', transformers.__version__, '(the image: 5.17.0), pydantic absent')
import kvpress_ada
try:
    kvpress_ada.preset('ada_snapkv', compression_ratio=0.5)
    print('   kvpress_ada.preset ran without the wheels: the dry run proves nothing'); sys.exit(1)
except ImportError as e:
    print('   kvpress_ada.preset fails:', type(e).__name__, e)
")

echo "== run_all.sh --cpu-smoke with the wheels"
rc=0
PYTHON=$TMP/venv/bin/python PIP_PYTHON=$PY WHEEL_DIR=$TMP/wheels WHEEL_SITE=$TMP/site OUT=$TMP/out \
    bash benchmarks/gpu/run_all.sh --cpu-smoke || rc=$?
rm -rf "$TMP/wheels" "$TMP/pin_wheels" "$TMP/site" "$TMP/pins" "$TMP/base" "$TMP/venv"
echo "== dry run: run_all.sh exit $rc; output in $TMP/out:"
for f in "$TMP"/out/*.json; do
    "$PY" -c "
import json, sys
d = json.load(open(sys.argv[1]))
print('   %-26s %s' % (sys.argv[1].rsplit('/', 1)[1], d.get('error') or ('complete' if d.get('complete') else 'INCOMPLETE')))
" "$f"
done
exit $rc
