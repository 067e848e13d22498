#!/usr/bin/env bash
# Builds bench/kernels/cutlass_gemm.py's probe library: CUTLASS 3 (sm90a) bf16 GEMMs, one
# object a configuration, linked into one shared library with the CUDA runtime static, so it
# loads through ctypes into any torch. CUTLASS's headers come from FlashInfer's wheel.
#
#   bash bench/kernels/cutlass/build.sh WHEEL_OR_CUTLASS_DIR OUT.so [JOBS]
#
# A configuration is TM-TN-SCHED: the weight rows (64: ping-pong, 128: cooperative) and the
# token columns of a tile (the operands are swapped: the weights are CUTLASS's A), SCHED
# "p" (persistent) or "s" (stream-K). CONFIGS overrides the list.
set -euo pipefail
src=$(cd "$(dirname "$0")" && pwd)/gemm_sm90.cu
in=$1 out=$2 jobs=${3:-2}
if [[ -f $in ]]; then
    tmp=$(mktemp -d); unzip -q "$in" 'flashinfer/data/cutlass/include/*' \
        'flashinfer/data/cutlass/tools/util/include/*' -d "$tmp"; cut=$tmp/flashinfer/data/cutlass
else
    cut=$in
fi
CONFIGS=${CONFIGS:-"$(for n in 64 96 128 160 192 224 256; do echo 128-$n-p 128-$n-s 64-$n-p; done)"}
work=$(mktemp -d)
build() {
    IFS=- read -r tm tn sched <<<"$1"
    local name=g_${tm}_${tn}_${sched} extra=()
    [[ $sched == s ]] && extra+=(-DSTREAMK)
    nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
        -I"$cut/include" -I"$cut/tools/util/include" -DTM="$tm" -DTN="$tn" "${extra[@]}" \
        -DNAME_ws="${name}_ws" -DNAME_run="${name}_run" -Xcompiler -fPIC -c "$src" \
        -o "$work/$name.o" 2> >(grep -v "compute_" >&2)
    echo "built $name"
}
export -f build; export src cut work
printf '%s\n' $CONFIGS | xargs -P "$jobs" -I{} bash -c 'build {}'
nvcc -shared -cudart static -gencode arch=compute_90a,code=sm_90a "$work"/*.o -o "$out"
echo "$out: $(printf '%s\n' $CONFIGS | wc -l) configurations"
