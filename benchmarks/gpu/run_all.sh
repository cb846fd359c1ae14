#!/usr/bin/env bash
# Every GPU check and benchmark in one go (a lent GPU machine has minutes, not hours).
#   OUT=/some/dir bash benchmarks/gpu/run_all.sh
# Writes gpu_kernels.json, gpu_quantized.json, gpu_e2e.json, gpu_kernels_sweep.json and their logs under $OUT.
set -u -o pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
timeout "${KERNELS_TIMEOUT:-120}" python3 benchmarks/gpu/bench_kernels.py --out "$OUT/gpu_kernels.json" 2>&1 | tee "$OUT/kernels.log" || status=1
timeout "${QUANTIZED_TIMEOUT:-90}" python3 benchmarks/gpu/bench_quantized.py --out "$OUT/gpu_quantized.json" 2>&1 \
    | tee "$OUT/quantized.log" || status=1
timeout "${E2E_TIMEOUT:-240}" python3 benchmarks/gpu/bench_e2e.py --out "$OUT/gpu_e2e.json" 2>&1 | tee "$OUT/e2e.log" || status=1
timeout "${SWEEP_TIMEOUT:-120}" python3 benchmarks/gpu/bench_kernels.py --sweep --no-check --contexts 32768 \
    --out "$OUT/gpu_kernels_sweep.json" 2>&1 | tee "$OUT/sweep.log" || status=1
exit $status
