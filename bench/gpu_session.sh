#!/usr/bin/env bash
# One GPU session on a bare CUDA machine without internet (the project's H200 runs):
# install the carried FlashInfer wheels (../shared/tools/gpu-wheels.sh .whl), install dllm
# without dependencies (the machine's torch/transformers are used), run the GPU tests, then
# the offline benchmark. Results go to $OUT (or bench/results).
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
  2>&1 | tee "$OUT/gpu-tests.log"
timeout "${BENCH_TIMEOUT:-400}" python3 bench/offline.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
