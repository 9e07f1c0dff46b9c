// Quantized matrix-vector / small-batch matmul, and block dequantization, on
// GGUF block layout.  Instantiated per type by name (see quant/cuda/__init__.py).
#include "qblocks.cuh"
#include "qint8.cuh"
#include "qmvk.cuh"
#include "qfloat.cuh"
#include "qmoe.cuh"
#ifndef MV_UNROLL
#define MV_UNROLL 1
#endif
constexpr int kMvUnroll = MV_UNROLL;

// y[r, m] (+)= sum_k x[r, k] * W[m, k] for up to NR rows of x.
// A block of up to 4 warps computes RPW consecutive output rows: its threads
// stride over the parts of the rows (each weight block is read once, front to
// back), and a thread keeps the activations of its part in registers while it
// decodes the same part of all RPW rows, so activations are fetched once per
// RPW rows (fetching them per weight would make the L1, not DRAM, the limit).
// Up to three weights of the same type and width run in one launch
// (blockIdx.y picks which): q/k/v and gate/up.
// mode 0: y = xW^T (+ bias);  mode 1: y += xW^T (residual add).
// (Folding the op before the matmul into x's loads here measured slower, every block
// recomputing the row's rms; the integer path and the prompt GEMM fold it: NOTES.md.)
template <class T, int NR, int RPW>
__global__ void __launch_bounds__(128) mv(
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,
        float* y0, float* y1, float* y2,
        const float* b0, const float* b1, const float* b2,
        int M0, int M1, int M2,
        int K, long long row_bytes, const float* __restrict__ x, int ldx, int ldy0, int ldy1, int ldy2, int mode) {
    PDL_ENTER();
    const int wsel = blockIdx.y;
    const u8* W = wsel == 0 ? W0 : (wsel == 1 ? W1 : W2);
    float* y = wsel == 0 ? y0 : (wsel == 1 ? y1 : y2);
    const float* bias = wsel == 0 ? b0 : (wsel == 1 ? b1 : b2);
    const int M = wsel == 0 ? M0 : (wsel == 1 ? M1 : M2);
    const int ldy = wsel == 0 ? ldy0 : (wsel == 1 ? ldy1 : ldy2);
    const int m0 = blockIdx.x * RPW;
    if (m0 >= M) return;                       // uniform over the block
    const int nparts = (K / T::QK) * T::PPB;
    const u8* rows = W + (long long)m0 * row_bytes;
    float acc[RPW][NR];
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int n = 0; n < NR; n++) acc[r][n] = 0.f;
    constexpr bool XREG = NR <= 2;             // activations of the part held in registers
#pragma unroll kMvUnroll
    for (int p = threadIdx.x; p < nparts; p += blockDim.x) {
        const int blk = p / T::PPB, part = p % T::PPB;
        if constexpr (XREG) {
            float xr[NR][T::PE], sx[NR][T::NRUN];
#pragma unroll
            for (int n = 0; n < NR; n++) {
                const float* xb = x + (long long)n * ldx + blk * T::QK;
#pragma unroll
                for (int u = 0; u < T::NRUN; u++) {
                    const float4* xv = (const float4*)(xb + T::run_start(part, u));
                    float s = 0.f;
#pragma unroll
                    for (int j = 0; j < T::RLEN / 4; j++) {
                        const float4 a = xv[j];
                        float* d = xr[n] + u * T::RLEN + 4 * j;
                        d[0] = a.x; d[1] = a.y; d[2] = a.z; d[3] = a.w;
                        if (T::HAS_MIN) s += (a.x + a.y) + (a.z + a.w);
                    }
                    sx[n][u] = s;
                }
            }
#pragma unroll
            for (int r = 0; r < RPW; r++) {
                if (m0 + r < M) {
                    float q[T::PE], sc[T::NRUN], mn[T::NRUN];
                    T::decode(rows + (long long)r * row_bytes + (long long)blk * T::BB, part, q, sc, mn);
#pragma unroll
                    for (int n = 0; n < NR; n++)
#pragma unroll
                        for (int u = 0; u < T::NRUN; u++) {
                            float s = 0.f;
#pragma unroll
                            for (int j = 0; j < T::RLEN; j++) s = fmaf(q[u * T::RLEN + j], xr[n][u * T::RLEN + j], s);
                            acc[r][n] = fmaf(sc[u], s, acc[r][n]);
                            if (T::HAS_MIN) acc[r][n] = fmaf(mn[u], sx[n][u], acc[r][n]);
                        }
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < RPW; r++) {
                if (m0 + r < M) {
                    float q[T::PE], sc[T::NRUN], mn[T::NRUN];
                    T::decode(rows + (long long)r * row_bytes + (long long)blk * T::BB, part, q, sc, mn);
#pragma unroll
                    for (int n = 0; n < NR; n++) {
                        const float* xb = x + (long long)n * ldx + blk * T::QK;
#pragma unroll
                        for (int u = 0; u < T::NRUN; u++) {
                            const float4* xv = (const float4*)(xb + T::run_start(part, u));
                            float s = 0.f, sxx = 0.f;
#pragma unroll
                            for (int j = 0; j < T::RLEN / 4; j++) {
                                float4 a = xv[j];
                                const float* qq = q + u * T::RLEN + 4 * j;
                                s = fmaf(qq[0], a.x, s); s = fmaf(qq[1], a.y, s);
                                s = fmaf(qq[2], a.z, s); s = fmaf(qq[3], a.w, s);
                                if (T::HAS_MIN) sxx += (a.x + a.y) + (a.z + a.w);
                            }
                            acc[r][n] = fmaf(sc[u], s, acc[r][n]);
                            if (T::HAS_MIN) acc[r][n] = fmaf(mn[u], sxx, acc[r][n]);
                        }
                    }
                }
            }
        }
    }
    // reduce over the block: warps by shuffles, then across warps in shared memory
    __shared__ float red[4][RPW * NR];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int n = 0; n < NR; n++) {
            float v = acc[r][n];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) red[warp][r * NR + n] = v;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < RPW * NR; i += blockDim.x) {
        const int r = i / NR, n = i % NR;
        if (m0 + r >= M) continue;
        float v = 0.f;
        for (int w = 0; w < nw; w++) v += red[w][i];
        float* dst = y + (long long)n * ldy + m0 + r;
        if (mode == 1) *dst += v;
        else *dst = bias ? v + bias[m0 + r] : v;
    }
}

// W rows [0, M) -> fp16 [M, K] (for the tensor-core GEMM of prompt processing).
// The DEQ_THREADS parts of a thread block are consecutive, so together they cover one
// stretch of the output (whole quant blocks, rows back to back): each thread decodes
// its part into shared memory (16-byte stores), then the block writes the stretch
// out with 16-byte stores, consecutive threads at consecutive addresses.  Each thread
// writing its own 64 bytes straight out made every warp store touch 32 separate
// segments: 340-360 GB/s on an H200, four times the GEMM's own time.
#ifndef DEQ_THREADS                          // the block size the backend launches with
#error "compile with -DDEQ_THREADS=quant.cuda.DEQ_THREADS"
#endif
template <class T>
__global__ void __launch_bounds__(DEQ_THREADS) deq_f16(const u8* __restrict__ W, int M, int K, long long row_bytes,
                                                       __half* out, const int* __restrict__ mats, int Me,
                                                       long long mat_bytes) {
    PDL_ENTER();
    static_assert(T::RLEN % 8 == 0 && DEQ_THREADS % T::PPB == 0, "runs of whole 16-byte chunks");
    __shared__ __align__(16) __half s[DEQ_THREADS * T::PE];
    const int nparts = (K / T::QK) * T::PPB;
    const long long total = (long long)M * nparts;
    const long long i0 = (long long)blockIdx.x * DEQ_THREADS;
    const long long i = i0 + threadIdx.x;
    if (i < total) {
        const int m = (int)(i / nparts), p = (int)(i % nparts);
        const int blk = p / T::PPB, part = p % T::PPB;
        float q[T::PE], sc[T::NRUN], mn[T::NRUN];
        // mats: out's rows are matrices mats[0], mats[1], ... of Me rows each, matrix i at
        // W + i * mat_bytes (a layer's chosen experts, one launch); else W's rows 0 .. M-1
        const u8* row = mats ? W + (long long)mats[m / Me] * mat_bytes + (long long)(m % Me) * row_bytes
                             : W + (long long)m * row_bytes;
        T::decode(row + (long long)blk * T::BB, part, q, sc, mn);
        __half* o = s + (threadIdx.x / T::PPB) * T::QK;      // this part's quant block in the stretch
#pragma unroll
        for (int u = 0; u < T::NRUN; u++) {
            __half* ou = o + T::run_start(part, u);
#pragma unroll
            for (int j = 0; j < T::RLEN; j += 8) {
                const float* qu = q + u * T::RLEN + j;
                union { __half2 h[4]; uint4 v; } pk;
#pragma unroll
                for (int e = 0; e < 4; e++)
                    pk.h[e] = __floats2half2_rn(fmaf(sc[u], qu[2 * e], mn[u]), fmaf(sc[u], qu[2 * e + 1], mn[u]));
                *(uint4*)(ou + j) = pk.v;
            }
        }
    }
    __syncthreads();
    const long long cnt = min((long long)DEQ_THREADS, total - i0);
    const int m0 = (int)(i0 / nparts), b0 = (int)(i0 % nparts) / T::PPB;
    uint4* dst = (uint4*)(out + (long long)m0 * K + (long long)b0 * T::QK);
    const int n16 = (int)(cnt * T::PE / 8);
    for (int k = threadIdx.x; k < n16; k += DEQ_THREADS)
        dst[k] = ((const uint4*)s)[k];
}

// Rows ids[i] of W -> float32 out[i, :] * scale (embedding lookup).
template <class T>
__global__ void deq_rows(const u8* __restrict__ W, const int* __restrict__ ids, int n, int K,
                         long long row_bytes, float scale, float* out) {
    PDL_ENTER();
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

// y[r, m] += bias[m] (after a GEMM)
extern "C" __global__ void add_bias(float* __restrict__ y, const float* __restrict__ bias, int n, int M, int ldy) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * M) return;
    int r = (int)(i / M), m = (int)(i % M);
    y[(long long)r * ldy + m] += bias[m];
}
