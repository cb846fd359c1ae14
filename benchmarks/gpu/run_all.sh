#!/usr/bin/env bash
# Every GPU check and benchmark in one go, within one device call (a lent GPU machine has minutes, not hours).
#   bash benchmarks/gpu/run_all.sh                 # on the GPU machine: OUT is set by the device tool
#   OUT=/some/dir bash benchmarks/gpu/run_all.sh   # elsewhere (default OUT: benchmarks/results)
#   bash benchmarks/gpu/run_all.sh --cpu-smoke     # each script's --cpu-smoke path (benchmarks/gpu/dry_run.sh)
# First installs .whl/*.whl (benchmarks/gpu/fetch_wheels.sh: pydantic, a transformers pyproject.toml admits, ...)
# with --target into /tmp/site, when .whl/ holds wheels. Then the steps, each under its own timeout and all under
# TOTAL_BUDGET seconds (default 420) from the start. Writes, under $OUT, 5 files (the device call brings back 8 at
# most): gpu_kernels.json, gpu_quantized.json, gpu_e2e.json, gpu_kernels_sweep.json (each step's JSON is written as
# it goes; a step that stops early leaves what it measured, or {"error": ...} if nothing) and run_all.log (all output).
# Overrides: KERNELS_TIMEOUT QUANTIZED_TIMEOUT E2E_TIMEOUT SWEEP_TIMEOUT TOTAL_BUDGET (s); PYTHON (runs the scripts),
# PIP_PYTHON (runs pip), WHEEL_DIR (default .whl), WHEEL_SITE (default /tmp/site).
set -u -o pipefail
cd "$(dirname "$0")/../.."
SMOKE=()
case "${1:-}" in
    "") ;;
    --cpu-smoke) SMOKE=(--cpu-smoke) ;;
    *) echo "run_all.sh: unknown argument '$1' (accepted: --cpu-smoke)"; exit 2 ;;
esac
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${TOTAL_BUDGET:-420}))
PY=${PYTHON:-python3}
PIP_PY=${PIP_PYTHON:-$PY}
WHEEL_DIR=${WHEEL_DIR:-.whl}
WHEEL_SITE=${WHEEL_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/run_all.log") 2>&1
TEE_PID=$!
status=0

shopt -s nullglob
wheels=("$WHEEL_DIR"/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -gt 0 ]; then
    t0=$SECONDS
    if timeout 120 "$PIP_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WHEEL_SITE" "${wheels[@]}"; then
        echo "== installed ${#wheels[@]} wheels from $WHEEL_DIR into $WHEEL_SITE in $((SECONDS - t0)) s"
    else
        echo "== WHEEL INSTALL FAILED (exit $?) after $((SECONDS - t0)) s: the steps below run without them"
        status=1
    fi
    export PYTHONPATH=$WHEEL_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    echo "== no $WHEEL_DIR/*.whl: the interpreter's own packages (bash benchmarks/gpu/fetch_wheels.sh fetches the wheels)"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if [ ${#SMOKE[@]} -eq 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
fi
timeout 60 "$PY" -c "
import sys, torch, triton, transformers, pydantic, kvpress_ada
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__, 'pydantic', pydantic.__version__)
print('transformers from', transformers.__file__, '| kvpress_ada from', kvpress_ada.__file__)
print('preset:', type(kvpress_ada.preset('ada_snapkv', compression_ratio=0.5)).__name__)
" || { echo "== IMPORT CHECK FAILED (exit $?)"; status=1; }

# step NAME JSON CAP_S ARGS...: run one script under min(CAP_S, time left), then make sure JSON exists
step() {
    local name=$1 json=$OUT/$2 cap=$3 rc=0 t0=$SECONDS why
    shift 3
    local left=$((DEADLINE - SECONDS))
    local t=$((cap < left ? cap : left))
    if [ "$t" -lt 15 ]; then
        why="skipped: $left s left of TOTAL_BUDGET"
        status=1
    else
        echo "== $name (timeout $t s): $*"
        timeout -k 10 "$t" "$PY" "$@" "${SMOKE[@]}" --out "$json" || rc=$?
        why="exit $rc after $((SECONDS - t0)) s$(case $rc in 124 | 137) echo " (its timeout, $t s)" ;; esac)"
        [ "$rc" = 0 ] || status=1
    fi
    echo "== $name: $why"
    [ -s "$json" ] || printf '{"benchmark": "%s", "error": "no result: %s"}\n' "$name" "$why" > "$json"
}
step kernels gpu_kernels.json "${KERNELS_TIMEOUT:-90}" benchmarks/gpu/bench_kernels.py
step quantized gpu_quantized.json "${QUANTIZED_TIMEOUT:-90}" benchmarks/gpu/bench_quantized.py
step e2e gpu_e2e.json "${E2E_TIMEOUT:-170}" benchmarks/gpu/bench_e2e.py --check-first
step sweep gpu_kernels_sweep.json "${SWEEP_TIMEOUT:-70}" benchmarks/gpu/bench_kernels.py --sweep --no-check \
    --contexts 32768
echo "== run_all: exit $status after $SECONDS s"
exec >&- 2>&-
wait "$TEE_PID"  # the log is complete before the call returns
exit $status
