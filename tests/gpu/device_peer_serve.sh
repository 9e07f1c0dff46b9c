#!/bin/bash
# On the lent GPU machine: our server and llama.cpp's CUDA llama-server on the same
# random-weight GGUF of a real shape (Qwen's tokenizer), the same bench-serve run against both,
# client counts interleaved, plus llama-bench and our bench at batch 1 on the same file.
#   LLAMA=/path/to/llama.cpp/bin SHAPES="Q15 L8" CLIENTS=1,8,32 tests/gpu/device_peer_serve.sh
# LLAMA holds llama-server and llama-bench (a CUDA build of llama.cpp; its cuBLAS is found
# through LD_LIBRARY_PATH).  Carry: .devrun (wheels in .devrun/whl, qwen-tok.tok; see
# device_real_shape.sh).  Output goes to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/llamba-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devrun/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:$PWD/tests || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba-cache CUPY_CACHE_DIR=/tmp/cupy-cache
CUBLAS=$(dirname "$(find / -name 'libcublas.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")
# a build linked against a stub libcuda (built without a GPU, quant/cuda/NOTES.md) needs the
# driver's preloaded: its libggml-cuda.so does not name libcuda.so.1
LIBCUDA=$(ldconfig -p | grep -m1 "libcuda.so.1 " | awk '{print $NF}')
PEER_ENV=(env LD_PRELOAD="$LIBCUDA" LD_LIBRARY_PATH="$LLAMA:$CUBLAS:$LD_LIBRARY_PATH")
NP=${NP:-32}
for S in ${SHAPES:-Q15}; do
  M=/tmp/$S.gguf
  [ -f "$M" ] || python3 -m lab.gpu_real_shape "$S" "$M" --tokenizer .devrun/qwen-tok.tok >/dev/null || exit 1
  if [ "${BATCH1:-1}" = 1 ]; then
    timeout 120 "${PEER_ENV[@]}" "$LLAMA/llama-bench" -m "$M" -ngl 99 -p 512 -n 128 -fa 1 -r 3 2>&1 | tee "$OUT/llama-bench-$S.txt"
    timeout 150 python3 -m runtime bench -m "$M" --device cuda -p 512 -n 128 -r 3 2>&1 | tee "$OUT/bench-$S.txt"
  fi
  python3 -m runtime serve -m "$M" --device cuda -np "$NP" -c 4096 --port 18080 >"$OUT/serve-$S.log" 2>&1 &
  OURS=$!
  "${PEER_ENV[@]}" "$LLAMA/llama-server" -m "$M" -ngl 99 -np "$NP" -c $((4096 * NP)) --port 18081 >"$OUT/llama-server-$S.log" 2>&1 &
  PEER=$!
  for p in 18080 18081; do
    for _ in $(seq 200); do curl -fs http://127.0.0.1:$p/health >/dev/null 2>&1 && break; sleep 1; done
  done
  for C in ${CLIENTS//,/ }; do
    for p in 18080 18081; do
      timeout ${SERVE_TIMEOUT:-120} python3 -m runtime bench-serve http://127.0.0.1:$p -C "$C" \
        --requests ${REQUESTS:-2} -n 128 2>&1 | tee -a "$OUT/serve-$S-$p.txt"
    done
  done
  kill $OURS $PEER; wait $OURS $PEER 2>/dev/null
done
