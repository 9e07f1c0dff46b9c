// Decode matvec for float weights (F16, BF16, F32 GGUF tensors): float32 activations,
// float32 products and sums, so a result is the float32 dot of the stored weights.
//
// Nothing to decode, so the kernel only has to keep DRAM busy: each lane reads 16-byte
// words of R rows straight into registers (rows of F16/BF16/F32 are 16-byte aligned
// whenever K % 8 == 0), a group of MVF_U words a row ahead of the group it is summing,
// and a warp's rows are independent of every other warp's (no shared memory, no block
// barrier).  Lane l takes elements [32 E s + E l, +E) of word step s (E = T::WE: 8 halves
// or 4 floats, converted by the type's own T::word, qblocks.cuh), sums them into its own
// accumulator in step order, and the lanes' sums meet
// in mvs's butterfly (mvs_store).  That order depends on K alone, never on NR or R:
// batch invariant, so a speculative verify row equals a decode step's.
// Up to three weights of one type in one launch (blockIdx.y picks): q/k/v, gate/up.
// mode 0: y = xW^T (+ bias);  mode 1: y += xW^T.
#pragma once
#include "qint8.cuh"

constexpr int MVF_WARPS = 4;
#ifndef MVF_U
#define MVF_U 2
#endif

template <class T, int NR, int R>
__global__ void __launch_bounds__(32 * MVF_WARPS) mvf(
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,
        float* y0, float* y1, float* y2,
        const float* b0, const float* b1, const float* b2,
        int M0, int M1, int M2,
        int K, long long row_bytes, const float* __restrict__ x, int ldx, int ldy0, int ldy1, int ldy2, int mode) {
    PDL_EARLY_TRIGGER();
    constexpr int E = T::WE, U = MVF_U;
    static_assert(R * NR <= 32, "a lane per output");
    const int wsel = blockIdx.y;
    const u8* W = wsel == 0 ? W0 : (wsel == 1 ? W1 : W2);
    float* y = wsel == 0 ? y0 : (wsel == 1 ? y1 : y2);
    const float* bias = wsel == 0 ? b0 : (wsel == 1 ? b1 : b2);
    const int M = wsel == 0 ? M0 : (wsel == 1 ? M1 : M2);
    const int ldy = wsel == 0 ? ldy0 : (wsel == 1 ? ldy1 : ldy2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m0 = (blockIdx.x * MVF_WARPS + warp) * R;
    if (m0 >= M) return;                              // the whole warp
    const int nrows = min(R, M - m0);
    const int steps = (K + 32 * E - 1) / (32 * E);    // word steps a row (the last may be partial)
    const int groups = (steps + U - 1) / U;
    const u8* base = W + (long long)m0 * row_bytes + lane * 16;

    uint4 cur[U][R], nxt[U][R];
    auto load = [&](uint4 (&b)[U][R], int g) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int s = g * U + u;
            const bool ok = s < steps && (s * 32 + lane) * E < K;
#pragma unroll
            for (int r = 0; r < R; r++)
                b[u][r] = ok && r < nrows ? ldg_w<0>(base + r * row_bytes + (long long)s * 512)
                                          : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    float acc[R][NR];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int n = 0; n < NR; n++) acc[r][n] = 0.f;

    load(cur, 0);                                     // weights before the wait (no kernel writes them)
    PDL_WAIT();
    PDL_LATE_TRIGGER();
    for (int g = 0; g < groups; g++) {
        if (g + 1 < groups) load(nxt, g + 1);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int e = ((g * U + u) * 32 + lane) * E;
            if (e < K) {                              // lanes past K add nothing
                float xv[NR][E];
#pragma unroll
                for (int n = 0; n < NR; n++) {
                    const float4* p = (const float4*)(x + (long long)n * ldx + e);
#pragma unroll
                    for (int j = 0; j < E / 4; j++) {
                        const float4 a = __ldg(p + j);
                        xv[n][4 * j] = a.x; xv[n][4 * j + 1] = a.y; xv[n][4 * j + 2] = a.z; xv[n][4 * j + 3] = a.w;
                    }
                }
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float w[E];
                    T::word(cur[u][r], w);
#pragma unroll
                    for (int n = 0; n < NR; n++)
#pragma unroll
                        for (int i = 0; i < E; i++) acc[r][n] = fmaf(w[i], xv[n][i], acc[r][n]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) cur[u][r] = nxt[u][r];
    }
    mvs_store<NR, R>(acc, y, bias, ldy, m0, nrows, lane, mode);
}
