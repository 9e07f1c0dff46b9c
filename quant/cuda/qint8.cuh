// Integer path of the decode matvec: activations quantized to int8 in blocks of 16
// (step xd = amax/127, xs = xd * sum(q)), weights' codes as int8 words, products
// summed 4 at a time by dp4a (sm_61 and newer).  Per run of the part:
//     sum(w * x) ~= sc * xd * sum(qw * qx) + mn * xs
// The codes of formats with an offset are re-centred (q - 8, q - 16, q - 32) with
// byte-wise subtraction so that only the "min" formats need xs.
#pragma once
#include "qblocks.cuh"

DEV int vsub(u32 a, u32 b) { return (int)__vsub4(a, b); }

// w: PE/4 words of signed bytes in run order; sc, mn per run
struct IQ4_0 : TQ4_0 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        float d = ldh(b);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 v = ld32a2(b + 2 + 4 * i);
            w[i] = vsub(v & 0x0F0F0F0Fu, 0x08080808u);
            w[4 + i] = vsub((v >> 4) & 0x0F0F0F0Fu, 0x08080808u);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};
struct IQ4_1 : TQ4_1 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        float d = ldh(b), m = ldh(b + 2);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 v = ld32(b + 4 + 4 * i);
            w[i] = (int)(v & 0x0F0F0F0Fu);
            w[4 + i] = (int)((v >> 4) & 0x0F0F0F0Fu);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = m;
    }
};
struct IQ5_0 : TQ5_0 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        float d = ldh(b);
        u32 qh = ld32a2(b + 2);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 v = ld32a2(b + 6 + 4 * i);
            w[i] = vsub((v & 0x0F0F0F0Fu) | hibits4(qh, 4 * i), 0x10101010u);
            w[4 + i] = vsub(((v >> 4) & 0x0F0F0F0Fu) | hibits4(qh, 16 + 4 * i), 0x10101010u);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};
struct IQ5_1 : TQ5_1 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        float d = ldh(b), m = ldh(b + 2);
        u32 qh = ld32(b + 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 v = ld32(b + 8 + 4 * i);
            w[i] = (int)((v & 0x0F0F0F0Fu) | hibits4(qh, 4 * i));
            w[4 + i] = (int)(((v >> 4) & 0x0F0F0F0Fu) | hibits4(qh, 16 + 4 * i));
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = m;
    }
};
struct IQ8_0 : TQ8_0 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        float d = ldh(b);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = (int)ld32a2(b + 2 + 4 * i);
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};
struct IQ4_K : TQ4_K {
    DEV void decode_i8(const u8* b, int p, int* w, float* sc, float* mn) {
        float d = ldh(b), dmin = ldh(b + 2);
        int g = p >> 1;
        int s0, m0, s1, m1;
        scale_min_k4(2 * g, b + 4, s0, m0);
        scale_min_k4(2 * g + 1, b + 4, s1, m1);
        uint4 v = *(const uint4*)(b + 16 + 16 * p);
        u32 q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = (int)(q[i] & 0x0F0F0F0Fu);
            w[4 + i] = (int)((q[i] >> 4) & 0x0F0F0F0Fu);
        }
        sc[0] = d * s0; mn[0] = -dmin * m0;
        sc[1] = d * s1; mn[1] = -dmin * m1;
    }
};
struct IQ5_K : TQ5_K {
    DEV void decode_i8(const u8* b, int p, int* w, float* sc, float* mn) {
        float d = ldh(b), dmin = ldh(b + 2);
        int g = p >> 1, h = p & 1;
        int s0, m0, s1, m1;
        scale_min_k4(2 * g, b + 4, s0, m0);
        scale_min_k4(2 * g + 1, b + 4, s1, m1);
        uint4 v = *(const uint4*)(b + 48 + 16 * p);
        uint4 hv = *(const uint4*)(b + 16 + 16 * h);
        u32 q[4] = {v.x, v.y, v.z, v.w};
        u32 hh[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = (int)((q[i] & 0x0F0F0F0Fu) | (((hh[i] >> (2 * g)) & 0x01010101u) << 4));
            w[4 + i] = (int)(((q[i] >> 4) & 0x0F0F0F0Fu) | (((hh[i] >> (2 * g + 1)) & 0x01010101u) << 4));
        }
        sc[0] = d * s0; mn[0] = -dmin * m0;
        sc[1] = d * s1; mn[1] = -dmin * m1;
    }
};
struct IQ6_K : TQ6_K {
    DEV void decode_i8(const u8* b, int p, int* w, float* sc, float* mn) {
        int h = p >> 2, l0 = 8 * (p & 3);
        const u8* ql = b + 64 * h + l0;
        const u8* qh = b + 128 + 32 * h + l0;
        const signed char* scales = (const signed char*)(b + 192 + 8 * h + (l0 >> 4));
        float d = ldh(b + 208);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 a = ld32a2(ql + 4 * i), c = ld32a2(ql + 32 + 4 * i), e = ld32a2(qh + 4 * i);
            w[i] = vsub((a & 0x0F0F0F0Fu) | ((e & 0x03030303u) << 4), 0x20202020u);
            w[2 + i] = vsub((c & 0x0F0F0F0Fu) | (((e >> 2) & 0x03030303u) << 4), 0x20202020u);
            w[4 + i] = vsub(((a >> 4) & 0x0F0F0F0Fu) | (((e >> 4) & 0x03030303u) << 4), 0x20202020u);
            w[6 + i] = vsub(((c >> 4) & 0x0F0F0F0Fu) | (((e >> 6) & 0x03030303u) << 4), 0x20202020u);
        }
#pragma unroll
        for (int r = 0; r < 4; r++) { sc[r] = d * (float)scales[2 * r]; mn[r] = 0.f; }
    }
};

// x float32 [n, K] -> int8 codes [n, K], steps xd and xd*sum(q) per 16 values.
// One thread per 16-value block; rounding as the CPU's act_quant (rint(x * 127/amax)).
extern "C" __global__ void quantize_x16(const float* __restrict__ x, int n, int K, signed char* __restrict__ xq,
                                        float* __restrict__ xd, float* __restrict__ xs) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * (K / 16)) return;
    const float* xb = x + i * 16;
    float v[16], amax = 0.f;
#pragma unroll
    for (int j = 0; j < 16; j += 4) {
        float4 a = *(const float4*)(xb + j);
        v[j] = a.x; v[j + 1] = a.y; v[j + 2] = a.z; v[j + 3] = a.w;
    }
#pragma unroll
    for (int j = 0; j < 16; j++) amax = fmaxf(amax, fabsf(v[j]));
    const float idv = amax > 0.f ? 127.0f / amax : 0.f;
    int sum = 0;
    u32 words[4];
#pragma unroll
    for (int j = 0; j < 16; j += 4) {
        u32 wv = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int q = (int)rintf(v[j + k] * idv);
            sum += q;
            wv |= ((u32)(q & 0xFF)) << (8 * k);
        }
        words[j / 4] = wv;
    }
    *(uint4*)(xq + i * 16) = make_uint4(words[0], words[1], words[2], words[3]);
    const float d = amax / 127.0f;
    xd[i] = d;
    xs[i] = d * (float)sum;
}

// The decode matvec on the integer path (n <= 2 rows of x, RPW output rows a block).
template <class T, int NR, int RPW>
__global__ void __launch_bounds__(128) mvq(
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,
        float* y0, float* y1, float* y2,
        const float* b0, const float* b1, const float* b2,
        int M0, int M1, int M2,
        int K, long long row_bytes, const signed char* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, int ldy0, int ldy1, int ldy2, int mode) {
    const int wsel = blockIdx.y;
    const u8* W = wsel == 0 ? W0 : (wsel == 1 ? W1 : W2);
    float* y = wsel == 0 ? y0 : (wsel == 1 ? y1 : y2);
    const float* bias = wsel == 0 ? b0 : (wsel == 1 ? b1 : b2);
    const int M = wsel == 0 ? M0 : (wsel == 1 ? M1 : M2);
    const int ldy = wsel == 0 ? ldy0 : (wsel == 1 ? ldy1 : ldy2);
    const int m0 = blockIdx.x * RPW;
    if (m0 >= M) return;
    const int nparts = (K / T::QK) * T::PPB;
    const u8* rows = W + (long long)m0 * row_bytes;
    constexpr int WPR = T::RLEN / 4;           // int words per run
    float acc[RPW][NR];
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int n = 0; n < NR; n++) acc[r][n] = 0.f;
    for (int p = threadIdx.x; p < nparts; p += blockDim.x) {
        const int blk = p / T::PPB, part = p % T::PPB;
        int xw[NR][T::PE / 4];
        float xdr[NR][T::NRUN], xsr[NR][T::NRUN];
#pragma unroll
        for (int n = 0; n < NR; n++)
#pragma unroll
            for (int u = 0; u < T::NRUN; u++) {
                const long long e0 = (long long)n * K + blk * T::QK + T::run_start(part, u);
                if constexpr (WPR == 4) {
                    uint4 a = *(const uint4*)(xq + e0);
                    xw[n][u * 4] = (int)a.x; xw[n][u * 4 + 1] = (int)a.y;
                    xw[n][u * 4 + 2] = (int)a.z; xw[n][u * 4 + 3] = (int)a.w;
                } else {
                    uint2 a = *(const uint2*)(xq + e0);
                    xw[n][u * 2] = (int)a.x; xw[n][u * 2 + 1] = (int)a.y;
                }
                xdr[n][u] = xd[e0 / 16];
                xsr[n][u] = xs[e0 / 16];
            }
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            if (m0 + r < M) {
                int w[T::PE / 4];
                float sc[T::NRUN], mn[T::NRUN];
                T::decode_i8(rows + (long long)r * row_bytes + (long long)blk * T::BB, part, w, sc, mn);
#pragma unroll
                for (int n = 0; n < NR; n++)
#pragma unroll
                    for (int u = 0; u < T::NRUN; u++) {
                        int s = 0;
#pragma unroll
                        for (int j = 0; j < WPR; j++) s = __dp4a(w[u * WPR + j], xw[n][u * WPR + j], s);
                        acc[r][n] = fmaf(sc[u] * xdr[n][u], (float)s, acc[r][n]);
                        if (T::HAS_MIN) acc[r][n] = fmaf(mn[u], xsr[n][u], acc[r][n]);
                    }
            }
        }
    }
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
