#!/usr/bin/env bash
# One GPU session on a bare CUDA machine without internet (the project's H200 runs):
# install the carried FlashInfer wheels (../shared/tools/gpu-wheels.sh .whl), install dllm
# without dependencies (the machine's torch/transformers are used), run the GPU tests, then
# the offline benchmark. Results go to $OUT (or bench/results). Carry .whl and .jit.
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
# FlashInfer compiles its kernels on first use (minutes): reuse a cache brought back from an
# earlier run (.jit/fi-jit.tgz, carried), and hand the cache back in $OUT for the next one.
# Every module builds in one shared ninja directory, and each module's build drops the
# others' entries from its dependency log, so ninja rebuilds a module in every new process
# (about a minute each, seen as slow GPU tests): install the cached libraries as FlashInfer's
# ahead-of-time modules instead, which it loads without ninja.
if [ -f .jit/fi-jit.tgz ]; then mkdir -p "$FLASHINFER_WORKSPACE_BASE" && \
  tar xzf .jit/fi-jit.tgz -C "$FLASHINFER_WORKSPACE_BASE" && \
  for so in "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    name=$(basename "$so" .so); mkdir -p "/tmp/site/flashinfer/data/aot/$name" && \
    cp "$so" "/tmp/site/flashinfer/data/aot/$name/"; done; fi
# Triton's kernel cache (the project's own kernels) travels the same way.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .jit/triton-cache.tgz ] && tar xzf .jit/triton-cache.tgz -C "$TRITON_CACHE_DIR"
# At most 8 files come back from a device call: the profiler traces stay there and the logs
# travel as one archive.
trap 'tar czf "$OUT/fi-jit.tgz" -C "$FLASHINFER_WORKSPACE_BASE" .cache 2>/dev/null; \
  tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null; \
  rm -f "$OUT"/trace-*.json; (cd "$OUT" && ls ./*.log >/dev/null 2>&1 && \
  tar czf logs.tgz ./*.log && rm -f ./*.log)' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# The GPU's clocks, power and temperature twice a second for the whole session (clocks.log in
# logs.tgz): whether a slow kernel ran at a lower clock.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\
clocks_throttle_reasons.active --format=csv -lms 500 > "$OUT/clocks.log" 2>&1 &
# How long a fresh process takes to import FlashInfer and load (or build) one JIT module: the
# GPU tests were slow even with the cache present (bench/NOTES.md).
timeout 300 python3 -c "import time; t = time.time(); import flashinfer; \
print(f'import flashinfer: {time.time() - t:.1f} s'); from flashinfer.norm import get_norm_module; \
t = time.time(); get_norm_module(); print(f'norm module: {time.time() - t:.1f} s')"
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0 skips the GPU tests (all of them: ~6-7 min cold)
  timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -v -p no:cacheprovider -rs --durations=0 \
    -m gpu ${TEST_FILES:-tests/test_gpu*.py tests/kernels/test_*.py tests/test_algorithms.py} 2>&1 | tee "$OUT/gpu-tests.log"
fi
# Kernel microbenchmarks (bench/kernels/), one per ';'-separated "script args" entry, e.g.
# MICRO="skinny_gemm.py --sweep; triton_attention.py"
IFS=';' read -ra micros <<< "${MICRO:-}"
for i in "${!micros[@]}"; do
  # shellcheck disable=SC2086
  timeout "${MICRO_TIMEOUT:-200}" python3 bench/kernels/${micros[$i]} --out "$OUT" \
    2>&1 | tee "$OUT/micro-$i.log"
done
if [ -n "${GEMM_ARGS:-}" ]; then  # e.g. GEMM_ARGS="--tokens 1,4,512"
  # shellcheck disable=SC2086
  timeout "${GEMM_TIMEOUT:-120}" python3 bench/kernels/gemm_shapes.py --out "$OUT" $GEMM_ARGS \
    2>&1 | tee "$OUT/gemm.log"
fi
if [ $# -gt 0 ]; then  # the offline benchmark's arguments; none skips it
  timeout "${BENCH_TIMEOUT:-400}" python3 bench/engine/offline.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
fi
# One profile per ';'-separated argument list, e.g.
# PROFILE_ARGS="--model sdar-8b --batch-size 128; --model sdar-8b --batch-size 1"
IFS=';' read -ra profiles <<< "${PROFILE_ARGS:-}"
for i in "${!profiles[@]}"; do
  # shellcheck disable=SC2086
  timeout "${PROFILE_TIMEOUT:-150}" python3 bench/engine/profile_step.py --out "$OUT" ${profiles[$i]} \
    2>&1 | tee "$OUT/profile-$i.log"
done
if [ -n "${ONLINE_MODEL:-}" ]; then  # e.g. ONLINE_MODEL=sdar-8b ONLINE_ARGS="--concurrency 32"
  # The server's packages (fastapi, uvicorn, pydantic, ...) are not on the GPU image: carry
  # them as wheels in .whl-server (see bench/NOTES.md).
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl-server/*.whl || exit 1
  ckpt=$(python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'bench/engine'); \
from offline import checkpoint_dir; print(checkpoint_dir('$ONLINE_MODEL', Path('/tmp/ckpt')))")
  python3 -m dllm.server.cli serve --model "$ckpt" --load-format dummy --port 8000 \
    --context-length 4096 --max-running-requests "${ONLINE_MAX_RUNNING:-64}" \
    > "$OUT/server.log" 2>&1 &
  server=$!
  for _ in $(seq 300); do  # until the server answers (model load and graph capture)
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', \
timeout=1)" 2>/dev/null && break
    kill -0 "$server" 2>/dev/null || break  # the server died: its log says why
    sleep 1
  done
  # shellcheck disable=SC2086
  timeout "${ONLINE_TIMEOUT:-200}" python3 bench/engine/online.py --out "$OUT" ${ONLINE_ARGS:-} \
    2>&1 | tee "$OUT/online.log"
  kill "$server"
fi
