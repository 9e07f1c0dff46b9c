#!/bin/bash
# On the lent GPU machine: the tensor-core route for batched decode (quant/cuda/NOTES.md,
# session 34), in one call:
#   1. lab.mma_exact: does the f16 MMA's fp32 accumulation keep integer sums exact;
#   2. lab.mma4k: the lab Q4_K kernels (mma4k_i8, mma4k_t<2>, mma4k_t<4>; Q6_K: mma6k_s, mma6k_k) bit for bit against each row's 1-row mvk4k, and timed
#      against mvk in forwards of at most 8 rows;
#   3. lab.gpu_rows: the product's matvecs at 1, 2, 4, 8 rows of x (mvk and mvs).
# Carry .devrun (its wheels: gguf, platformdirs).  ROWS=0 skips step 3.
OUT=${OUT:-/tmp/llamba-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .devrun/whl/gguf*.whl .devrun/whl/platformdirs*.whl && export PYTHONPATH=/tmp/site:$PWD:$PWD/tests || exit 1
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupy-cache
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 90 python3 -m lab.mma_exact 2>&1 | tee "$OUT/mma_exact.txt"
timeout 240 python3 -m lab.mma4k ${MMA4K_ARGS:-} 2>&1 | tee "$OUT/mma4k.txt"
[ "${ROWS:-1}" = 0 ] || timeout 200 python3 -m lab.gpu_rows 2>&1 | tee "$OUT/rows.txt"
