#!/bin/bash
# On the lent GPU machine: where a `--cpu-moe` decode token's time goes, and the MoE benches.
#   tests/gpu/device_cpu_moe.sh
# 1. the machine's CPU (model, cores, AVX-512 VNNI) and Numba's threading layer;
# 2. lab.cpu_moe_probe: the host half of one token's moe op a layer (the experts' kernels and
#    Numba's dispatch), at THREADS (default "16 8"), and the memory's read rate;
# 3. the Qwen3-30B-A3B shape (lab.synth M30, Q4_K_M): `bench --cpu-moe` at each thread count
#    and all on the GPU (THREADS "auto": no -t, the backend's default); with LLAMA_BENCH (a CUDA build of llama.cpp's llama-bench) the same
#    file by llama.cpp before and after ours (-ncmoe 99, and all on the GPU);
# PROBE=0 skips step 2, GPU_ALL=0 the all-GPU run of step 3.
# 4. with G20=1, gpt-oss-20b's shape in MXFP4 (lab.synth G20 --mix MXFP4_MOE), both sides.
# Carry .devrun (wheels in .devrun/whl, qwen-tok.tok: tests/gpu/prepare_device.py --devrun).  Output in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/llamba-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devrun/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:$PWD/tests || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba-cache CUPY_CACHE_DIR=/tmp/cupy-cache LLAMBA_CUDA_LAZY=1
TOK=${TOK:-.devrun/qwen-tok.tok}
REPS=${REPS:-3}
LIBCUDA=$(ldconfig -p | grep -m1 "libcuda.so.1 " | awk '{print $NF}')
CUBLAS=$(dirname "$(find / -name 'libcublas.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")
peer() {   # llama-bench ARGS...: llama.cpp (built against a stub libcuda: the driver's preloaded)
  [ -n "$LLAMA_BENCH" ] || return 0
  LD_PRELOAD=$LIBCUDA LD_LIBRARY_PATH=$(dirname "$LLAMA_BENCH"):$CUBLAS:$LD_LIBRARY_PATH \
    timeout ${PEER_TIMEOUT:-200} "$LLAMA_BENCH" "$@" 2>&1 | grep -E "^\||error" | tee -a "$OUT/llama-bench.txt"
}
{
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L3"
  grep -o -E "avx512_vnni|avx512vbmi|amx_tile|avx_vnni" /proc/cpuinfo | sort | uniq -c
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "
import numba, quant.matmul_cpu as m
from numba.np.ufunc.parallel import _launch_threads
_launch_threads()
print('numba', numba.__version__, 'threading layer', numba.threading_layer(), 'threads', numba.get_num_threads(), 'USE_VNNI', m.USE_VNNI)"
} 2>&1 | tee "$OUT/machine.txt"
M30=/tmp/M30.gguf
[ -f "$M30" ] || python3 -m lab.synth M30 "$M30" --mix Q4_K_M --tokenizer "$TOK" > "$OUT/m30-write.txt" 2>&1 &
WRITE=$!
for T in $([ "${PROBE:-1}" = 1 ] && echo ${THREADS:-16 8}); do
  timeout 240 python3 -m lab.cpu_moe_probe --threads "$T" --layers 4 --steps 300 2>&1 | tee -a "$OUT/probe.txt"
done
wait $WRITE; cat "$OUT/m30-write.txt"
peer -m "$M30" -ngl 99 -ncmoe 99 -p 0 -n 32 -r "$REPS"
for T in ${THREADS:-16 8}; do
  echo "== ours --cpu-moe -t $T" | tee -a "$OUT/bench.txt"
  timeout 200 python3 -m runtime bench -m "$M30" --device cuda --cpu-moe $([ "$T" = auto ] || echo "-t $T") \
    -p 0 -n 32 -r "$REPS" 2>&1 \
    | tail -4 | tee -a "$OUT/bench.txt"
done
peer -m "$M30" -ngl 99 -ncmoe 99 -p 0 -n 32 -r "$REPS"
if [ "${GPU_ALL:-1}" = 1 ]; then
  peer -m "$M30" -ngl 99 -p 0 -n 128 -fa 1 -r "$REPS"
  echo "== ours all on the GPU" | tee -a "$OUT/bench.txt"
  timeout 200 python3 -m runtime bench -m "$M30" --device cuda -p 0 -n 128 -r "$REPS" 2>&1 | tail -3 | tee -a "$OUT/bench.txt"
  peer -m "$M30" -ngl 99 -p 0 -n 128 -fa 1 -r "$REPS"
fi
if [ "${G20:-0}" = 1 ]; then
  rm -f "$M30"
  G=/tmp/G20.gguf
  [ -f "$G" ] || python3 -m lab.synth G20 "$G" --mix MXFP4_MOE --tokenizer "$TOK" 2>&1 | tee -a "$OUT/g20-write.txt"
  peer -m "$G" -ngl 99 -p 512 -n 128 -fa 1 -r "$REPS"
  echo "== ours G20 MXFP4" | tee -a "$OUT/bench.txt"
  timeout 200 python3 -m runtime bench -m "$G" --device cuda -p 512 -n 128 -r "$REPS" 2>&1 | tail -4 | tee -a "$OUT/bench.txt"
  peer -m "$G" -ngl 99 -p 512 -n 128 -fa 1 -r "$REPS"
fi
