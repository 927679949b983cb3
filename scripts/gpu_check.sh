#!/usr/bin/env bash
# Check the CUDA path (nccl engine, CUDA tensors, DistributedOptimizer, DistributedDataParallel, NVML)
# on a machine with NVIDIA GPUs, in at most 5 minutes. Prints PASS/FAIL lines; exits 0 only when all pass.
#   bash scripts/gpu_check.sh            # with .venv/bin/python if there is one, else $PYTHON or python3
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" timeout --kill-after=10 300 "$PYTHON" scripts/gpu_check.py
status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "FAIL gpu_check: did not finish within 5 minutes"
fi
exit "$status"
