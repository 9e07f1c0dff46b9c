#!/bin/bash
# Build the peer, llama.cpp's CUDA build (llama-server, llama-bench), on a machine with no GPU,
# for the lent GPU machine (sm_90, its CUDA 13.0 runtime), and pack it as .devpeer/llbin.tar.xz
# (the device scripts' carry; they preload the device's libcuda.so.1 and point at its cuBLAS).
#
#   tests/gpu/build_peer_cuda.sh [WORKDIR]      # default /tmp/peer; 35-150 min on 2 cores
#
# The source is the llama-cpp-python sdist's vendor/llama.cpp; nvcc, the CUDA runtime, cuBLAS
# and CCCL come from NVIDIA's PyPI wheels, merged into one toolkit folder; libcuda is a stub
# (only its soname matters: the driver's library is loaded on the device), so the link allows
# undefined symbols in shared libraries.  The CPU backend targets the device's Xeon (AVX-512,
# VNNI, BF16; AMX off, as the brief asks).
set -euo pipefail
W=${1:-/tmp/peer}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
LCP=${LCP:-0.3.36}
mkdir -p "$W" && cd "$W"
[ -f llama_cpp_python-$LCP.tar.gz ] || pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LCP" -d .
[ -d llama_cpp_python-$LCP ] || tar xzf llama_cpp_python-$LCP.tar.gz
pip download -q --no-deps --only-binary=:all: -d wh "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-runtime==13.0.96" \
  "nvidia-cublas==13.0.2.14" "nvidia-cuda-cccl==13.0.85" "nvidia-nvvm==13.0.88" "nvidia-cuda-crt==13.0.88"
for w in wh/*.whl; do unzip -q -o "$w" -d un; done
T=$W/un/nvidia/cu13
(cd "$T/lib" && for l in cudart cublas cublasLt; do ln -sf lib$l.so.13 lib$l.so; done)
mkdir -p "$T/lib/stubs" && echo 'int cuInit(int f){return 0;}' > stub.c
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$T/lib/stubs/libcuda.so" stub.c
ln -sf stubs/libcuda.so "$T/lib/libcuda.so"; ln -sfn lib "$T/lib64"
export PATH=$T/bin:$PATH CUDACXX=$T/bin/nvcc
cmake -S llama_cpp_python-$LCP/vendor/llama.cpp -B build-cuda -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCUDAToolkit_ROOT="$T" -DGGML_NATIVE=OFF \
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--allow-shlib-undefined
cmake --build build-cuda -j "$(nproc)" --target llama-server llama-bench
rm -rf llbin && mkdir llbin && cp -P build-cuda/bin/llama-server build-cuda/bin/llama-bench build-cuda/bin/*.so* llbin/
strip llbin/llama-server llbin/llama-bench llbin/*.so* 2>/dev/null || true
(cd llama_cpp_python-$LCP/vendor/llama.cpp && git rev-parse --short HEAD 2>/dev/null || echo "llama-cpp-python $LCP") > llbin/VERSION
mkdir -p "$REPO/.devpeer" && tar -cJf "$REPO/.devpeer/llbin.tar.xz" -C llbin .
ls -la "$REPO/.devpeer/llbin.tar.xz"
