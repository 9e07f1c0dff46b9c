#!/bin/bash
# On the lent GPU machine: what is pending and what decides it, in phases that fit one call
# each (DEADLINE seconds, default 540), run back to back on one warm machine:
#   tests/gpu/device_pending.sh 1   prompt-route (tests/lab/pending): the MoE GPU tests with it
#       (test_moe_gpu's new ones, gpt-oss, --cpu-moe); the models written in the background (G20, M30, L8: a
#       `setsid` process outlives the call); then G20 pp512, ours with prompt routing on the
#       device and on the host (LLAMBA_PROMPT_ROUTE=0), between two llama-bench runs;
#   tests/gpu/device_pending.sh 2   mvf-tiny (tests/lab/pending): its test, M30 tg128 with it
#       and without (LLAMBA_MVF_UT=2) between two llama-bench runs; a G20 pp512 profile (cProfile:
#       the host's share);
#   tests/gpu/device_pending.sh 3   mma-decode: its tests and a 32-row L8 step with it and
#       without (lab.serve_engine --exact);
#   tests/gpu/device_pending.sh 4   L8 serving with mma-decode, ours and llama-server -np 32,
#       32 then 1 clients (bench-serve), same file.
# Carry .devrun (wheels in .devrun/whl, qwen-tok.tok: tests/gpu/prepare_device.py --devrun) and
# .devpeer (llbin.tar.xz: tests/gpu/build_peer_cuda.sh).  Output in $OUT.
# A call made within ~30 s of the last one finds the machine warm, /tmp included
# (quant/cuda/NOTES.md, session 36).
PHASE=${1:-1}
OUT=${OUT:-/tmp/llamba-out}; mkdir -p "$OUT"
T0=$SECONDS
DEADLINE=${DEADLINE:-540}
left() { echo $((DEADLINE - (SECONDS - T0))); }
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .devrun/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba-cache CUPY_CACHE_DIR=/tmp/cupy-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
df -h /tmp | tail -1 | tee -a "$OUT/gpu.txt"
[ -x /tmp/ll/llama-bench ] || { mkdir -p /tmp/ll && tar -xJf .devpeer/llbin.tar.xz -C /tmp/ll; }
LIBCUDA=$(ldconfig -p | grep -m1 "libcuda.so.1 " | awk '{print $NF}')
CUBLAS=$(dirname "$(find / -name 'libcublas.so.13' -not -path '/proc/*' 2>/dev/null | head -1)")
PENV=(env LD_PRELOAD=$LIBCUDA LD_LIBRARY_PATH=/tmp/ll:$CUBLAS:$LD_LIBRARY_PATH)
TOK=.devrun/qwen-tok.tok
waitfor() {   # waitfor FILE: until the background writer has finished it (or the deadline)
  while [ ! -f "$1.done" ] && [ "$(left)" -gt 60 ]; do sleep 5; done
  [ -f "$1.done" ]
}
ours() {   # ours LABEL ARGS...: runtime bench, its last line
  local label=$1; shift
  timeout "${BT:-150}" python3 -m runtime bench "$@" 2>&1 | tail -1 | sed "s/^/$label /" | tee -a "$OUT/bench.txt"
}
peer() { "${PENV[@]}" timeout 120 /tmp/ll/llama-bench "$@" 2>&1 | grep -E "^\||error" | tee -a "$OUT/bench.txt"; }

if [ "$PHASE" = 0 ]; then   # no pending diff: the GPU tests of what is committed and not yet run on a GPU
  # (quant.cuda's _parts/_deq_f16, the engine's _begin_forward, test_cpu_moe_gpu's fix)
  timeout $(( $(left) - 20 )) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_kernels.py \
    tests/gpu/test_cpu_moe_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_models.py 2>&1 | tail -20 | tee "$OUT/tests-0.txt"
fi

if [ "$PHASE" = 1 ]; then
  if [ ! -f /tmp/writer.started ]; then
    touch /tmp/writer.started
    cp "$TOK" /tmp/qwen-tok.tok
    setsid nohup bash -c "cd $PWD; export PYTHONPATH=$PYTHONPATH NUMBA_CACHE_DIR=/tmp/numba-cache
      python3 -m lab.synth G20 /tmp/G20.gguf --mix MXFP4_MOE --tokenizer /tmp/qwen-tok.tok && touch /tmp/G20.gguf.done
      python3 -m lab.synth M30 /tmp/M30.gguf --mix Q4_K_M --tokenizer /tmp/qwen-tok.tok && touch /tmp/M30.gguf.done
      python3 -m lab.gpu_real_shape L8 /tmp/L8.gguf --tokenizer /tmp/qwen-tok.tok && touch /tmp/L8.gguf.done" \
      > /tmp/write.log 2>&1 < /dev/null &
  fi
  git apply tests/lab/pending/prompt-route.diff || echo "PATCH prompt-route FAILED"
  timeout 220 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py tests/gpu/test_gpt_oss_gpu.py \
    tests/gpu/test_cpu_moe_gpu.py 2>&1 | tail -15 | tee "$OUT/tests-moe.txt"
  echo "== tests done at $((SECONDS - T0)) s" | tee -a "$OUT/log.txt"
  if waitfor /tmp/G20.gguf; then
    G=(-m /tmp/G20.gguf --device cuda -p 512 -n 0 -r 3)
    peer -m /tmp/G20.gguf -ngl 99 -p 512 -n 0 -fa 1 -r 3
    ours "route=device" "${G[@]}"
    LLAMBA_PROMPT_ROUTE=0 ours "route=host" "${G[@]}"
    ours "route=device" "${G[@]}"
    peer -m /tmp/G20.gguf -ngl 99 -p 512 -n 0 -fa 1 -r 3
  fi
fi

if [ "$PHASE" = 2 ]; then
  git apply tests/lab/pending/mvf-tiny.diff || echo "PATCH mvf-tiny FAILED"
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_kernels.py -k "router or float_weight" 2>&1 \
    | tail -5 | tee "$OUT/tests-mvf.txt"
  if waitfor /tmp/M30.gguf; then
    M=(-m /tmp/M30.gguf -ngl 99 -p 0 -n 128 -fa 1 -r 3)
    peer "${M[@]}"
    LLAMBA_MVF_UT=8 ours "M30 UT=8" -m /tmp/M30.gguf --device cuda -p 0 -n 128 -r 3
    LLAMBA_MVF_UT=2 ours "M30 UT=2" -m /tmp/M30.gguf --device cuda -p 0 -n 128 -r 3
    peer "${M[@]}"
  fi
  git apply tests/lab/pending/prompt-route.diff || echo "PATCH prompt-route FAILED"
  if [ "$(left)" -gt 100 ]; then
    timeout 90 python3 -m cProfile -s tottime -m runtime bench -m /tmp/G20.gguf --device cuda -p 512 -n 0 -r 2 2>&1 \
      | head -45 > "$OUT/g20-profile.txt"
  fi
fi

if [ "$PHASE" = 3 ]; then
  git apply tests/lab/pending/mma-decode.diff || echo "PATCH mma-decode FAILED"
  timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_mma_rows_gpu.py 2>&1 | tail -15 \
    | tee "$OUT/tests-mma.txt"
  if waitfor /tmp/L8.gguf; then
    for cfg in "LLAMBA_MMA=1" "LLAMBA_MMA=1 LLAMBA_MMA4K=mma4k LLAMBA_MMA6KS=mma6k_s" "LLAMBA_MMA=0"; do
      echo "== $cfg" | tee -a "$OUT/engine.txt"
      env $cfg timeout 100 python3 -m lab.serve_engine -m /tmp/L8.gguf --device cuda -B 32 --rounds 2 --steps 10 \
        --exact 2>&1 | tail -1 | tee -a "$OUT/engine.txt"
    done
  fi
fi

if [ "$PHASE" = 4 ]; then
  git apply tests/lab/pending/mma-decode.diff || echo "PATCH mma-decode FAILED"
  python3 -m runtime serve -m /tmp/L8.gguf --device cuda -np 32 -c 4096 --port 18080 >"$OUT/serve.log" 2>&1 &
  OURS=$!
  "${PENV[@]}" /tmp/ll/llama-server -m /tmp/L8.gguf -ngl 99 -np 32 -c 131072 --port 18081 >"$OUT/llama-server.log" 2>&1 &
  PEER=$!
  for p in 18080 18081; do for _ in $(seq 120); do curl -fs http://127.0.0.1:$p/health >/dev/null 2>&1 && break; sleep 1; done; done
  for C in 32 1 32; do for p in 18080 18081; do
    timeout 60 python3 -m runtime bench-serve http://127.0.0.1:$p -C $C --requests 2 -n 128 2>&1 | tail -1 \
      | sed "s/^/$p C=$C /" | tee -a "$OUT/serve.txt"
  done; done
  kill $OURS $PEER
fi
cp /tmp/write.log "$OUT/write.log" 2>/dev/null
echo "== phase $PHASE end at $((SECONDS - T0)) s" | tee -a "$OUT/log.txt"
