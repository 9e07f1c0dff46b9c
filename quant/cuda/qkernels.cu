// Quantized matrix-vector / small-batch matmul, and block dequantization, on
// GGUF block layout.  Instantiated per type by name (see quant/cuda/__init__.py).
#include "qblocks.cuh"
#ifndef MV_UNROLL
#define MV_UNROLL 2
#endif
constexpr int kMvUnroll = MV_UNROLL;

// y[r, m] (+)= sum_k x[r, k] * W[m, k] for up to NR rows of x.
// One warp per output row m; lane j takes parts j, j+32, ... of the row, so the
// warp reads the row's blocks once, front to back, for all NR rows of x.
// Up to three weights of the same type and width run in one launch
// (blockIdx.y picks which): q/k/v and gate/up.
// mode 0: y = xW^T (+ bias);  mode 1: y += xW^T (residual add).
template <class T, int NR>
__global__ void __launch_bounds__(128) mv(
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,
        float* y0, float* y1, float* y2,
        const float* b0, const float* b1, const float* b2,
        int M0, int M1, int M2,
        int K, long long row_bytes, const float* __restrict__ x, int ldx, int ldy0, int ldy1, int ldy2, int mode) {
    const int wsel = blockIdx.y;
    const u8* W = wsel == 0 ? W0 : (wsel == 1 ? W1 : W2);
    float* y = wsel == 0 ? y0 : (wsel == 1 ? y1 : y2);
    const float* bias = wsel == 0 ? b0 : (wsel == 1 ? b1 : b2);
    const int M = wsel == 0 ? M0 : (wsel == 1 ? M1 : M2);
    const int ldy = wsel == 0 ? ldy0 : (wsel == 1 ? ldy1 : ldy2);
    const int m = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (m >= M) return;
    const u8* row = W + (long long)m * row_bytes;
    const int nparts = (K / T::QK) * T::PPB;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.f;
#pragma unroll kMvUnroll
    for (int p = lane; p < nparts; p += 32) {
        const int blk = p / T::PPB, part = p % T::PPB;
        float q[T::PE], sc[T::NRUN], mn[T::NRUN];
        T::decode(row + (long long)blk * T::BB, part, q, sc, mn);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const float* xb = x + (long long)r * ldx + blk * T::QK;
#pragma unroll
            for (int u = 0; u < T::NRUN; u++) {
                const float4* xv = (const float4*)(xb + T::run_start(part, u));
                float s = 0.f, sx = 0.f;
#pragma unroll
                for (int j = 0; j < T::RLEN / 4; j++) {
                    float4 a = xv[j];
                    const float* qq = q + u * T::RLEN + 4 * j;
                    s = fmaf(qq[0], a.x, s); s = fmaf(qq[1], a.y, s);
                    s = fmaf(qq[2], a.z, s); s = fmaf(qq[3], a.w, s);
                    if (T::HAS_MIN) sx += (a.x + a.y) + (a.z + a.w);
                }
                acc[r] = fmaf(sc[u], s, acc[r]);
                if (T::HAS_MIN) acc[r] = fmaf(mn[u], sx, acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++) {
        float v = acc[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        acc[r] = v;
    }
    if (lane < NR) {
        float v = 0.f;
#pragma unroll
        for (int r = 0; r < NR; r++) if (r == lane) v = acc[r];
        float* dst = y + (long long)lane * ldy + m;
        if (mode == 1) *dst += v;
        else *dst = bias ? v + bias[m] : v;
    }
}

// W rows [0, M) -> fp16 [M, K] (for the tensor-core GEMM of prompt processing).
template <class T>
__global__ void deq_f16(const u8* __restrict__ W, int M, int K, long long row_bytes, __half* out) {
    const int nparts = (K / T::QK) * T::PPB;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)M * nparts) return;
    const int m = (int)(i / nparts), p = (int)(i % nparts);
    const int blk = p / T::PPB, part = p % T::PPB;
    float q[T::PE], sc[T::NRUN], mn[T::NRUN];
    T::decode(W + (long long)m * row_bytes + (long long)blk * T::BB, part, q, sc, mn);
    __half* o = out + (long long)m * K + blk * T::QK;
#pragma unroll
    for (int u = 0; u < T::NRUN; u++) {
        __half* ou = o + T::run_start(part, u);
#pragma unroll
        for (int j = 0; j < T::RLEN; j += 2)
            *(__half2*)(ou + j) = __floats2half2_rn(fmaf(sc[u], q[u * T::RLEN + j], mn[u]),
                                                    fmaf(sc[u], q[u * T::RLEN + j + 1], mn[u]));
    }
}

// Rows ids[i] of W -> float32 out[i, :] * scale (embedding lookup).
template <class T>
__global__ void deq_rows(const u8* __restrict__ W, const int* __restrict__ ids, int n, int K,
                         long long row_bytes, float scale, float* out) {
    const int nparts = (K / T::QK) * T::PPB;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * nparts) return;
    const int t = (int)(i / nparts), p = (int)(i % nparts);
    const int blk = p / T::PPB, part = p % T::PPB;
    float q[T::PE], sc[T::NRUN], mn[T::NRUN];
    T::decode(W + (long long)ids[t] * row_bytes + (long long)blk * T::BB, part, q, sc, mn);
    float* o = out + (long long)t * K + blk * T::QK;
#pragma unroll
    for (int u = 0; u < T::NRUN; u++)
#pragma unroll
        for (int j = 0; j < T::RLEN; j++)
            o[T::run_start(part, u) + j] = fmaf(sc[u], q[u * T::RLEN + j], mn[u]) * scale;
}

// float32 -> fp16 (activations entering the tensor-core GEMM)
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, __half* __restrict__ y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half_rn(x[i]);
}

// y[r, m] += bias[m] (after a GEMM)
extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ bias, int n, int M, int ldy) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * M) return;
    int r = (int)(i / M), m = (int)(i % M);
    y[(long long)r * ldy + m] += bias[m];
}
