// mvk: the integer decode matvec with weights loaded straight into registers (no shared
// memory), few instructions a weight, and a persistent grid that streams the launch's
// rows as one pipelined sequence of steps.  Same inputs and outputs as mvs (qint8.cuh);
// its sums are its own (not mvs's), but like mvs's they depend on neither the number of
// x rows (NR) nor the rows a warp (R): batch invariance.
//
// Q4_K.  A step is R rows x 8 blocks (2048 weights a row): 4 lanes a block, lane j of a
// block holding its qs words j and j + 4 (16 bytes each: 32 weights of sub-blocks 2g,
// 2g+1 and 2g+4, 2g+5, g = j / 2) and the block's 16-byte header (d, dmin, scales).
// Integer sums per lane and block, exact:
//     I = sum over its 4 runs of 16 weights: sc[run] * sum(q * qx)      (dp4a, dp2a)
//     M = sum over the runs: mn[run] * sum(qx)
// then acc = fma(d * xd, I, acc), acc = fma(-(dmin * xd), M, acc) in block order, and
// the warp's butterfly (mvs_store).  High nibbles are dotted unshifted (q & 0xF0 as
// unsigned bytes, dp4a.u32.s32) and the sum shifted back (exact: a multiple of 16).
#pragma once
#include "qint8.cuh"

constexpr int MVK_WARPS = 4;

DEV int dp4a_us(u32 a, int b, int c) {     // unsigned bytes of a . signed bytes of b
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
template <int NA>
DEV uint4 ldg_stream(const void* p) {       // weights: read once (NA: kept out of L1)
    uint4 v;
    if constexpr (NA == 1)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else
        asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

struct MvkQ4K {
    uint4 h, a, b;
};

// x of one lane for one block: the 4 runs' codes (16 bytes each), packed run sums, step
struct MvkX4K {
    int w[4][4];
    int bs[2];
    float d;
};

// a pipeline stage: R rows' block pieces and (XP) the step's x
template <int R, int NX>
struct MvkStage4K {
    MvkQ4K w[R];
    MvkX4K x[NX];
};

// xi: q8_act's packed run sums (int16 pairs, for lane j of a block words 2j, 2j + 1)
DEV void mvk_load_x4k(MvkX4K& X, const signed char* __restrict__ xq, const float* __restrict__ xd,
                      const u32* __restrict__ xi, int blk, int j, bool ok) {
    const int e = blk * 256 + 64 * (j >> 1) + 16 * (j & 1);
    const int off[4] = {e, e + 32, e + 128, e + 160};
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const uint4 v = *(const uint4*)(xq + off[u]);
        X.w[u][0] = (int)v.x; X.w[u][1] = (int)v.y; X.w[u][2] = (int)v.z; X.w[u][3] = (int)v.w;
    }
    const uint2 b = *(const uint2*)(xi + blk * 8 + 2 * j);
    X.bs[0] = (int)b.x;
    X.bs[1] = (int)b.y;
    X.d = ok ? xd[blk] : 0.f;                  // a block past K: nothing added
}

// one row's block piece (this lane's) dotted with NR rows of x
template <int NR>
DEV void mvk_dot4k(const MvkQ4K& B, const MvkX4K (&X)[NR], int sh, float (&acc)[NR]) {
    const u32 Y = B.h.y >> sh, Z = B.h.z >> sh, Wd = B.h.w >> sh;
    const int s_lo = (int)(Y & 0x3F3Fu), m_lo = (int)(Z & 0x3F3Fu);
    const int s_hi = (int)((Wd & 0x0F0Fu) | ((Y >> 2) & 0x3030u));
    const int m_hi = (int)(((Wd >> 4) & 0x0F0Fu) | ((Z >> 2) & 0x3030u));
    const float d = __half2float(__ushort_as_half((u16)(B.h.x & 0xFFFFu)));
    const float dm = __half2float(__ushort_as_half((u16)(B.h.x >> 16)));
    const u32 qa[4] = {B.a.x, B.a.y, B.a.z, B.a.w}, qb[4] = {B.b.x, B.b.y, B.b.z, B.b.w};
    u32 la[4], ha[4], lb[4], hb[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        la[k] = qa[k] & 0x0F0F0F0Fu; ha[k] = qa[k] & 0xF0F0F0F0u;
        lb[k] = qb[k] & 0x0F0F0F0Fu; hb[k] = qb[k] & 0xF0F0F0F0u;
    }
#pragma unroll
    for (int n = 0; n < NR; n++) {
        int s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            s0 = __dp4a((int)la[k], X[n].w[0][k], s0);
            s1 = dp4a_us(ha[k], X[n].w[1][k], s1);
            s2 = __dp4a((int)lb[k], X[n].w[2][k], s2);
            s3 = dp4a_us(hb[k], X[n].w[3][k], s3);
        }
        int I = __dp2a_lo((int)__byte_perm((u32)s0, (u32)(s1 >> 4), 0x5410), s_lo, 0);
        I = __dp2a_lo((int)__byte_perm((u32)s2, (u32)(s3 >> 4), 0x5410), s_hi, I);
        int M = __dp2a_lo(X[n].bs[0], m_lo, 0);
        M = __dp2a_lo(X[n].bs[1], m_hi, M);
        acc[n] = fmaf(d * X[n].d, (float)I, acc[n]);
        acc[n] = fmaf(-(dm * X[n].d), (float)M, acc[n]);
    }
}

// The launch's tasks (R rows of one of up to three weights) in order W0, W1, W2, split
// evenly over all warps of the grid; a warp walks its tasks' steps (R rows x 2048
// weights) with the next step's loads in flight while it computes the current one.
template <int NR, int R, int S, int NA>
__global__ void __launch_bounds__(32 * MVK_WARPS) mvk4k(
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,
        float* y0, float* y1, float* y2,
        const float* b0, const float* b1, const float* b2,
        int M0, int M1, int M2,
        int K, long long row_bytes, const signed char* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, int ldy0, int ldy1, int ldy2, int mode) {
    static_assert(R * NR <= 32, "a lane per output");
    constexpr bool XP = NR <= 2;                      // x loaded with the weights, a step ahead
    constexpr int NX = NR;
    using Stage = MvkStage4K<R, XP ? NR : 1>;
    const u32* __restrict__ xi = (const u32*)xs;      // mvk takes q8_act's packed run sums here
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q = lane >> 2, j = lane & 3, sh = 16 * (j >> 1);
    const int nb = K / 256, nst = (nb + 7) / 8;
    const int T0 = (M0 + R - 1) / R, T1 = (M1 + R - 1) / R, T2 = (M2 + R - 1) / R;
    const long long T = (long long)T0 + T1 + T2;
    const long long nw = (long long)gridDim.x * MVK_WARPS, w = (long long)blockIdx.x * MVK_WARPS + warp;
    const int t_beg = (int)(w * T / nw), t_end = (int)((w + 1) * T / nw);
    if (t_beg >= t_end) return;

    // task t: weight, its output, rows [m0, m0 + R) of M
    auto task = [&](int t, int& sel, int& m0) {
        if (t < T0) { sel = 0; m0 = t * R; }
        else if (t < T0 + T1) { sel = 1; m0 = (t - T0) * R; }
        else { sel = 2; m0 = (t - T0 - T1) * R; }
    };
    // the load cursor: task lt, its step lit, its first row's bytes lp, rows in it lrows
    int lt = t_beg, lit = 0, lrows = 0;
    const u8* lp = nullptr;
    auto lset = [&]() {
        int sel, m0;
        task(lt, sel, m0);
        const u8* W = sel == 0 ? W0 : (sel == 1 ? W1 : W2);
        const int M = sel == 0 ? M0 : (sel == 1 ? M1 : M2);
        lp = W + (long long)m0 * row_bytes;
        lrows = min(R, M - m0);
    };
    auto ladvance = [&]() {
        if (++lit == nst) {
            lit = 0;
            if (++lt < t_end) lset();
        }
    };
    // loads past the matrix read its last block / row again (finite, never summed / stored)
    auto load_x = [&](MvkX4K (&X)[NX], int it) {
        const int blk = it * 8 + q;
#pragma unroll
        for (int n = 0; n < NX; n++)
            mvk_load_x4k(X[n], xq + (long long)n * K, xd + (long long)n * (K / 256),
                         xi + (long long)n * (K / 32), min(blk, nb - 1), j, blk < nb);
    };
    auto load = [&](Stage& st) {
        const u8* p = lp + min(lit * 8 + q, nb - 1) * 144;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const u8* pr = p + (r < lrows ? r : lrows - 1) * row_bytes;
            st.w[r].h = ldg_stream<NA>(pr);
            st.w[r].a = ldg_stream<NA>(pr + 16 + 16 * j);
            st.w[r].b = ldg_stream<NA>(pr + 80 + 16 * j);
        }
        if constexpr (XP) load_x(st.x, lit);
    };

    float acc[R][NR];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int n = 0; n < NR; n++) acc[r][n] = 0.f;

    auto compute = [&](const Stage& st, int t, int it) {
        if constexpr (XP) {
#pragma unroll
            for (int r = 0; r < R; r++) mvk_dot4k<NR>(st.w[r], st.x, sh, acc[r]);
        } else {
            MvkX4K X[NR];
            load_x(X, it);
#pragma unroll
            for (int r = 0; r < R; r++) mvk_dot4k<NR>(st.w[r], X, sh, acc[r]);
        }
        if (it == nst - 1) {                         // the task's last step: its sums out
            int sel, m0;
            task(t, sel, m0);
            float* y = sel == 0 ? y0 : (sel == 1 ? y1 : y2);
            const float* bias = sel == 0 ? b0 : (sel == 1 ? b1 : b2);
            const int M = sel == 0 ? M0 : (sel == 1 ? M1 : M2);
            const int ldy = sel == 0 ? ldy0 : (sel == 1 ? ldy1 : ldy2);
            mvs_store<NR, R>(acc, y, bias, ldy, m0, min(R, M - m0), lane, mode);
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int n = 0; n < NR; n++) acc[r][n] = 0.f;
        }
    };

    // S stages: S - 1 steps' loads in flight while a step is computed
    Stage buf[S];
    int ct = t_beg, cit = 0;                          // step to compute
    lset();
#pragma unroll
    for (int k = 0; k < S - 1; k++)
        if (lt < t_end) { load(buf[k]); ladvance(); }
    while (ct < t_end) {
#pragma unroll
        for (int k = 0; k < S; k++) {
            if (ct < t_end) {
                if (lt < t_end) { load(buf[(k + S - 1) % S]); ladvance(); }
                compute(buf[k], ct, cit);
                if (++cit == nst) { cit = 0; ++ct; }
            }
        }
    }
}
