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

// per lane and row: a block's header and its 8 / LPB qs words j + LPB i
template <int LPB>
struct MvkW {
    uint4 h;
    uint4 q[8 / LPB];
};

// x of one lane for one block: the runs' codes (16 bytes each; word i: runs 2i, 2i + 1),
// the packed run sums for each word, the step
template <int LPB>
struct MvkX {
    int w[16 / LPB][4];
    int bs[8 / LPB];
    float d;
};

// a pipeline stage: R rows' block pieces and (NX > 0) the step's x
template <int LPB, int R, int NX>
struct MvkStage {
    MvkW<LPB> w[R];
    MvkX<LPB> x[NX > 0 ? NX : 1];
};

// xi: q8_act's packed run sums (int16 pairs; word 2(2(g & 1) + h) + (g >> 1) of a block
// holds runs 4g + h, 4g + 2 + h: qs word 2g + h's low- and high-nibble runs)
template <int LPB>
DEV void mvk_load_x(MvkX<LPB>& X, const signed char* __restrict__ xq, const float* __restrict__ xd,
                    const u32* __restrict__ xi, int blk, int j, bool ok) {
#pragma unroll
    for (int i = 0; i < 8 / LPB; i++) {
        const int k = j + LPB * i, e = blk * 256 + 64 * (k >> 1) + 16 * (k & 1);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const uint4 v = *(const uint4*)(xq + e + 32 * u);
            X.w[2 * i + u][0] = (int)v.x; X.w[2 * i + u][1] = (int)v.y;
            X.w[2 * i + u][2] = (int)v.z; X.w[2 * i + u][3] = (int)v.w;
        }
    }
    if constexpr (LPB == 4) {
        const uint2 b = *(const uint2*)(xi + blk * 8 + 2 * j);
        X.bs[0] = (int)b.x; X.bs[1] = (int)b.y;
    } else {
        const uint2 b0 = *(const uint2*)(xi + blk * 8 + 2 * j), b1 = *(const uint2*)(xi + blk * 8 + 4 + 2 * j);
        X.bs[0] = (int)b0.x; X.bs[2] = (int)b0.y; X.bs[1] = (int)b1.x; X.bs[3] = (int)b1.y;
    }
    X.d = ok ? xd[blk] : 0.f;                  // a block past K: nothing added
}

// one row's block piece (this lane's) dotted with one row of x, added to acc
template <int LPB>
DEV void mvk_dot(const MvkW<LPB>& B, const MvkX<LPB>& X, int sh, float& acc) {
    constexpr int NW = 8 / LPB;
    u32 Y = B.h.y, Z = B.h.z, Wd = B.h.w;
    if constexpr (LPB == 4) { Y >>= sh; Z >>= sh; Wd >>= sh; }
    const int s_lo = (int)(Y & 0x3F3F3F3Fu), m_lo = (int)(Z & 0x3F3F3F3Fu);
    const int s_hi = (int)((Wd & 0x0F0F0F0Fu) | ((Y >> 2) & 0x30303030u));
    const int m_hi = (int)(((Wd >> 4) & 0x0F0F0F0Fu) | ((Z >> 2) & 0x30303030u));
    const float d = __half2float(__ushort_as_half((u16)(B.h.x & 0xFFFFu)));
    const float dm = __half2float(__ushort_as_half((u16)(B.h.x >> 16)));
    int I = 0, M = 0;
#pragma unroll
    for (int i = 0; i < NW; i++) {
        const u32 qw[4] = {B.q[i].x, B.q[i].y, B.q[i].z, B.q[i].w};
        int sl = 0, sh4 = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            sl = __dp4a((int)(qw[k] & 0x0F0F0F0Fu), X.w[2 * i][k], sl);
            sh4 = dp4a_us(qw[k] & 0xF0F0F0F0u, X.w[2 * i + 1][k], sh4);
        }
        const int pk = (int)__byte_perm((u32)sl, (u32)(sh4 >> 4), 0x5410);
        // sub-blocks 2g, 2g + 1 of word i: scale bytes 0, 1 (LPB 4: shifted there) or 2, 3
        const bool hiw = LPB == 4 ? i == 1 : i >= 2;
        const bool hib = LPB == 2 && (i & 1);
        const int sw = hiw ? s_hi : s_lo, mw = hiw ? m_hi : m_lo;
        if (hib) { I = __dp2a_hi(pk, sw, I); M = __dp2a_hi(X.bs[i], mw, M); }
        else { I = __dp2a_lo(pk, sw, I); M = __dp2a_lo(X.bs[i], mw, M); }
    }
    acc = fmaf(d * X.d, (float)I, acc);
    acc = fmaf(-(dm * X.d), (float)M, acc);
}

// The launch's tasks (R rows of one of up to three weights) in order W0, W1, W2 over all
// warps of the grid (V & 1: warp w takes tasks w, w + nw, ...; else a contiguous range);
// a warp walks its tasks' steps (R rows x 32 / LPB blocks) with S - 1 steps' loads in
// flight while it computes one.  LPB = 2 if V & 2 else 4.
template <int NR, int R, int S, int V>
__global__ void __launch_bounds__(32 * MVK_WARPS) mvk4k(
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,
        float* y0, float* y1, float* y2,
        const float* b0, const float* b1, const float* b2,
        int M0, int M1, int M2,
        int K, long long row_bytes, const signed char* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, int ldy0, int ldy1, int ldy2, int mode) {
    static_assert(R * NR <= 32, "a lane per output");
    constexpr int LPB = (V & 2) ? 2 : 4, BPS = 32 / LPB, NW = 8 / LPB;
    constexpr bool IL = V & 1;
    // x a step ahead with the weights (LPB 4, 1-2 rows of x); else held across steps of
    // one block index (reloaded when it changes) or, past 2 rows, loaded a row at a time
    constexpr bool XP = LPB == 4 && NR <= 2;
    constexpr bool XH = LPB == 2 && NR <= 2;
    using Stage = MvkStage<LPB, R, XP ? NR : 0>;
    const u32* __restrict__ xi = (const u32*)xs;      // mvk takes q8_act's packed run sums here
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q = lane / LPB, j = lane % LPB, sh = 16 * (j >> 1);
    const int nb = K / 256, nst = (nb + BPS - 1) / BPS;
    const int T0 = (M0 + R - 1) / R, T1 = (M1 + R - 1) / R, T2 = (M2 + R - 1) / R;
    const int T = T0 + T1 + T2;
    const int nw = gridDim.x * MVK_WARPS, w = blockIdx.x * MVK_WARPS + warp;
    const int t_beg = IL ? w : (int)((long long)w * T / nw), t_end = IL ? T : (int)((long long)(w + 1) * T / nw);
    const int t_step = IL ? nw : 1;
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
            lt += t_step;
            if (lt < t_end) lset();
        }
    };
    // loads past the matrix read its last block / row again (finite, never summed / stored)
    auto load_x = [&](MvkX<LPB>& X, int n, int it) {
        const int blk = it * BPS + q;
        mvk_load_x<LPB>(X, xq + (long long)n * K, xd + (long long)n * (K / 256), xi + (long long)n * (K / 32),
                        min(blk, nb - 1), j, blk < nb);
    };
    auto load = [&](Stage& st) {
        const u8* p = lp + min(lit * BPS + q, nb - 1) * 144;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const u8* pr = p + (r < lrows ? r : lrows - 1) * row_bytes;
            st.w[r].h = ldg_stream<1>(pr);
#pragma unroll
            for (int i = 0; i < NW; i++) st.w[r].q[i] = ldg_stream<1>(pr + 16 + 16 * (j + LPB * i));
        }
        if constexpr (XP) {
#pragma unroll
            for (int n = 0; n < NR; n++) load_x(st.x[n], n, lit);
        }
    };

    float acc[R][NR];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int n = 0; n < NR; n++) acc[r][n] = 0.f;

    MvkX<LPB> xh[XH ? NR : 1];
    int xh_it = -1;
    auto compute = [&](const Stage& st, int t, int it) {
        if constexpr (XP) {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int n = 0; n < NR; n++) mvk_dot<LPB>(st.w[r], st.x[n], sh, acc[r][n]);
        } else if constexpr (XH) {
            if (it != xh_it) {
#pragma unroll
                for (int n = 0; n < NR; n++) load_x(xh[n], n, it);
                xh_it = it;
            }
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int n = 0; n < NR; n++) mvk_dot<LPB>(st.w[r], xh[n], sh, acc[r][n]);
        } else {
#pragma unroll
            for (int n = 0; n < NR; n++) {
                MvkX<LPB> X;
                load_x(X, n, it);
#pragma unroll
                for (int r = 0; r < R; r++) mvk_dot<LPB>(st.w[r], X, sh, acc[r][n]);
            }
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
                if (++cit == nst) { cit = 0; ct += t_step; }
            }
        }
    }
}
