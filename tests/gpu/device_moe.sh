#!/bin/bash
# On the lent GPU machine: a mixture of experts' decode path routed on the device.
#   tests/gpu/device_moe.sh tests     the MoE GPU tests (test_moe_device_gpu.py: device routing
#                                      against host routing bit for bit, graphs, batch
#                                      invariance, the routing and id-indexed kernels; and
#                                      test_moe_gpu.py against the CPU)
#   tests/gpu/device_moe.sh bench     the Qwen3-30B-A3B shape (lab.synth M30, Q4_K_M, ~17 GiB,
#                                      written once to $M30) by llama.cpp's llama-bench (when
#                                      LLAMA_BENCH names a CUDA build of it), by Llamba, by
#                                      llama-bench again: tg128 and pp512 on the same file
#   tests/gpu/device_moe.sh all       both
# Carry .whl (gguf: tests/gpu/prepare_device.py) and the tokenizer-only GGUF ($TOK, default
# .devmodels/qwen-tok.tok or .devrun/qwen-tok.tok: llama.cpp and `runtime bench` load no file
# without a tokenizer).  Output (logs, JSON) goes to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/llamba-out}; mkdir -p "$OUT"
what=${1:-all}
for d in .whl .devrun/whl; do
  if [ -d "$d" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
      || exit 1
  fi
done
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba-cache
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
# each kernel compiled on first use (the tests touch every integer type's matvecs)
export LLAMBA_CUDA_LAZY=${LLAMBA_CUDA_LAZY:-1}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  # the CPU reference's Numba kernels compile for minutes on a fresh machine: into the cache
  # by a process of their own while the GPU-only tests run
  timeout ${TEST_TIMEOUT:-540} python3 -m lab.cpu_warm >"$OUT/cpu-warm.txt" 2>&1 &
  WARM=$!
  timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -m gpu tests/gpu/test_moe_device_gpu.py tests/gpu/test_moe_gpu.py \
    ${KEXPR:+-k "$KEXPR"} --maxfail=${MAXFAIL:-10} -rs --durations=10 -p no:cacheprovider 2>&1 | tee "$OUT/moe-tests.txt"
  wait $WARM
  cat "$OUT/cpu-warm.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  TOK=${TOK:-$(ls .devmodels/qwen-tok.tok .devrun/qwen-tok.tok 2>/dev/null | head -1)}
  M30=${M30:-/tmp/M30-Q4_K_M.gguf}
  if [ ! -f "$M30" ]; then
    python3 -m lab.synth M30 "$M30" --mix Q4_K_M ${TOK:+--tokenizer "$TOK"} 2>&1 | tee "$OUT/m30-write.txt" || exit 1
  fi
  REPS=${REPS:-3}
  # (a llama.cpp built against a stub libcuda needs the driver's preloaded)
  LIBCUDA=$(ldconfig -p | grep -m1 "libcuda.so.1 " | awk '{print $NF}')
  CUBLAS=$(dirname "$(find / -name 'libcublas.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")
  peer() {
    [ -n "$LLAMA_BENCH" ] && LD_PRELOAD=$LIBCUDA LD_LIBRARY_PATH=$(dirname "$LLAMA_BENCH"):$CUBLAS:$LD_LIBRARY_PATH \
      timeout ${PEER_TIMEOUT:-240} "$LLAMA_BENCH" -m "$M30" -ngl 99 -p 512 -n 128 -fa 1 -r "$REPS" \
      2>&1 | tee -a "$OUT/m30-llama-bench.txt"
  }
  peer
  # ours: decode steps routed on the device and replayed from CUDA graphs
  timeout ${BENCH_TIMEOUT:-300} python3 -m runtime bench -m "$M30" --device cuda -p 512 -n 128 -r "$REPS" --json \
    2>"$OUT/m30-llamba.log" | tee "$OUT/m30-llamba.json"
  tail -3 "$OUT/m30-llamba.log"
  peer
  # the host-routed path (before this change's decode), tg32 only, for the record
  if [ -n "$HOST_AB" ]; then
    LLAMBA_MOE_DEVICE=0 timeout 200 python3 -m runtime bench -m "$M30" --device cuda -p 0 -n 32 -r 1 --json \
      2>>"$OUT/m30-llamba.log" | tee "$OUT/m30-llamba-host.json"
  fi
  python3 - "$OUT" <<'EOF'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
ours = {r["test"]: r["t_s"] for r in json.loads((out / "m30-llamba.json").read_text() or "[]")}
peer = {}
f = out / "m30-llama-bench.txt"
for line in (f.read_text().splitlines() if f.exists() else []):
    m = re.search(r"\|\s*(pp512|tg128)\s*\|\s*([\d.]+)\s*±", line)
    if m:
        peer.setdefault(m.group(1), []).append(float(m.group(2)))
for test in ("pp512", "tg128"):
    o, p = ours.get(test), peer.get(test)
    ratio = f"{o / (sum(p) / len(p)):.2f}x llama.cpp (mean of its {len(p)} runs {p})" if o and p else "no llama.cpp figure"
    print(f"M30 Q4_K_M {test}: Llamba {o if o is None else round(o, 1)} t/s, {ratio}")
print("goal: tg128 >= 1.2x llama.cpp CUDA")
EOF
fi
