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
// LLAMBA_WPF > 0: the warp's weights LLAMBA_WPF steps past the one it loads, prefetched
// into L2 (prefetch.global.L2, no registers held): a cursor over the warp's steps like
// the load cursor; each step's R row pieces (UB * BPS bytes a row) as 128-byte lines,
// a lane a line.  task(t, sel, m0) as in the kernels.
template <int R, int UB, int BPS>
struct MvkPf {
    static constexpr int NL = (UB * BPS + 127) / 128 + 1;   // lines a row piece can touch
    int t, it, rows;
    const u8* p;
};
#define MVK_PF_DEFS(PF_R, PF_UB, PF_BPS)                                                           \
    MvkPf<PF_R, PF_UB, PF_BPS> pf{t_beg, 0, 0, nullptr};                                           \
    auto pset = [&]() {                                                                            \
        int sel, m0;                                                                               \
        task(pf.t, sel, m0);                                                                       \
        const u8* W = sel == 0 ? W0 : (sel == 1 ? W1 : W2);                                        \
        const int M = sel == 0 ? M0 : (sel == 1 ? M1 : M2);                                        \
        pf.p = W + (long long)m0 * row_bytes;                                                      \
        pf.rows = min(PF_R, M - m0);                                                               \
    };                                                                                             \
    auto padvance = [&]() {                                                                        \
        if (++pf.it == nst) {                                                                      \
            pf.it = 0;                                                                             \
            pf.t += t_step;                                                                        \
            if (pf.t < t_end) pset();                                                              \
        }                                                                                          \
    };                                                                                             \
    auto prefetch = [&]() {                                                                        \
        if (pf.t < t_end) {                                                                        \
            constexpr int NL = MvkPf<PF_R, PF_UB, PF_BPS>::NL;                                     \
            const int b0 = pf.it * PF_BPS;                                                         \
            const int len = min(PF_BPS, nb - b0) * PF_UB;                                          \
            for (int i = lane; i < pf.rows * NL; i += 32) {                                        \
                const int r = i / NL, l = i - r * NL;                                              \
                const u8* s0 = pf.p + r * row_bytes + b0 * PF_UB;                                  \
                const u8* a = (const u8*)(((size_t)s0 & ~(size_t)127) + 128 * l);                  \
                if (a < s0 + len) prefetch_l2(a);                                                  \
            }                                                                                      \
        }                                                                                          \
    };                                                                                             \
    pset();                                                                                        \
    for (int k = 0; k < S - 1; k++) padvance();       /* the steps loaded before the loop */       \
    for (int k = 0; k < LLAMBA_WPF; k++) { prefetch(); padvance(); }

// The scaffolding mvk4k and mvkt share, as macros (like MVK_PF_DEFS) so that each kernel
// expands to the same code it had: the PTX is unchanged.  In the kernel's scope they need
// R, NR, S, IL, BPS, XP, Stage, lane, warp, nb, nst, the kernel's arguments, and then
// load_w / load_x / load / compute.  What stays in each kernel is its type's part - the
// lanes a block, the weight and x registers a stage holds, the dot - which sets the
// kernel's register use and so stays written out per kernel.
//
// MVK_TASK_DEFS: the launch's tasks (R rows of W0, W1 or W2) over the grid's warps, the
// warp's range [t_beg, t_end) step t_step, task(t, sel, m0); the load cursor: task lt,
// its step lit, its first row's bytes lp, rows in it lrows; lset(), ladvance().
#define MVK_TASK_DEFS                                                                              \
    const int T0 = (M0 + R - 1) / R, T1 = (M1 + R - 1) / R, T2 = (M2 + R - 1) / R;                 \
    const int T = T0 + T1 + T2;                                                                    \
    const int nw = gridDim.x * MVK_WARPS, w = blockIdx.x * MVK_WARPS + warp;                       \
    const int t_beg = IL ? w : (int)((long long)w * T / nw),                                       \
              t_end = IL ? T : (int)((long long)(w + 1) * T / nw);                                 \
    const int t_step = IL ? nw : 1;                                                                \
    if (t_beg >= t_end) return;                                                                    \
    auto task = [&](int t, int& sel, int& m0) {                                                    \
        if (t < T0) { sel = 0; m0 = t * R; }                                                       \
        else if (t < T0 + T1) { sel = 1; m0 = (t - T0) * R; }                                      \
        else { sel = 2; m0 = (t - T0 - T1) * R; }                                                  \
    };                                                                                             \
    int lt = t_beg, lit = 0, lrows = 0;                                                            \
    const u8* lp = nullptr;                                                                        \
    auto lset = [&]() {                                                                            \
        int sel, m0;                                                                               \
        task(lt, sel, m0);                                                                         \
        const u8* W = sel == 0 ? W0 : (sel == 1 ? W1 : W2);                                        \
        const int M = sel == 0 ? M0 : (sel == 1 ? M1 : M2);                                        \
        lp = W + (long long)m0 * row_bytes;                                                        \
        lrows = min(R, M - m0);                                                                    \
    };                                                                                             \
    auto ladvance = [&]() {                                                                        \
        if (++lit == nst) {                                                                        \
            lit = 0;                                                                               \
            lt += t_step;                                                                          \
            if (lt < t_end) lset();                                                                \
        }                                                                                          \
    };

// MVK_STORE_TASK(t, it), in compute: after task t's last step, its sums acc out (with the
// bias and mode, mvs_store) and acc zeroed for the next task.
#define MVK_STORE_TASK(ST_T, ST_IT)                                                                \
    if ((ST_IT) == nst - 1) {                                                                      \
        int sel, m0;                                                                               \
        task(ST_T, sel, m0);                                                                       \
        float* y = sel == 0 ? y0 : (sel == 1 ? y1 : y2);                                           \
        const float* bias = sel == 0 ? b0 : (sel == 1 ? b1 : b2);                                  \
        const int M = sel == 0 ? M0 : (sel == 1 ? M1 : M2);                                        \
        const int ldy = sel == 0 ? ldy0 : (sel == 1 ? ldy1 : ldy2);                                \
        mvs_store<NR, R>(acc, y, bias, ldy, m0, min(R, M - m0), lane, mode);                       \
        _Pragma("unroll")                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            _Pragma("unroll")                                                                      \
            for (int n = 0; n < NR; n++) acc[r][n] = 0.f;                                          \
    }

// MVK_PIPELINE(UB): S stages, S - 1 steps' loads in flight while a step is computed
// (UB: bytes a block of the row, for the L2 prefetch of LLAMBA_WPF).
#if LLAMBA_WPF > 0
#define MVK_PF_SETUP(PF_UB) MVK_PF_DEFS(R, PF_UB, BPS)
#define MVK_PF_STEP if (lt < t_end) { prefetch(); padvance(); }
#else
#define MVK_PF_SETUP(PF_UB)
#define MVK_PF_STEP
#endif
#define MVK_PIPELINE(PL_UB)                                                                        \
    Stage buf[S];                                                                                  \
    int ct = t_beg, cit = 0;                                                                       \
    lset();                                                                                        \
    MVK_PF_SETUP(PL_UB)                                                                            \
    mvk_first_steps<S, NR, XP>(buf, lt, lit, t_end, load_w, ladvance, load_x);                     \
    while (ct < t_end) {                                                                           \
        _Pragma("unroll")                                                                          \
        for (int k = 0; k < S; k++) {                                                              \
            if (ct < t_end) {                                                                      \
                MVK_PF_STEP                                                                        \
                if (lt < t_end) { load(buf[(k + S - 1) % S]); ladvance(); }                        \
                compute(buf[k], ct, cit);                                                          \
                if (++cit == nst) { cit = 0; ct += t_step; }                                       \
            }                                                                                      \
        }                                                                                          \
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

// The first S - 1 steps of a warp's pipeline: their weights before the PDL wait (no
// kernel writes weights: they stream while the kernel before finishes), their
// activations (XP: held in the stage) after it.  lt / lit: the load cursor, which
// ladvance moves (the kernel's lambdas hold the same variables).
template <int S, int NR, bool XP, class Stage, class LoadW, class Advance, class LoadX>
DEV void mvk_first_steps(Stage* buf, int& lt, int& lit, int t_end, LoadW load_w, Advance ladvance, LoadX load_x) {
    int lits[S > 1 ? S - 1 : 1], nfirst = 0;
#pragma unroll
    for (int k = 0; k < S - 1; k++)
        if (lt < t_end) { lits[k] = lit; load_w(buf[k]); ladvance(); nfirst = k + 1; }
    PDL_WAIT();
    PDL_LATE_TRIGGER();
    if constexpr (XP) {
#pragma unroll
        for (int k = 0; k < S - 1; k++)
            if (k < nfirst)
#pragma unroll
                for (int n = 0; n < NR; n++) load_x(buf[k].x[n], n, lits[k]);
    }
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
    PDL_EARLY_TRIGGER();
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
    MVK_TASK_DEFS
    // loads past the matrix read its last block / row again (finite, never summed / stored)
    auto load_x = [&](MvkX<LPB>& X, int n, int it) {
        const int blk = it * BPS + q;
        mvk_load_x<LPB>(X, xq + (long long)n * K, xd + (long long)n * (K / 256), xi + (long long)n * (K / 32),
                        min(blk, nb - 1), j, blk < nb);
    };
    auto load_w = [&](Stage& st) {
        const u8* p = lp + min(lit * BPS + q, nb - 1) * 144;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const u8* pr = p + (r < lrows ? r : lrows - 1) * row_bytes;
            st.w[r].h = ldg_w<1>(pr);
#pragma unroll
            for (int i = 0; i < NW; i++) st.w[r].q[i] = ldg_w<1>(pr + 16 + 16 * (j + LPB * i));
        }
    };
    auto load = [&](Stage& st) {
        load_w(st);
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
        MVK_STORE_TASK(t, it)
    };

    MVK_PIPELINE(144)
}

// ---------------------------------------------------------------- mvkt: other types
// The same persistent, register-pipelined matvec for a type policy Ty that reads a row
// as units of 256 weights, 4 lanes a unit (lane j: 64 of its weights), a step R rows x 8
// units.  Ty: UB (bytes a unit), NA (1: weights kept out of L1), XDR (x steps a 256-unit),
// W / X (a lane's weights of one unit / x of one unit), load(W, unit, j),
// load_x(X, xq, xd, xi, unit, j, ok) (row pointers; ok false: X adds nothing),
// dot(W, X, j, acc).  Sums: exact integers per block, then float FMAs in block order, the
// warp's butterfly: the same operations for any NR, R and grid (batch invariance).

// Q4_0 as units of 8 blocks (144 bytes, 16-byte aligned when K % 256 == 0): lane j
// takes blocks 2j, 2j + 1, bytes [36j, 36j + 36) of the unit, from its 16-byte words
// 2j .. 2j + 2 (u32 offset j of the 12 loaded; realigned by selects on j's bits).
struct MQ4_0 {
    static constexpr int UB = 144, NA = 1, XDR = 8;
    struct W { uint4 v[3]; };
    struct X { int w[16]; int m8[2]; float d[2]; };
    DEV void load(W& B, const u8* u, int j) {
#pragma unroll
        for (int i = 0; i < 3; i++) B.v[i] = ldg_w<NA>(u + 32 * j + 16 * i);
    }
    DEV void load_x(X& X_, const signed char* __restrict__ xq, const float* __restrict__ xd,
                           const u32* __restrict__, int u, int j, bool ok) {
        const signed char* p = xq + 256 * u + 64 * j;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint4 v = *(const uint4*)(p + 16 * i);
            X_.w[4 * i] = (int)v.x; X_.w[4 * i + 1] = (int)v.y; X_.w[4 * i + 2] = (int)v.z; X_.w[4 * i + 3] = (int)v.w;
        }
#pragma unroll
        for (int b = 0; b < 2; b++) {               // -8 * (sum of the block's codes)
            int s = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) s = __dp4a((int)0xF8F8F8F8u, X_.w[8 * b + k], s);
            X_.m8[b] = s;
        }
        const float2 d = *(const float2*)(xd + 8 * u + 2 * j);
        X_.d[0] = ok ? d.x : 0.f; X_.d[1] = ok ? d.y : 0.f;
    }
    DEV void dot(const W& B, const X& X_, int j, float& acc) {
        u32 L[12] = {B.v[0].x, B.v[0].y, B.v[0].z, B.v[0].w, B.v[1].x, B.v[1].y, B.v[1].z, B.v[1].w,
                     B.v[2].x, B.v[2].y, B.v[2].z, B.v[2].w};
        u32 U[10], T[9];
#pragma unroll
        for (int k = 0; k < 10; k++) U[k] = (j & 2) ? L[k + 2] : L[k];
#pragma unroll
        for (int k = 0; k < 9; k++) T[k] = (j & 1) ? U[k + 1] : U[k];
        // block 2j: d in T[0]'s low half, qs from byte 2; block 2j + 1: d in T[4]'s high half, qs T[5..8]
#pragma unroll
        for (int b = 0; b < 2; b++) {
            u32 q[4];
#pragma unroll
            for (int k = 0; k < 4; k++) q[k] = b == 0 ? __funnelshift_r(T[k], T[k + 1], 16) : T[5 + k];
            int sl = X_.m8[b], s4 = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                sl = __dp4a((int)(q[k] & 0x0F0F0F0Fu), X_.w[8 * b + k], sl);
                s4 = dp4a_us(q[k] & 0xF0F0F0F0u, X_.w[8 * b + 4 + k], s4);
            }
            const u16 dh = b == 0 ? (u16)(T[0] & 0xFFFFu) : (u16)(T[4] >> 16);
            const float d = __half2float(__ushort_as_half(dh));
            acc = fmaf(d * X_.d[b], (float)(sl + (s4 >> 4)), acc);
        }
    }
};

// Q6_K (210-byte blocks, only 2-byte aligned): lane j of a block takes half h = j >> 1,
// bytes l0 = 16 (j & 1) of it: ql[64h + l0 ..+16), ql[64h + 32 + l0 ..+16),
// qh[32h + l0 ..+16) (runs t = 0..3 of 16 weights: 128h + l0 + 32t, scale 8h + (j & 1) + 2t)
// and the scales and d; each region from the two aligned 16-byte words around it
// (realigned by the block's offset mod 16: selects, then a funnel shift).  Codes q in
// 0..63 dotted as they are; the -32 by q8_act's run sums (xi, mvk's order):
//     I = sum_t sc_t * (sum q * qx  -  32 * sum qx)
struct MQ6_K {
    static constexpr int UB = 210, NA = 0, XDR = 1;
    struct W { uint4 v[8]; u32 o; };
    struct X { int w[16]; int bs[2]; float d; };
    DEV void load(W& B, const u8* u, int j) {
        const int h = j >> 1, l0 = 16 * (j & 1);
        const int off[4] = {64 * h + l0, 64 * h + 32 + l0, 128 + 32 * h + l0, 192};
        const u8* a = (const u8*)((size_t)u & ~(size_t)15);
#pragma unroll
        for (int r = 0; r < 4; r++) {
            B.v[2 * r] = ldg_w<NA>(a + off[r]);
            B.v[2 * r + 1] = ldg_w<NA>(a + off[r] + 16);
        }
        B.o = (u32)(size_t)u & 15u;
    }
    DEV void load_x(X& X_, const signed char* __restrict__ xq, const float* __restrict__ xd,
                           const u32* __restrict__ xi, int u, int j, bool ok) {
        const int h = j >> 1, f = j & 1;
#pragma unroll
        for (int t = 0; t < 4; t++) {
            const uint4 v = *(const uint4*)(xq + 256 * u + 128 * h + 16 * f + 32 * t);
            X_.w[4 * t] = (int)v.x; X_.w[4 * t + 1] = (int)v.y; X_.w[4 * t + 2] = (int)v.z; X_.w[4 * t + 3] = (int)v.w;
        }
        // run 8h + f + 2t: xi short 8(t >> 1) + 4f + 2h + (t & 1) of the block
        X_.bs[0] = (int)xi[8 * u + 2 * f + h];
        X_.bs[1] = (int)xi[8 * u + 4 + 2 * f + h];
        X_.d = ok ? xd[u] : 0.f;
    }
    // bytes [o, o + 4N) of the 8 words L as N words
    template <int N>
    DEV void realign(const uint4& lo, const uint4& hi, u32 o, u32* R) {
        const u32 L[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        u32 U[N + 3], V[N + 1];
#pragma unroll
        for (int k = 0; k < N + 3; k++) U[k] = (o & 8u) ? L[k + 2 < 8 ? k + 2 : 7] : L[k];
#pragma unroll
        for (int k = 0; k < N + 1; k++) V[k] = (o & 4u) ? U[k + 1] : U[k];
        const u32 s = (o & 3u) * 8u;
#pragma unroll
        for (int k = 0; k < N; k++) R[k] = __funnelshift_r(V[k], V[k + 1], s);
    }
    DEV void dot(const W& B, const X& X_, int j, float& acc) {
        u32 A[4], C[4], E[4], S[5];
        realign<4>(B.v[0], B.v[1], B.o, A);
        realign<4>(B.v[2], B.v[3], B.o, C);
        realign<4>(B.v[4], B.v[5], B.o, E);
        realign<5>(B.v[6], B.v[7], B.o, S);
        const int h = j >> 1, f = j & 1;
        const u32 s0 = h ? S[2] : S[0], s1 = h ? S[3] : S[1];       // scales 8h .. 8h + 7
        const float d = __half2float(__ushort_as_half((u16)(S[4] & 0xFFFFu)));
        const u32 sel = f ? 0x3331u : 0x3320u;                       // bytes f, 2 + f
        int sc[4];
        sc[0] = (int)(signed char)(s0 >> (8 * f)); sc[1] = (int)(signed char)(s0 >> (16 + 8 * f));
        sc[2] = (int)(signed char)(s1 >> (8 * f)); sc[3] = (int)(signed char)(s1 >> (16 + 8 * f));
        int I = 0;
#pragma unroll
        for (int t = 0; t < 4; t++) {
            const u32* Q = (t & 1) ? C : A;
            const int sh = 4 * (t >> 1);
            int s = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const u32 q = ((Q[k] >> sh) & 0x0F0F0F0Fu) | (((E[k] >> (2 * t)) & 0x03030303u) << 4);
                s = __dp4a((int)q, X_.w[4 * t + k], s);
            }
            I += sc[t] * s;
        }
        // sum_t sc_t * (run sum of x): scale bytes (f, 2 + f) against xi's int16 pairs
        int m = __dp2a_lo(X_.bs[0], (int)__byte_perm(s0, 0u, sel), 0);
        m = __dp2a_lo(X_.bs[1], (int)__byte_perm(s1, 0u, sel), m);
        acc = fmaf(d * X_.d, (float)(I - 32 * m), acc);
    }
};

template <class Ty, int R, int NX>
struct MvktStage {
    typename Ty::W w[R];
    typename Ty::X x[NX > 0 ? NX : 1];
};

// mvk4k's grid and pipeline for a type policy Ty (above); IL: tasks interleaved over
// the warps.  xs: q8_act's packed run sums (xi) where Ty reads them.
template <class Ty, int NR, int R, int S, int IL>
__global__ void __launch_bounds__(32 * MVK_WARPS) mvkt(
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,
        float* y0, float* y1, float* y2,
        const float* b0, const float* b1, const float* b2,
        int M0, int M1, int M2,
        int K, long long row_bytes, const signed char* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, int ldy0, int ldy1, int ldy2, int mode) {
    PDL_EARLY_TRIGGER();
    static_assert(R * NR <= 32, "a lane per output");
    constexpr int BPS = 8;
    constexpr bool XP = NR <= 2;                       // x a step ahead with the weights
    using Stage = MvktStage<Ty, R, XP ? NR : 0>;
    using X = typename Ty::X;
    const u32* __restrict__ xi = (const u32*)xs;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q = lane >> 2, j = lane & 3;
    const int nb = K / 256, nst = (nb + BPS - 1) / BPS;
    MVK_TASK_DEFS
    auto load_x = [&](X& X_, int n, int it) {
        const int blk = it * BPS + q;
        Ty::load_x(X_, xq + (long long)n * K, xd + (long long)n * (K / 256) * Ty::XDR, xi + (long long)n * (K / 32),
                   min(blk, nb - 1), j, blk < nb);
    };
    auto load_w = [&](Stage& st) {
        const u8* p = lp + min(lit * BPS + q, nb - 1) * Ty::UB;
#pragma unroll
        for (int r = 0; r < R; r++) Ty::load(st.w[r], p + (r < lrows ? r : lrows - 1) * row_bytes, j);
    };
    auto load = [&](Stage& st) {
        load_w(st);
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

    auto compute = [&](const Stage& st, int t, int it) {
        if constexpr (XP) {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int n = 0; n < NR; n++) Ty::dot(st.w[r], st.x[n], j, acc[r][n]);
        } else {
#pragma unroll
            for (int n = 0; n < NR; n++) {
                X X_;
                load_x(X_, n, it);
#pragma unroll
                for (int r = 0; r < R; r++) Ty::dot(st.w[r], X_, j, acc[r][n]);
            }
        }
        MVK_STORE_TASK(t, it)
    };

    MVK_PIPELINE(Ty::UB)
}
