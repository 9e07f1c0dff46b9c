// Lab (not in the product): Q4_K decode matvec for 9-32 rows of x on the tensor cores, whose
// every output equals mvk4k's (qmvk.cuh, LPB 4) for that row alone, bit for bit.
//
// mvk4k's float operations are kept; only its exact integers come from MMAs.  Output m, row n:
// lane class L = 4q + j (q: block slot of an 8-block step, j: piece, qs words j and j + 4)
// sums over its blocks blk = 8 it + q in order
//     acc = fmaf(d * xd, I, acc);  acc = fmaf(-(dmin * xd), M, acc)
// (I: the piece's four runs, sum of sc * q . x; M: sum of mn * (sum of the run's x codes);
// blocks past K: the last block's I and M with xd = 0, as mvk4k); then the warp's butterfly
// (xor 16, 8, 4, 2, 1).  Here a warp computes a 16-row x 8-output tile: q is walked in the
// butterfly's order (0, 4, 2, 6, 1, 5, 3, 7), all four pieces at once, and each finished q
// folded into a per-piece stack as the butterfly pairs them.
//
// mma4k_t: I by mma.m16n8k16 f16 -> f32: A = the codes (|x| <= 127), B = sc * q (<= 63 * 15);
// every partial sum is an integer below 2^24 (lab.mma_exact checks the adder keeps them).  M
// the same way, k = the piece's 4 runs (threads t = 0 only; the rest of k is zero).  The k
// order inside a run is permuted (thread t takes bytes 4t..4t+3 of the run for both operands):
// a sum does not depend on it.  mma4k_i8, mma6k_k, mma6k_s: the integers by s8 MMAs.
#include <cuda_fp16.h>
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
#define DEV static __device__ __forceinline__

DEV u32 h2u(__half2 h) { return *(u32*)&h; }

// 4 nibbles (one per byte, at bit 0 of each byte) times sc -> half2 pairs, exact (<= 945)
DEV void nib_h2(u32 v, __half sc, u32& lo, u32& hi) {
    const __half2 s2 = __half2half2(sc);
    // 1024 + q as fp16 bit patterns (0x6400 | q), then - 1024: exact
    const __half2 k = __float2half2_rn(1024.f);
    u32 a = (v & 0x000F000Fu) | 0x64006400u;          // bytes 0, 2
    u32 b = ((v >> 8) & 0x000F000Fu) | 0x64006400u;   // bytes 1, 3
    __half2 qa = __hsub2(*(__half2*)&a, k), qb = __hsub2(*(__half2*)&b, k);
    // pairs in byte order: (0, 1), (2, 3)
    __half2 p01 = __lows2half2(qa, qb), p23 = __highs2half2(qa, qb);
    lo = h2u(__hmul2(p01, s2));
    hi = h2u(__hmul2(p23, s2));
}

DEV void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// the 6-bit scale / min of sub-block s from a Q4_K header's words Y, Z, W (bytes 4..15)
DEV int k4_scale(u32 Y, u32 Z, u32 W, int s, bool mn) {
    const u32 lo = mn ? (Z & 0x3F3F3F3Fu) : (Y & 0x3F3F3F3Fu);
    const u32 hi = mn ? (((W >> 4) & 0x0F0F0F0Fu) | ((Z >> 2) & 0x30303030u))
                      : ((W & 0x0F0F0F0Fu) | ((Y >> 2) & 0x30303030u));
    return (int)(((s < 4 ? lo : hi) >> (8 * (s & 3))) & 0xFFu);
}

// fold the finished class q (the qi-th of the walk 0, 4, 2, 6, 1, 5, 3, 7) into a C element's
// butterfly stack: level 0 holds q until q ^ 4 comes (the butterfly's xor 16), level 1 that
// pair until the pair of q ^ 2 comes (xor 8), level 2 the sum over q (xor 4) in the end
DEV void fold_q(float (&st)[3], int qi, float a) {
    if (qi % 2 == 0) { st[0] = a; return; }
    const float p = st[0] + a;
    if (qi % 4 == 1) { st[1] = p; return; }
    const float c = st[1] + p;
    st[2] = qi == 3 ? c : st[2] + c;
}

// the 4 pieces' sums of C element e: the butterfly's last levels (j with j ^ 2, then j ^ 1)
DEV float pieces_sum(const float (&stk)[4][4][3], int e) {
    return (stk[0][e][2] + stk[2][e][2]) + (stk[1][e][2] + stk[3][e][2]);
}

// a thread's 4 C elements: rows r0 + g (+ 8), outputs o0 + 2t (+ 1)
DEV void store4(const float (&res)[4], float* y, int ldy, int M, int n, int r0, int o0, int g, int t) {
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int row = r0 + g + 8 * (e >> 1), out = o0 + 2 * t + (e & 1);
        if (row < n && out < M) y[(long long)row * ldy + out] = res[e];
    }
}

// ---------------------------------------------------------------- Q4_K, int8
// mma4k_i8: y[n, m] = x W^T for n <= 32 rows, grid (ceil(M / 32), ceil(n / 16)), 128 threads;
// xq int8 [n, K], xd float [n, K / 256], xi int16 [n, K / 16] (q8_act's, mvk's order).  The
// walk above; the integers by mma.m16n8k16 s8 -> s32 (exact by construction: no question of
// the adder), one MMA a run (A = the codes, B = the nibbles), then on the integer pipe
// I += sc * S and M += mn * bs per C element and run, with the scales of the C element's
// outputs (2t, 2t + 1: their headers' words by shuffle).
DEV void mma16816_s8(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

extern "C" __global__ void __launch_bounds__(128) mma4k_i8(
        const u8* __restrict__ W, int M, int K, long long row_bytes, const signed char* __restrict__ xq,
        const float* __restrict__ xd, const short* __restrict__ xi, float* __restrict__ y, int ldy, int n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int o0 = (blockIdx.x * 4 + warp) * 8;
    if (o0 >= M) return;
    const int r0 = blockIdx.y * 16;
    const int nb = K / 256, nst = (nb + 7) / 8;
    const u8* wrow = W + (long long)min(o0 + g, M - 1) * row_bytes;
    const int ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);
    const signed char* xa = xq + (long long)ra * K;
    const signed char* xb = xq + (long long)rb * K;
    float stk[4][4][3];
    constexpr int QORD[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#pragma unroll
    for (int qi = 0; qi < 8; qi++) {
        const int q = QORD[qi];
        float acc[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[j][e] = 0.f;
        for (int it = 0; it < nst; it++) {
            const int blk0 = it * 8 + q, blk = min(blk0, nb - 1);
            const bool ok = blk0 < nb;
            const u8* b = wrow + (long long)blk * 144;
            const uint4 h = *(const uint4*)b;
            // headers of outputs 2t (lane 8t) and 2t + 1 (lane 8t + 4)
            uint4 hh[2];
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int src = 8 * t + 4 * u;
                hh[u].x = __shfl_sync(0xffffffffu, h.x, src);
                hh[u].y = __shfl_sync(0xffffffffu, h.y, src);
                hh[u].z = __shfl_sync(0xffffffffu, h.z, src);
                hh[u].w = __shfl_sync(0xffffffffu, h.w, src);
            }
            const float d0 = __half2float(__ushort_as_half((u16)(hh[0].x & 0xFFFFu)));
            const float m0 = __half2float(__ushort_as_half((u16)(hh[0].x >> 16)));
            const float d1 = __half2float(__ushort_as_half((u16)(hh[1].x & 0xFFFFu)));
            const float m1 = __half2float(__ushort_as_half((u16)(hh[1].x >> 16)));
            const float xda = ok ? xd[(long long)ra * nb + blk] : 0.f;
            const float xdb = ok ? xd[(long long)rb * nb + blk] : 0.f;
            const float dx[4] = {d0 * xda, d1 * xda, d0 * xdb, d1 * xdb};
            const float ndm[4] = {-(m0 * xda), -(m1 * xda), -(m0 * xdb), -(m1 * xdb)};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int I[4] = {0, 0, 0, 0}, Mn[4] = {0, 0, 0, 0};
                // the piece's run sums of x (xi: word j lo, hi, word j + 4 lo, hi), rows g, g + 8
                const short* pa = xi + (long long)ra * (K / 16) + blk * 16 + 4 * j;
                const short* pb = xi + (long long)rb * (K / 16) + blk * 16 + 4 * j;
#pragma unroll
                for (int w = 0; w < 2; w++) {
                    const int k = j + 4 * w, gg = k >> 1, hf = k & 1;
                    const u32 qv = *(const u32*)(b + 16 + 16 * k + 4 * t);
                    const int e0 = blk * 256 + 64 * gg + 16 * hf + 4 * t;
#pragma unroll
                    for (int f = 0; f < 2; f++) {
                        const int s = 2 * gg + f;
                        int S[4] = {0, 0, 0, 0};
                        const u32 bq = (f ? (qv >> 4) : qv) & 0x0F0F0F0Fu;
                        mma16816_s8(S, *(const u32*)(xa + e0 + 32 * f), *(const u32*)(xb + e0 + 32 * f), bq);
                        const int sc0 = k4_scale(hh[0].y, hh[0].z, hh[0].w, s, false);
                        const int sc1 = k4_scale(hh[1].y, hh[1].z, hh[1].w, s, false);
                        const int mn0 = k4_scale(hh[0].y, hh[0].z, hh[0].w, s, true);
                        const int mn1 = k4_scale(hh[1].y, hh[1].z, hh[1].w, s, true);
                        const int ba = pa[2 * w + f], bb = pb[2 * w + f];
                        I[0] += sc0 * S[0]; I[1] += sc1 * S[1]; I[2] += sc0 * S[2]; I[3] += sc1 * S[3];
                        Mn[0] += mn0 * ba; Mn[1] += mn1 * ba; Mn[2] += mn0 * bb; Mn[3] += mn1 * bb;
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    acc[j][e] = fmaf(dx[e], (float)I[e], acc[j][e]);
                    acc[j][e] = fmaf(ndm[e], (float)Mn[e], acc[j][e]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) fold_q(stk[j][e], qi, acc[j][e]);
    }
    float res[4];
#pragma unroll
    for (int e = 0; e < 4; e++) res[e] = pieces_sum(stk, e);
    store4(res, y, ldy, M, n, r0, o0, g, t);
}

// ---------------------------------------------------------------- the tiled f16 variant
// The f16 route with the A operand shared: a warp tile of 16 rows x 8 NT outputs (NT n-tiles
// of 8 read the same A fragments), and the pieces walked one after another (j = 0, 2, 1, 3:
// the butterfly's last two levels pair j with j ^ 2, then j ^ 1), each piece pass a walk of q
// in the butterfly's order over its blocks, so a thread holds one accumulator and a 3-level
// stack per C element.  x as fp16 codes x16 [n, K] and run sums bs16 [n, K / 16] (codes_f16,
// below; in the product q8_act would write them).  grid (ceil(M / (32 NT)), ceil(n / 16)).
extern "C" __global__ void codes_f16(const signed char* __restrict__ xq, const short* __restrict__ xi, long long nk,
                                     __half* __restrict__ x16, __half* __restrict__ bs16) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < nk) x16[i] = __int2half_rn((int)xq[i]);
    if (i < nk / 16) bs16[i] = __int2half_rn((int)xi[i]);
}

template <int NT>
__global__ void __launch_bounds__(128) mma4k_t(
        const u8* __restrict__ W, int M, int K, long long row_bytes, const __half* __restrict__ x16,
        const float* __restrict__ xd, const __half* __restrict__ bs16, float* __restrict__ y, int ldy, int n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int o0 = (blockIdx.x * 4 + warp) * 8 * NT;
    if (o0 >= M) return;
    const int r0 = blockIdx.y * 16;
    const int nb = K / 256, nst = (nb + 7) / 8;
    const u8* wrow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) wrow[nt] = W + (long long)min(o0 + 8 * nt + g, M - 1) * row_bytes;
    const int ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);
    const __half* xa = x16 + (long long)ra * K;
    const __half* xb = x16 + (long long)rb * K;
    constexpr int QORD[8] = {0, 4, 2, 6, 1, 5, 3, 7};
    constexpr int JORD[4] = {0, 2, 1, 3};
    float res[NT][4], half_[NT][4];
#pragma unroll 1
    for (int ji = 0; ji < 4; ji++) {
        const int j = JORD[ji];
        float stk[NT][4][3];
#pragma unroll
        for (int qi = 0; qi < 8; qi++) {
            const int q = QORD[qi];
            float acc[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[nt][e] = 0.f;
            for (int it = 0; it < nst; it++) {
                const int blk0 = it * 8 + q, blk = min(blk0, nb - 1);
                const bool ok = blk0 < nb;
                const float xda = ok ? xd[(long long)ra * nb + blk] : 0.f;
                const float xdb = ok ? xd[(long long)rb * nb + blk] : 0.f;
                // A: the piece's 4 runs (word j lo, hi; word j + 4 lo, hi), rows g, g + 8
                u32 A[4][4];
#pragma unroll
                for (int w = 0; w < 2; w++)
#pragma unroll
                    for (int f = 0; f < 2; f++) {
                        const int k = j + 4 * w;
                        const int e0 = blk * 256 + 64 * (k >> 1) + 16 * (k & 1) + 32 * f + 4 * t;
                        const uint2 va = *(const uint2*)(xa + e0), vb = *(const uint2*)(xb + e0);
                        A[2 * w + f][0] = va.x; A[2 * w + f][1] = vb.x; A[2 * w + f][2] = va.y; A[2 * w + f][3] = vb.y;
                    }
                u32 am0 = 0u, am1 = 0u, am2 = 0u, am3 = 0u;       // M's A: the run sums (t = 0)
                if (t == 0) {
                    const uint2 sa = *(const uint2*)(bs16 + (long long)ra * (K / 16) + blk * 16 + 4 * j);
                    const uint2 sb = *(const uint2*)(bs16 + (long long)rb * (K / 16) + blk * 16 + 4 * j);
                    am0 = sa.x; am2 = sa.y; am1 = sb.x; am3 = sb.y;
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const u8* b = wrow[nt] + (long long)blk * 144;
                    const uint4 h = *(const uint4*)b;
                    const u32 hx0 = __shfl_sync(0xffffffffu, h.x, 8 * t), hx1 = __shfl_sync(0xffffffffu, h.x, 8 * t + 4);
                    const float d0 = __half2float(__ushort_as_half((u16)(hx0 & 0xFFFFu)));
                    const float m0 = __half2float(__ushort_as_half((u16)(hx0 >> 16)));
                    const float d1 = __half2float(__ushort_as_half((u16)(hx1 & 0xFFFFu)));
                    const float m1 = __half2float(__ushort_as_half((u16)(hx1 >> 16)));
                    float cI[4] = {0.f, 0.f, 0.f, 0.f}, cM[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int w = 0; w < 2; w++) {
                        const int k = j + 4 * w, gg = k >> 1;
                        const u32 qv = *(const u32*)(b + 16 + 16 * k + 4 * t);
#pragma unroll
                        for (int f = 0; f < 2; f++) {
                            const __half sc = __int2half_rn(k4_scale(h.y, h.z, h.w, 2 * gg + f, false));
                            u32 b0, b1;
                            nib_h2(f ? (qv >> 4) : qv, sc, b0, b1);
                            const u32* a = A[2 * w + f];
                            mma16816(cI, a[0], a[1], a[2], a[3], b0, b1);
                        }
                    }
                    u32 bm0 = 0u, bm1 = 0u;
                    if (t == 0) {
                        const int s0 = 2 * (j >> 1);
                        bm0 = h2u(__floats2half2_rn((float)k4_scale(h.y, h.z, h.w, s0, true),
                                                    (float)k4_scale(h.y, h.z, h.w, s0 + 1, true)));
                        bm1 = h2u(__floats2half2_rn((float)k4_scale(h.y, h.z, h.w, s0 + 4, true),
                                                    (float)k4_scale(h.y, h.z, h.w, s0 + 5, true)));
                    }
                    mma16816(cM, am0, am1, am2, am3, bm0, bm1);
                    const float dx[4] = {d0 * xda, d1 * xda, d0 * xdb, d1 * xdb};
                    const float ndm[4] = {-(m0 * xda), -(m1 * xda), -(m0 * xdb), -(m1 * xdb)};
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        acc[nt][e] = fmaf(dx[e], cI[e], acc[nt][e]);
                        acc[nt][e] = fmaf(ndm[e], cM[e], acc[nt][e]);
                    }
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) fold_q(stk[nt][e], qi, acc[nt][e]);
        }
        // the pieces: (j 0 + j 2) + (j 1 + j 3)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float v = stk[nt][e][2];
                if (ji == 0 || ji == 2) half_[nt][e] = v;
                else if (ji == 1) res[nt][e] = half_[nt][e] + v;
                else res[nt][e] = res[nt][e] + (half_[nt][e] + v);
            }
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = r0 + g + 8 * (e >> 1), out = o0 + 8 * nt + 2 * t + (e & 1);
            if (row < n && out < M) y[(long long)row * ldy + out] = res[nt][e];
        }
}

// ---------------------------------------------------------------- Q6_K in mvs's order
// mvs<IQ6_K> (qint8.cuh; the product's Q6_K kernel for W of more than MVK_Q6K_MAX_M rows:
// the outputs, L8's ffn_down) sums output m, row n per lane l = 8 s + p (s: block slot of a
// 4-block chunk, p: 32-weight part of the block) over its chunks in order:
//     t = 0; for run u < 4 (8 values): t = fmaf(d * scale[u], (float)si_u, t);  acc = fmaf(t, xd, acc)
// (si_u = sum (q - 32) * x over the run), then the butterfly: xor 16, 8 pair the slots
// (s ^ 2, s ^ 1), xor 4, 2, 1 the parts.  Here: slots walked 0, 2, 1, 3, all 8 parts of a
// block at once (one accumulator a part and C element), a 2-level stack for the slots, then
// the parts' tree.  si_u by mma.m16n8k16 s8, the run's 8 values at k 0..7 (threads t = 0, 1),
// zeros above.  Q6_K blocks (210 bytes) are 2-byte aligned: ld32u.
DEV u32 ld32u(const u8* p) {
    const u32* a = (const u32*)((size_t)p & ~(size_t)3);
    return __funnelshift_r(a[0], a[1], ((u32)(size_t)p & 3u) * 8u);
}

extern "C" __global__ void __launch_bounds__(128) mma6k_s(
        const u8* __restrict__ W, int M, int K, long long row_bytes, const signed char* __restrict__ xq,
        const float* __restrict__ xd, float* __restrict__ y, int ldy, int n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int o0 = (blockIdx.x * 4 + warp) * 8;
    if (o0 >= M) return;
    const int r0 = blockIdx.y * 16;
    const int nb = K / 256, nch = (nb + 3) / 4;
    const u8* wrow = W + (long long)min(o0 + g, M - 1) * row_bytes;
    // the C elements' outputs 2t, 2t + 1 (their d and scales)
    const u8* crow0 = W + (long long)min(o0 + 2 * t, M - 1) * row_bytes;
    const u8* crow1 = W + (long long)min(o0 + 2 * t + 1, M - 1) * row_bytes;
    const int ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);
    const signed char* xa = xq + (long long)ra * K;
    const signed char* xb = xq + (long long)rb * K;
    constexpr int SORD[4] = {0, 2, 1, 3};
    float pair[8][4], v2[8][4];
#pragma unroll
    for (int si = 0; si < 4; si++) {
        const int s = SORD[si];
        float acc[8][4];
#pragma unroll
        for (int p = 0; p < 8; p++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[p][e] = 0.f;
        for (int c = 0; c < nch; c++) {
            const int blk = 4 * c + s;
            if (blk >= nb) break;                     // (the whole warp: parts past K add nothing)
            const u8* b = wrow + (long long)blk * 210;
            const u8* b0 = crow0 + (long long)blk * 210;
            const u8* b1 = crow1 + (long long)blk * 210;
            const float d0 = __half2float(__ushort_as_half(*(const u16*)(b0 + 208)));
            const float d1 = __half2float(__ushort_as_half(*(const u16*)(b1 + 208)));
            const float xda = xd[(long long)ra * nb + blk], xdb = xd[(long long)rb * nb + blk];
#pragma unroll
            for (int p = 0; p < 8; p++) {
                const int h = p >> 2, l0 = 8 * (p & 3);
                float tt[4] = {0.f, 0.f, 0.f, 0.f};
                u32 qlo = 0u, qhi = 0u, qh = 0u;
                if (t < 2) {
                    qlo = ld32u(b + 64 * h + l0 + 4 * t);
                    qhi = ld32u(b + 64 * h + 32 + l0 + 4 * t);
                    qh = ld32u(b + 128 + 32 * h + l0 + 4 * t);
                }
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    u32 a0 = 0u, a1 = 0u, bq = 0u;
                    if (t < 2) {
                        const int e0 = blk * 256 + 128 * h + 32 * u + l0 + 4 * t;
                        a0 = *(const u32*)(xa + e0);
                        a1 = *(const u32*)(xb + e0);
                        const u32 ql = (u & 1) ? qhi : qlo;
                        const u32 q6 = ((ql >> (u >= 2 ? 4 : 0)) & 0x0F0F0F0Fu) | (((qh >> (2 * u)) & 0x03030303u) << 4);
                        bq = __vsub4(q6, 0x20202020u);
                    }
                    int S[4] = {0, 0, 0, 0};
                    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                                 : "+r"(S[0]), "+r"(S[1]), "+r"(S[2]), "+r"(S[3]) : "r"(a0), "r"(a1), "r"(bq));
                    const int si_ = 8 * h + (l0 >> 4) + 2 * u;
                    const float sc0 = d0 * (float)(signed char)b0[192 + si_];
                    const float sc1 = d1 * (float)(signed char)b1[192 + si_];
                    tt[0] = fmaf(sc0, (float)S[0], tt[0]);
                    tt[1] = fmaf(sc1, (float)S[1], tt[1]);
                    tt[2] = fmaf(sc0, (float)S[2], tt[2]);
                    tt[3] = fmaf(sc1, (float)S[3], tt[3]);
                }
#pragma unroll
                for (int e = 0; e < 4; e++) acc[p][e] = fmaf(tt[e], e < 2 ? xda : xdb, acc[p][e]);
            }
        }
        // slots: level 1 pairs s, s ^ 2 (order 0, 2 | 1, 3), level 2 the two pairs
#pragma unroll
        for (int p = 0; p < 8; p++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (si == 0 || si == 2) pair[p][e] = acc[p][e];
                else if (si == 1) v2[p][e] = pair[p][e] + acc[p][e];
                else v2[p][e] = v2[p][e] + (pair[p][e] + acc[p][e]);
            }
    }
    // the parts: p with p ^ 4, then p ^ 2, then p ^ 1
    float res[4];
#pragma unroll
    for (int e = 0; e < 4; e++)
        res[e] = ((v2[0][e] + v2[4][e]) + (v2[2][e] + v2[6][e])) + ((v2[1][e] + v2[5][e]) + (v2[3][e] + v2[7][e]));
    store4(res, y, ldy, M, n, r0, o0, g, t);
}

// ---------------------------------------------------------------- Q6_K in mvkt's order
// mvkt<MQ6_K> (qmvk.cuh; Q6_K of at most MVK_Q6K_MAX_M rows) has mvk4k's lane classes
// L = 4q + j and walk (8-block steps, blocks past K: the last block with xd = 0), and per
// block and piece j (half h = j >> 1, bytes l0 = 16 (j & 1); runs t of 16 values at
// 128h + l0 + 32t, scale 8h + (j & 1) + 2t) one exact integer Y = sum_t sc_t * sum (q - 32) x,
// then acc = fmaf(d * xd, (float)Y, acc).  Here as mma4k_i8: q walked 0, 4, 2, 6, 1, 5, 3, 7,
// the four pieces at once, a run an s8 MMA (B = q - 32), Y by IMAD.
extern "C" __global__ void __launch_bounds__(128) mma6k_k(
        const u8* __restrict__ W, int M, int K, long long row_bytes, const signed char* __restrict__ xq,
        const float* __restrict__ xd, float* __restrict__ y, int ldy, int n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int o0 = (blockIdx.x * 4 + warp) * 8;
    if (o0 >= M) return;
    const int r0 = blockIdx.y * 16;
    const int nb = K / 256, nst = (nb + 7) / 8;
    const u8* wrow = W + (long long)min(o0 + g, M - 1) * row_bytes;
    const u8* crow0 = W + (long long)min(o0 + 2 * t, M - 1) * row_bytes;
    const u8* crow1 = W + (long long)min(o0 + 2 * t + 1, M - 1) * row_bytes;
    const int ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);
    const signed char* xa = xq + (long long)ra * K;
    const signed char* xb = xq + (long long)rb * K;
    float stk[4][4][3];
    constexpr int QORD[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#pragma unroll
    for (int qi = 0; qi < 8; qi++) {
        const int q = QORD[qi];
        float acc[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[j][e] = 0.f;
        for (int it = 0; it < nst; it++) {
            const int blk0 = it * 8 + q, blk = min(blk0, nb - 1);
            const bool ok = blk0 < nb;
            const u8* b = wrow + (long long)blk * 210;
            const u8* b0 = crow0 + (long long)blk * 210;
            const u8* b1 = crow1 + (long long)blk * 210;
            const float d0 = __half2float(__ushort_as_half(*(const u16*)(b0 + 208)));
            const float d1 = __half2float(__ushort_as_half(*(const u16*)(b1 + 208)));
            const float xda = ok ? xd[(long long)ra * nb + blk] : 0.f;
            const float xdb = ok ? xd[(long long)rb * nb + blk] : 0.f;
            const float dx[4] = {d0 * xda, d1 * xda, d0 * xdb, d1 * xdb};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int h = j >> 1, l0 = 16 * (j & 1);
                const u32 qa = ld32u(b + 64 * h + l0 + 4 * t), qc = ld32u(b + 64 * h + 32 + l0 + 4 * t);
                const u32 qe = ld32u(b + 128 + 32 * h + l0 + 4 * t);
                int Y[4] = {0, 0, 0, 0};
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const u32 Q = (r & 1) ? qc : qa;
                    const u32 q6 = ((Q >> (4 * (r >> 1))) & 0x0F0F0F0Fu) | (((qe >> (2 * r)) & 0x03030303u) << 4);
                    const int e0 = blk * 256 + 128 * h + l0 + 32 * r + 4 * t;
                    int S[4] = {0, 0, 0, 0};
                    mma16816_s8(S, *(const u32*)(xa + e0), *(const u32*)(xb + e0), __vsub4(q6, 0x20202020u));
                    const int si_ = 192 + 8 * h + (j & 1) + 2 * r;
                    const int sc0 = (signed char)b0[si_], sc1 = (signed char)b1[si_];
                    Y[0] += sc0 * S[0]; Y[1] += sc1 * S[1]; Y[2] += sc0 * S[2]; Y[3] += sc1 * S[3];
                }
#pragma unroll
                for (int e = 0; e < 4; e++) acc[j][e] = fmaf(dx[e], (float)Y[e], acc[j][e]);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) fold_q(stk[j][e], qi, acc[j][e]);
    }
    float res[4];
#pragma unroll
    for (int e = 0; e < 4; e++) res[e] = pieces_sum(stk, e);
    store4(res, y, ldy, M, n, r0, o0, g, t);
}
