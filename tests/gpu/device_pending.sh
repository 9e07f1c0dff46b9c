#!/bin/bash
# On the lent GPU machine: the pending diffs (tests/lab/pending: moe-prompt-chunks, mma-decode,
# qk-norm-pair, applied in that order) and what decides them, by value, each step time-boxed
# (DEADLINE seconds in all, default 540):
#  1. the tensor-core rows bit for bit (tests/gpu/test_mma_rows_gpu.py);
#  2. if 1 passed: L8 serving, ours and llama-server -np 32, 32 then 1 clients, same file;
#  3. the MoE prompt chunks and the q/k norm pair: their GPU tests;
#  4. the gpt-oss-20b shape in MXFP4, pp512: llama-bench, ours, llama-bench.
# Carry .devrun (wheels in .devrun/whl, qwen-tok.tok: tests/gpu/prepare_device.py) and .devpeer
# (llbin.tar.xz: llama.cpp CUDA bin, quant/cuda/NOTES.md).  Output in $OUT.
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
CUBLAS=$(dirname "$(find / -name 'libcublas.so.13' -not -path '*/proc/*' 2>/dev/null | head -1)")
PENV=(env LD_PRELOAD=$LIBCUDA LD_LIBRARY_PATH=/tmp/ll:$CUBLAS:$LD_LIBRARY_PATH)
for d in moe-prompt-chunks mma-decode qk-norm-pair; do (git apply tests/lab/pending/$d.diff 2>/dev/null || patch -p1 -s < tests/lab/pending/$d.diff) || echo "PATCH $d FAILED"; done
(python3 -m lab.gpu_real_shape L8 /tmp/L8.gguf --tokenizer .devrun/qwen-tok.tok > "$OUT/write.txt" 2>&1
 python3 -m lab.synth G20 /tmp/G20.gguf --mix MXFP4_MOE --tokenizer .devrun/qwen-tok.tok >> "$OUT/write.txt" 2>&1) &
timeout 130 python3 -m pytest -q -x tests/gpu/test_mma_rows_gpu.py -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/tests-mma.txt"
MMA_OK=${PIPESTATUS[0]}
echo "== mma tests rc $MMA_OK at $((SECONDS-T0)) s" | tee -a "$OUT/log.txt"
while [ ! -s /tmp/L8.gguf ] || ! grep -q "L8" "$OUT/write.txt" 2>/dev/null; do sleep 2; [ $((SECONDS-T0)) -gt 200 ] && break; done
if [ "$MMA_OK" = 0 ] && [ $(left) -gt 150 ]; then
  python3 -m runtime serve -m /tmp/L8.gguf --device cuda -np 32 -c 4096 --port 18080 >"$OUT/serve.log" 2>&1 &
  OURS=$!
  "${PENV[@]}" /tmp/ll/llama-server -m /tmp/L8.gguf -ngl 99 -np 32 -c 131072 --port 18081 >"$OUT/llama-server.log" 2>&1 &
  PEER=$!
  for p in 18080 18081; do for _ in $(seq 120); do curl -fs http://127.0.0.1:$p/health >/dev/null 2>&1 && break; sleep 1; done; done
  echo "== servers up at $((SECONDS-T0)) s" | tee -a "$OUT/log.txt"
  for C in 32 1; do for p in 18080 18081; do
    timeout 60 python3 -m runtime bench-serve http://127.0.0.1:$p -C $C --requests 2 -n 128 2>&1 | tee -a "$OUT/serve-$p.txt"
  done; done
  kill $OURS $PEER
  echo "== serve done at $((SECONDS-T0)) s" | tee -a "$OUT/log.txt"
else
  timeout 90 python3 -m lab.mma4k --reps 5 --rows 16,32 2>&1 | tee "$OUT/mma4k.txt"
fi
[ $(left) -gt 60 ] && timeout $(( $(left) < 130 ? $(left) - 10 : 130 )) python3 -m pytest -q tests/gpu/test_moe_gpu.py tests/gpu/test_gpt_oss_gpu.py tests/gpu/test_ops.py tests/gpu/test_moe_device_gpu.py -k "matmul_experts or prefill or prompt_logits or two_norms or device_routing_equals" -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests-moe.txt"
echo "== moe tests at $((SECONDS-T0)) s" | tee -a "$OUT/log.txt"
[ $(left) -lt 150 ] && { echo "== no time for G20 ($(left) s left)"; kill %1 2>/dev/null; exit 0; }
wait
"${PENV[@]}" timeout 60 /tmp/ll/llama-bench -m /tmp/G20.gguf -ngl 99 -p 512 -n 0 -fa 1 -r 3 2>&1 | grep -E "^\||error" | tee -a "$OUT/llama-bench.txt"
timeout 100 python3 -m runtime bench -m /tmp/G20.gguf --device cuda -p 512 -n 0 -r 3 2>&1 | tail -3 | tee -a "$OUT/bench.txt"
"${PENV[@]}" timeout 60 /tmp/ll/llama-bench -m /tmp/G20.gguf -ngl 99 -p 512 -n 0 -fa 1 -r 3 2>&1 | grep -E "^\||error" | tee -a "$OUT/llama-bench.txt"
echo "== end at $((SECONDS-T0)) s" | tee -a "$OUT/log.txt"
