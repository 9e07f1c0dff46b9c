#!/bin/bash
# What we run on the lent GPU machine (no network; wheels and trimmed models carried):
#   tests/gpu/device_run.sh [tests|bench|all] [bench args...]
# TESTS: pytest's selection (default tests/gpu), KEXPR: its -k expression; TAG: bench file suffix
# The whole suite takes longer than one 600 s device call (~430 s, then ~220 s for
# test_speculative_gpu.py, whose CPU draft compiles the Numba kernels on a fresh machine): run
#   TEST_TIMEOUT=540 TESTS="$(ls tests/gpu/test_*.py | grep -v speculative)" tests/gpu/device_run.sh tests
#   TEST_TIMEOUT=480 TESTS=tests/gpu/test_speculative_gpu.py tests/gpu/device_run.sh tests
# Wheels in .whl/ (gguf, platformdirs), trimmed real models in .devmodels/: both made by
# `python tests/gpu/prepare_device.py` and passed as the run's carry.  Output goes to $OUT when set.
set -o pipefail
OUT=${OUT:-/tmp/llamba-out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD:$PWD/tests || exit 1
fi
export PYTHONUNBUFFERED=1 LLAMBA_GPU_TEST_MODELS=$PWD/.devmodels NUMBA_CACHE_DIR=/tmp/numba-cache
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-cache}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import cupy, numba, numpy; print('cupy', cupy.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__)"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu ${TESTS:-tests/gpu} ${KEXPR:+-k "$KEXPR"} --maxfail=8 -rs --durations=8 -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${BENCH_TIMEOUT:-400} python3 -m lab.gpu_bench --out "$OUT/bench${TAG}.json" "$@" 2>&1 | tee "$OUT/bench${TAG}.txt"
fi
