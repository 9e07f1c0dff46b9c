// Mixture of experts at decode (n <= 8 rows; quant/cuda/__init__.py moe_route,
// matvec_ids, moe_combine): the router's top-k on the device and matvecs whose weights
// are chosen by expert ids read from device memory, so a MoE decode step needs no host
// round trip and is captured as a CUDA graph like a dense one.
//
//   router logits (mvf / any matvec) -> moe_route_q8: a row's top-k experts and weights,
//   and the rounding of x for the experts' gate / up -> mvk4k_id / mvkt_id / mvs_id: gate
//   and up of every (row, slot) pair -> (SiLU . up folded into the rounding) -> down of
//   every pair -> moe_combine: a row's weighted sum of its pairs (into the residual).
//
// Every piece computes what the host-routed path computes (runtime/backend/moe.py's
// route; a matvec per expert on its rows): the same operations in the same order, so
// the two paths' logits are equal bit for bit, and a row's bits never depend on the
// other rows of the step (batch invariance).
#pragma once
#include "qmvk.cuh"

constexpr int MOE_MAX_E = 512;                 // experts a router row (quant.cuda.MOE_MAX_EXPERTS)
constexpr int MOE_MAX_K = 32;                  // chosen a row (quant.cuda.MOE_MAX_TOPK)

// ---------------------------------------------------------------- routing
// exp(x) by one fixed sequence of correctly rounded float64 operations, moe.py's exp_det
// step for step (the __d*_rn intrinsics are never fused into FMAs): x = k ln2 + r,
// exp(r) by Taylor's series to r^13 / 13! in Horner's order, times 2^k.
DEV double exp_det(double x) {
    if (!(x > -745.2)) return 0.0;
    if (x > 709.7) return __longlong_as_double(0x7ff0000000000000LL);
    const double k = rint(__dmul_rn(x, 0x1.71547652b82fep+0));
    const double r = __dsub_rn(__dsub_rn(x, __dmul_rn(k, 0x1.62e42fee00000p-1)), __dmul_rn(k, 0x1.a39ef35793c76p-33));
    const double c[14] = {0x1.0000000000000p+0, 0x1.0000000000000p+0, 0x1.0000000000000p-1, 0x1.5555555555555p-3,
                          0x1.5555555555555p-5, 0x1.1111111111111p-7, 0x1.6c16c16c16c17p-10, 0x1.a01a01a01a01ap-13,
                          0x1.a01a01a01a01ap-16, 0x1.71de3a556c734p-19, 0x1.27e4fb7789f5cp-22, 0x1.ae64567f544e4p-26,
                          0x1.1eed8eff8d898p-29, 0x1.6124613a86d09p-33};
    double p = c[13];
#pragma unroll
    for (int i = 12; i >= 0; i--) p = __dadd_rn(__dmul_rn(p, r), c[i]);
    return ldexp(p, (int)k);
}

// One row of router logits lg [E] -> its k experts of highest softmax probability (the
// lower index first on a tie) in ascending order in ids [k], their probabilities in w
// [k], renormalized over the k when norm: moe.py's route, operation for operation (the
// max, the terms p_e = exp_det(l_e - max), their sum in expert order, the choice, the
// k quotients p_e / sum and their sum in ascending order, the renormalization).  One
// warp; p: E doubles, q: k doubles of shared memory.  E <= MOE_MAX_E, k <= MOE_MAX_K.
DEV void moe_route_warp(const float* __restrict__ lg, int E, int k, int norm, int* __restrict__ ids,
                        float* __restrict__ w, double* p, double* q, int lane) {
    constexpr unsigned FULL = 0xffffffffu;
    float m = lg[0];
    for (int e = lane; e < E; e += 32) m = fmaxf(m, lg[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
#pragma unroll 4
    for (int e = lane; e < E; e += 32) p[e] = exp_det(__dsub_rn((double)lg[e], (double)m));   // (independent: overlapped)
    __syncwarp();
    double s = 0.0;
    if (lane == 0)
        for (int e = 0; e < E; e++) s = __dadd_rn(s, p[e]);
    s = __shfl_sync(FULL, s, 0);
    // k rounds of the warp's largest untaken term (bit i of taken: expert lane + 32 i)
    const int per = (E + 31) / 32;
    unsigned taken = 0u;
    for (int j = 0; j < k; j++) {
        double bp = -1.0;
        int bi = 0x7fffffff;
        for (int i = 0; i < per; i++) {
            const int e = lane + 32 * i;
            if (e < E && !((taken >> i) & 1u)) {
                const double v = p[e];
                if (v > bp) { bp = v; bi = e; }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const double op = __shfl_xor_sync(FULL, bp, o);
            const int oi = __shfl_xor_sync(FULL, bi, o);
            if (op > bp || (op == bp && oi < bi)) { bp = op; bi = oi; }
        }
        if (bi != 0x7fffffff && (bi & 31) == lane) taken |= 1u << (bi >> 5);
    }
    // the chosen in ascending order: expert lane + 32 i lands after every chosen one below it
    int base = 0;
    for (int i = 0; i < per; i++) {
        const bool mine = (taken >> i) & 1u;
        const unsigned mask = __ballot_sync(FULL, mine);
        if (mine) {
            const int pos = base + __popc(mask & ((1u << lane) - 1u));
            const int e = lane + 32 * i;
            ids[pos] = e;
            q[pos] = __ddiv_rn(p[e], s);
        }
        base += __popc(mask);
    }
    for (int j = base + lane; j < k; j += 32) {      // (fewer than k only with NaN logits)
        ids[j] = 0;
        q[j] = 0.0;
    }
    __syncwarp();
    if (lane == 0) {
        double tot = 0.0;
        for (int j = 0; j < k; j++) tot = __dadd_rn(tot, q[j]);
        for (int j = 0; j < k; j++) {
            const float wj = __double2float_rn(q[j]);
            w[j] = norm ? __double2float_rn(__ddiv_rn((double)wj, tot)) : wj;
        }
    }
}

// The decode MoE block's first kernel after the router's matvec: q8_act<BS, 0> of x
// (the FFN's normed input, [n, K], for the experts' gate and up; warps 0-7, grid
// (ceil(K / 2048), n) as q8_act's) and, in a ninth warp of block (0, t), row t's routing
// from logits [n, E] into ids, w [n, k].
template <int BS>
__global__ void __launch_bounds__(288) moe_route_q8(
        const float* __restrict__ x, int ldx, int K, signed char* __restrict__ xq, float* __restrict__ xd,
        float* __restrict__ xs, short* __restrict__ xi, const float* __restrict__ logits, int E, int k, int norm,
        int* __restrict__ ids, float* __restrict__ w) {
    __shared__ double p[MOE_MAX_E];
    __shared__ double q[MOE_MAX_K];
    const int n = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp == 8) {
        PDL_ENTER();
        if (blockIdx.x == 0)
            moe_route_warp(logits + (long long)n * E, E, k, norm, ids + (long long)n * k, w + (long long)n * k, p, q,
                           lane);
        return;
    }
    const int e = (blockIdx.x * 8 + warp) * 256 + lane * 8;
    float v[8];
    act_prologue<0>(x, ldx, nullptr, nullptr, 0.f, K, n, e, lane, warp, v);
    q8_store<BS>(v, e < K, lane, e, xq + (long long)n * K, xd + (long long)n * (K / BS), xs + (long long)n * (K / 16),
                 xi ? xi + (long long)n * (K / 16) : nullptr);
}

// out[t, c] = (mode 1: out[t, c] +) sum over j < k, in order, of w[t k + j] * y[r, c],
// r = pos[t k + j] (the host-routed path's grouped rows) or t k + j (pos null).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const int* __restrict__ pos,
                                       const float* __restrict__ w, int n, int k, int d, float* out, int mode) {
    PDL_ENTER();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * d) return;
    const int t = (int)(i / d), c = (int)(i % d);
    float s = 0.f;
    for (int j = 0; j < k; j++) {
        const int r = pos ? pos[t * k + j] : t * k + j;
        s = fmaf(w[t * k + j], y[(long long)r * d + c], s);
    }
    if (mode == 1) out[i] += s;
    else out[i] = s;
}

// ---------------------------------------------------------------- matvecs by expert id
// y_s[p, m] = x[p / xdiv] . W_s[ids[p]][m] for the P (row, slot) pairs p and the nsel
// (1 or 2: gate and up) expert tensors W_s: expert e's rows start at byte e * estride of
// W_s, M rows of K; x as q8_act rounds it (xq, xd, xs: one row of x a row of pairs for
// down, xdiv = 1; k pairs a row of x for gate / up, xdiv = k).  Each pair is a matvec of
// one row of x by its expert's matrix with the sums of the kernel the host-routed path
// runs on that matrix (mvk4k, mvkt, mvs: each row summed the same way whatever the rows
// of x and the grid), so the two paths agree bit for bit.  The weights to read are an
// input here (no loads before the PDL wait, unlike the dense matvecs).

// mvs by id: grid (ceil(M / (R MVS_WARPS)), nsel P)
template <class T, int R>
__global__ void __launch_bounds__(32 * MVS_WARPS) mvs_id(
        const u8* __restrict__ W0, const u8* __restrict__ W1, float* y0, float* y1, int nsel, int M, int K,
        long long row_bytes, long long estride, const int* __restrict__ ids, int P, int xdiv,
        const signed char* __restrict__ xq, const float* __restrict__ xd, const float* __restrict__ xs) {
    PDL_EARLY_TRIGGER();
    PDL_WAIT();
    PDL_LATE_TRIGGER();
    const int sel = blockIdx.y >= P, p = blockIdx.y - sel * P, xr = p / xdiv;
    const u8* W = (sel ? W1 : W0) + (long long)ids[p] * estride;
    float* y = (sel ? y1 : y0) + (long long)p * M;
    mvs_run<T, 1, R, false>(W, y, nullptr, M, K, row_bytes, xq + (long long)xr * K,
                            xd + (long long)xr * (K / T::QK), xs + (long long)xr * (K / 16), M, 0);
}

// mvk's persistent grid over tasks of R rows of one pair: task t = (s, p, m0), W_0's pairs
// first; the load cursor also keeps its pair's x row (lx).  In a kernel's scope as
// MVK_TASK_DEFS's (R, IL, lane, warp, nst and the arguments).
#define MVK_ID_TASK_DEFS                                                                           \
    const int TM = (M + R - 1) / R, TP = P * TM, T = nsel * TP;                                    \
    const int nw = gridDim.x * MVK_WARPS, w = blockIdx.x * MVK_WARPS + warp;                       \
    const int t_beg = IL ? w : (int)((long long)w * T / nw),                                       \
              t_end = IL ? T : (int)((long long)(w + 1) * T / nw);                                 \
    const int t_step = IL ? nw : 1;                                                                \
    if (t_beg >= t_end) return;                                                                    \
    auto task = [&](int t, int& sel, int& p, int& m0) {                                            \
        sel = t >= TP;                                                                             \
        const int r = t - sel * TP;                                                                \
        p = r / TM;                                                                                \
        m0 = (r - p * TM) * R;                                                                     \
    };                                                                                             \
    int lt = t_beg, lit = 0, lrows = 0, lx = 0;                                                    \
    const u8* lp = nullptr;                                                                        \
    auto lset = [&]() {                                                                            \
        int sel, p, m0;                                                                            \
        task(lt, sel, p, m0);                                                                      \
        lp = (sel ? W1 : W0) + (long long)ids[p] * estride + (long long)m0 * row_bytes;            \
        lrows = min(R, M - m0);                                                                    \
        lx = p / xdiv;                                                                             \
    };                                                                                             \
    auto ladvance = [&]() {                                                                        \
        if (++lit == nst) {                                                                        \
            lit = 0;                                                                               \
            lt += t_step;                                                                          \
            if (lt < t_end) lset();                                                                \
        }                                                                                          \
    };

// after task t's last step: its R sums out (row p of y_s) and acc zeroed
#define MVK_ID_STORE_TASK(ST_T, ST_IT)                                                             \
    if ((ST_IT) == nst - 1) {                                                                      \
        int sel, p, m0;                                                                            \
        task(ST_T, sel, p, m0);                                                                    \
        mvs_store<1, R>(acc, (sel ? y1 : y0) + (long long)p * M, nullptr, 0, m0, min(R, M - m0), lane, 0); \
        _Pragma("unroll")                                                                          \
        for (int r = 0; r < R; r++) acc[r][0] = 0.f;                                               \
    }

// MVK_PIPELINE's S stages after the wait: a step's weights and x loaded together
#define MVK_ID_PIPELINE                                                                            \
    Stage buf[S];                                                                                  \
    int ct = t_beg, cit = 0;                                                                       \
    lset();                                                                                        \
    _Pragma("unroll")                                                                              \
    for (int k = 0; k < S - 1; k++)                                                                \
        if (lt < t_end) { load(buf[k]); ladvance(); }                                              \
    while (ct < t_end) {                                                                           \
        _Pragma("unroll")                                                                          \
        for (int k = 0; k < S; k++) {                                                              \
            if (ct < t_end) {                                                                      \
                if (lt < t_end) { load(buf[(k + S - 1) % S]); ladvance(); }                        \
                compute(buf[k], ct, cit);                                                          \
                if (++cit == nst) { cit = 0; ct += t_step; }                                       \
            }                                                                                      \
        }                                                                                          \
    }

// mvk4k by id (Q4_K): mvk4k<1, R, S, V>'s lanes and sums; grid: the persistent one
template <int R, int S, int V>
__global__ void __launch_bounds__(32 * MVK_WARPS) mvk4k_id(
        const u8* __restrict__ W0, const u8* __restrict__ W1, float* y0, float* y1, int nsel, int M, int K,
        long long row_bytes, long long estride, const int* __restrict__ ids, int P, int xdiv,
        const signed char* __restrict__ xq, const float* __restrict__ xd, const float* __restrict__ xs) {
    PDL_EARLY_TRIGGER();
    static_assert(R <= 32, "a lane per output");
    constexpr int LPB = (V & 2) ? 2 : 4, BPS = 32 / LPB, NW = 8 / LPB;
    constexpr bool IL = V & 1;
    constexpr bool XP = LPB == 4;                      // x a step ahead with the weights
    using Stage = MvkStage<LPB, R, XP ? 1 : 0>;
    const u32* __restrict__ xi = (const u32*)xs;      // q8_act's packed run sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q = lane / LPB, j = lane % LPB, sh = 16 * (j >> 1);
    const int nb = K / 256, nst = (nb + BPS - 1) / BPS;
    PDL_WAIT();                                       // ids and x come from the kernels before
    PDL_LATE_TRIGGER();
    MVK_ID_TASK_DEFS
    auto load_x = [&](MvkX<LPB>& X, int xr, int it) {
        const int blk = it * BPS + q;
        mvk_load_x<LPB>(X, xq + (long long)xr * K, xd + (long long)xr * (K / 256), xi + (long long)xr * (K / 32),
                        min(blk, nb - 1), j, blk < nb);
    };
    auto load = [&](Stage& st) {
        const u8* pb = lp + min(lit * BPS + q, nb - 1) * 144;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const u8* pr = pb + (r < lrows ? r : lrows - 1) * row_bytes;
            st.w[r].h = ldg_w<1>(pr);
#pragma unroll
            for (int i = 0; i < NW; i++) st.w[r].q[i] = ldg_w<1>(pr + 16 + 16 * (j + LPB * i));
        }
        if constexpr (XP) load_x(st.x[0], lx, lit);
    };

    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = 0.f;

    auto compute = [&](const Stage& st, int t, int it) {
        if constexpr (XP) {
#pragma unroll
            for (int r = 0; r < R; r++) mvk_dot<LPB>(st.w[r], st.x[0], sh, acc[r][0]);
        } else {
            int sel, p, m0;
            task(t, sel, p, m0);
            MvkX<LPB> X;
            load_x(X, p / xdiv, it);
#pragma unroll
            for (int r = 0; r < R; r++) mvk_dot<LPB>(st.w[r], X, sh, acc[r][0]);
        }
        MVK_ID_STORE_TASK(t, it)
    };

    MVK_ID_PIPELINE
}

// mvkt by id (Q6_K, Q4_0 where K % 256 == 0): mvkt<Ty, 1, R, S, IL>'s lanes and sums
template <class Ty, int R, int S, int IL>
__global__ void __launch_bounds__(32 * MVK_WARPS) mvkt_id(
        const u8* __restrict__ W0, const u8* __restrict__ W1, float* y0, float* y1, int nsel, int M, int K,
        long long row_bytes, long long estride, const int* __restrict__ ids, int P, int xdiv,
        const signed char* __restrict__ xq, const float* __restrict__ xd, const float* __restrict__ xs) {
    PDL_EARLY_TRIGGER();
    static_assert(R <= 32, "a lane per output");
    constexpr int BPS = 8;
    using Stage = MvktStage<Ty, R, 1>;
    using X = typename Ty::X;
    const u32* __restrict__ xi = (const u32*)xs;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q = lane >> 2, j = lane & 3;
    const int nb = K / 256, nst = (nb + BPS - 1) / BPS;
    PDL_WAIT();                                       // ids and x come from the kernels before
    PDL_LATE_TRIGGER();
    MVK_ID_TASK_DEFS
    auto load = [&](Stage& st) {
        const u8* pb = lp + min(lit * BPS + q, nb - 1) * Ty::UB;
#pragma unroll
        for (int r = 0; r < R; r++) Ty::load(st.w[r], pb + (r < lrows ? r : lrows - 1) * row_bytes, j);
        const int blk = lit * BPS + q;
        Ty::load_x(st.x[0], xq + (long long)lx * K, xd + (long long)lx * (K / 256) * Ty::XDR,
                   xi + (long long)lx * (K / 32), min(blk, nb - 1), j, blk < nb);
    };

    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r][0] = 0.f;

    auto compute = [&](const Stage& st, int t, int it) {
#pragma unroll
        for (int r = 0; r < R; r++) Ty::dot(st.w[r], st.x[0], j, acc[r][0]);
        MVK_ID_STORE_TASK(t, it)
    };

    MVK_ID_PIPELINE
}
