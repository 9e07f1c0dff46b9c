#!/bin/bash
# On the lent GPU machine: random-weight models of real shapes with Qwen2.5's tokenizer
# (lab.gpu_real_shape; the weights' values do not change speed), then for each shape
#   1. what a JSON-schema constraint costs a greedy decode step at batch 1
#      (python -m runtime.bench.constrain --device cuda), and
#   2. our server on the GPU under bench-serve at C = 1, 8, 32 clients.
#   SHAPES="Q05 Q15" tests/gpu/device_real_shape.sh     (CONSTRAIN=0: the server part only)
# Carry: .devrun (wheels in .devrun/whl: gguf, platformdirs, llguidance, and the server's
# fastapi, starlette, uvicorn, pydantic, pydantic-core, annotated-types, typing-inspection,
# opentelemetry-api (fastapi imports it);
# qwen-tok.tok from tests/gpu/prepare_device.py).  Output goes to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/llamba-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devrun/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:$PWD/tests || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba-cache CUPY_CACHE_DIR=/tmp/cupy-cache
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.txt"
for S in ${SHAPES:-Q05 Q15}; do
  python3 -m lab.gpu_real_shape "$S" "/tmp/$S.gguf" --tokenizer .devrun/qwen-tok.tok || exit 1
  [ "${CONSTRAIN:-1}" = 0 ] || timeout ${CONSTRAIN_TIMEOUT:-150} python3 -m runtime.bench.constrain -m "/tmp/$S.gguf" --device cuda -n 64 -r 3 \
    2>&1 | tee "$OUT/constrain-$S.txt"
  python3 -m runtime serve -m "/tmp/$S.gguf" --device cuda -np 32 -c 4096 --port 18080 >"$OUT/serve-$S.log" 2>&1 &
  PID=$!
  for _ in $(seq 150); do curl -fs http://127.0.0.1:18080/health >/dev/null 2>&1 && break; sleep 1; done
  timeout ${SERVE_TIMEOUT:-200} python3 -m runtime bench-serve http://127.0.0.1:18080 -C ${CLIENTS:-1,8,32} \
    --requests 2 -n 128 2>&1 | tee "$OUT/serve-$S.txt"
  kill $PID; wait $PID 2>/dev/null
done
