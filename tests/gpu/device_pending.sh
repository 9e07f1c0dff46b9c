#!/bin/bash
# On the lent GPU machine: the pending diffs (tests/lab/pending: mvf-tiny, mma-decode) and what
# decides them, each step time-boxed (DEADLINE seconds in all, default 540):
#  0. mvf-tiny: its test, then M30 tg128 with it and without (LLAMBA_MVF_UT=2) between two
#     llama-bench runs (the model written while step 1 runs);
#  1. mma-decode's kernels and a model's 32-row step bit for bit (tests/gpu/test_mma_rows_gpu.py);
#  2. a 32-row L8 decode step with it (the _w kernels, then the one-warp walks) and without it
#     (lab.serve_engine --exact, LLAMBA_MMA=0: four 8-row forwards, as served): it lands if
#     clearly faster (session 36, mma4k: 1106 tok/s against ~1030 estimated from 8-row steps);
#  3. with SERVE=1 (once 2 shows it faster): L8 serving, ours and llama-server -np 32, 32 then
#     1 clients, same file.
# Carry .devrun (wheels in .devrun/whl, qwen-tok.tok: tests/gpu/prepare_device.py --devrun) and .devpeer
# (llbin.tar.xz: tests/gpu/build_peer_cuda.sh).  Output in $OUT.
# A call made within ~30 s of the last one finds the machine warm, /tmp included: a model
# written by a `setsid` process outlives the call that started it (quant/cuda/NOTES.md, session 36).
OUT=${OUT:-/tmp/llamba-out}; mkdir -p "$OUT"
T0=$SECONDS
DEADLINE=${DEADLINE:-540}
left() { echo $((DEADLINE - (SECONDS - T0))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devrun/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:$PWD/tests || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba-cache CUPY_CACHE_DIR=/tmp/cupy-cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
mkdir -p /tmp/ll && tar -xJf .devpeer/llbin.tar.xz -C /tmp/ll
LIBCUDA=$(ldconfig -p | grep -m1 "libcuda.so.1 " | awk '{print $NF}')
CUBLAS=$(dirname "$(find / -name 'libcublas.so.13' -not -path '/proc/*' 2>/dev/null | head -1)")
PENV=(env LD_PRELOAD=$LIBCUDA LD_LIBRARY_PATH=/tmp/ll:$CUBLAS:$LD_LIBRARY_PATH)
for d in mvf-tiny mma-decode; do git apply tests/lab/pending/$d.diff || { echo "PATCH $d FAILED"; exit 1; }; done
([ -s /tmp/L8.gguf ] || python3 -m lab.gpu_real_shape L8 /tmp/L8.gguf --tokenizer .devrun/qwen-tok.tok
 [ -s /tmp/M30.gguf ] || python3 -m lab.synth M30 /tmp/M30.gguf --mix Q4_K_M --tokenizer .devrun/qwen-tok.tok) > "$OUT/write.txt" 2>&1 &
timeout 90 python3 -m pytest -q tests/gpu/test_quant_kernels.py -k "router or float_weight" -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/tests-mvf.txt"
timeout 200 python3 -m pytest -q -x tests/gpu/test_mma_rows_gpu.py -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/tests-mma.txt"
MMA_OK=${PIPESTATUS[0]}
echo "== mma tests rc $MMA_OK at $((SECONDS-T0)) s" | tee -a "$OUT/log.txt"
wait
for cfg in "LLAMBA_MMA=1" "LLAMBA_MMA=1 LLAMBA_MMA4K=mma4k LLAMBA_MMA6KS=mma6k_s" "LLAMBA_MMA=0"; do
  echo "== $cfg" | tee -a "$OUT/engine.txt"
  env $cfg timeout 100 python3 -m lab.serve_engine -m /tmp/L8.gguf --device cuda -B 32 --rounds 2 --steps 10 --exact 2>&1 \
    | tail -1 | tee -a "$OUT/engine.txt"
done
M30B=(timeout 90 /tmp/ll/llama-bench -m /tmp/M30.gguf -ngl 99 -p 0 -n 128 -fa 1 -r 2)
"${PENV[@]}" "${M30B[@]}" 2>&1 | grep -E "^\||error" | tee -a "$OUT/M30.txt"
for ut in 8 2; do
  LLAMBA_MVF_UT=$ut timeout 150 python3 -m runtime bench -m /tmp/M30.gguf --device cuda -p 0 -n 128 -r 2 2>&1 | tail -1 | sed "s/^/UT=$ut /" | tee -a "$OUT/M30.txt"
done
"${PENV[@]}" "${M30B[@]}" 2>&1 | grep -E "^\||error" | tee -a "$OUT/M30.txt"
if [ "${SERVE:-0}" = 1 ] && [ "$MMA_OK" = 0 ] && [ $(left) -gt 150 ]; then
  python3 -m runtime serve -m /tmp/L8.gguf --device cuda -np 32 -c 4096 --port 18080 >"$OUT/serve.log" 2>&1 &
  OURS=$!
  "${PENV[@]}" /tmp/ll/llama-server -m /tmp/L8.gguf -ngl 99 -np 32 -c 131072 --port 18081 >"$OUT/llama-server.log" 2>&1 &
  PEER=$!
  for p in 18080 18081; do for _ in $(seq 120); do curl -fs http://127.0.0.1:$p/health >/dev/null 2>&1 && break; sleep 1; done; done
  for C in 32 1 32; do for p in 18080 18081; do
    timeout 60 python3 -m runtime bench-serve http://127.0.0.1:$p -C $C --requests 2 -n 128 2>&1 | tail -1 | sed "s/^/$p /" | tee -a "$OUT/serve.txt"
  done; done
  kill $OURS $PEER
fi
echo "== end at $((SECONDS-T0)) s" | tee -a "$OUT/log.txt"
