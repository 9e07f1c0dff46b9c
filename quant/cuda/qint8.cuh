// Integer path of the decode matvec, computing what the CPU backend (and llama.cpp)
// computes: activations rounded to int8 per block of the weight family's own size
// (32 values for the legacy formats, 256 for the K-quants: ggml's Q8_0 / Q8_K), step
// xd = amax / 127, codes rint(x * (127 / amax)) (quant/act_quant.py exactly); weight
// codes as int8 words; products summed 4 at a time by dp4a (sm_61 and newer).  Per run
// u of a part (weights w = sc[u] * q + mn[u]):
//     sum(w * x) = xd * sc[u] * sum(q * qx) + mn[u] * xs[u],   xs = xd * sum(qx) per 16
// The integer sums are exact, so a result differs from the CPU's only by float32
// rounding order.  Codes of formats with an offset are re-centred (q - 8, q - 16,
// q - 32) with byte-wise subtraction, so only the "min" formats need xs.
#pragma once
#include "qblocks.cuh"

DEV int vsub(u32 a, u32 b) { return (int)__vsub4(a, b); }

// Cache hints on the matvecs' weight loads (read once, streamed), chosen at compile time
// (quant/cuda/__init__.py W_HINT, default 5, -DLLAMBA_WHINT=n; the sums never change;
// undefined, e.g. in the megakernel's module: 0):
//   0: none (plain ld.global.nc)   1: .L2::256B prefetch size   2: .L2::128B
//   3: L2 evict_first policy (weights leave L2 first: activations / KV stay)   4: 1 and 3
//   5: 2 and 3
// The hints need sm_80+; below that every value is the plain load.  LLAMBA_WPF > 0: mvk
// prefetches (prefetch.global.L2) each warp's weights that many steps ahead (qmvk.cuh).
#ifndef LLAMBA_WHINT
#define LLAMBA_WHINT 0
#endif
#ifndef LLAMBA_WPF
#define LLAMBA_WPF 0
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && LLAMBA_WHINT > 0
#define LLAMBA_WH LLAMBA_WHINT
#else
#define LLAMBA_WH 0
#endif
#if LLAMBA_WH == 1 || LLAMBA_WH == 4
#define LLAMBA_WPS ".L2::256B"
#elif LLAMBA_WH == 2 || LLAMBA_WH == 5
#define LLAMBA_WPS ".L2::128B"
#else
#define LLAMBA_WPS ""
#endif
#if LLAMBA_WH >= 3
#define LLAMBA_WCH ".L2::cache_hint"
DEV unsigned long long l2_evict_first() {
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
#endif
// a weight word, 16-byte aligned; NA: kept out of L1 (L1::no_allocate)
template <int NA>
DEV uint4 ldg_w(const void* p) {
    uint4 v;
#if LLAMBA_WH == 0
    if constexpr (NA == 1)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else
        v = __ldg((const uint4*)p);
#elif LLAMBA_WH >= 3
    const unsigned long long pol = l2_evict_first();
    if constexpr (NA == 1)
        asm volatile("ld.global.nc.L1::no_allocate" LLAMBA_WCH LLAMBA_WPS ".v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    else
        asm volatile("ld.global.nc" LLAMBA_WCH LLAMBA_WPS ".v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
#else
    if constexpr (NA == 1)
        asm volatile("ld.global.nc.L1::no_allocate" LLAMBA_WPS ".v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else
        asm volatile("ld.global.nc" LLAMBA_WPS ".v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
    return v;
}
DEV void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// N 32-bit words from a 2-byte-aligned address: N + 1 aligned loads and funnel shifts
// instead of 2N 16-bit loads.  Reads up to 4 bytes past the N words (the matvec's
// shared-memory rows are padded for it).
template <int N>
DEV void lda2(const u8* p, u32* w) {
    const u32* a = (const u32*)((size_t)p & ~(size_t)3);
    const u32 sh = ((u32)(size_t)p & 3u) * 8u;
    u32 lo = a[0];
#pragma unroll
    for (int i = 0; i < N; i++) {
        const u32 hi = a[i + 1];
        w[i] = __funnelshift_r(lo, hi, sh);
        lo = hi;
    }
}

// d, dmin and the 6-bit scale/min pairs of sub-blocks 2g, 2g+1 of a Q4_K/Q5_K block,
// from its 16-byte header h (the decode of scale_min_k4, four at a time)
DEV void kquant_scales(uint4 h, int g, float* sc, float* mn) {
    const float d = __half2float(__ushort_as_half((u16)(h.x & 0xFFFFu)));
    const float dmin = __half2float(__ushort_as_half((u16)(h.x >> 16)));
    const u32 s_lo = h.y & 0x3F3F3F3Fu, m_lo = h.z & 0x3F3F3F3Fu;
    const u32 s_hi = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
    const u32 m_hi = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
    const u32 s4 = g < 2 ? s_lo : s_hi, m4 = g < 2 ? m_lo : m_hi;
    const u32 sh = 16u * (u32)(g & 1);
    sc[0] = d * (float)((s4 >> sh) & 0xFFu);
    sc[1] = d * (float)((s4 >> (sh + 8)) & 0xFFu);
    mn[0] = -dmin * (float)((m4 >> sh) & 0xFFu);
    mn[1] = -dmin * (float)((m4 >> (sh + 8)) & 0xFFu);
}

// decode_i8(b, part, w, sc, mn): the part's PE codes as PE/4 words of signed bytes in
// run order; sc, mn per run.  b points into shared memory (see mvs).
struct IQ4_0 : TQ4_0 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        const float d = ldh(b);
        u32 q[4];
        lda2<4>(b + 2, q);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = vsub(q[i] & 0x0F0F0F0Fu, 0x08080808u);
            w[4 + i] = vsub((q[i] >> 4) & 0x0F0F0F0Fu, 0x08080808u);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};
struct IQ4_1 : TQ4_1 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        const float d = ldh(b), m = ldh(b + 2);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 v = ld32(b + 4 + 4 * i);
            w[i] = (int)(v & 0x0F0F0F0Fu);
            w[4 + i] = (int)((v >> 4) & 0x0F0F0F0Fu);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = m;
    }
};
struct IQ5_0 : TQ5_0 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        const float d = ldh(b);
        u32 v[5];                                  // qh, then qs
        lda2<5>(b + 2, v);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = vsub((v[1 + i] & 0x0F0F0F0Fu) | hibits4(v[0], 4 * i), 0x10101010u);
            w[4 + i] = vsub(((v[1 + i] >> 4) & 0x0F0F0F0Fu) | hibits4(v[0], 16 + 4 * i), 0x10101010u);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};
struct IQ5_1 : TQ5_1 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        const float d = ldh(b), m = ldh(b + 2);
        const u32 qh = ld32(b + 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 v = ld32(b + 8 + 4 * i);
            w[i] = (int)((v & 0x0F0F0F0Fu) | hibits4(qh, 4 * i));
            w[4 + i] = (int)(((v >> 4) & 0x0F0F0F0Fu) | hibits4(qh, 16 + 4 * i));
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = m;
    }
};
struct IQ8_0 : TQ8_0 {
    static constexpr bool CSUM = true;              // summed by chunks (see mvs_chunk)
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        const float d = ldh(b);
        lda2<8>(b + 2, (u32*)w);
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};
// kvalues_mxfp4 as signed bytes: {0,1,2,3,4,6,8,12, 0,-1,-2,-3,-4,-6,-8,-12}
struct IMXFP4 : TMXFP4 {
    DEV void decode_i8(const u8* b, int, int* w, float* sc, float* mn) {
        const float d = e8m0_half(b[0]);
        u32 q[4];
        lda2<4>(b + 1, q);                         // (any byte alignment)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = (int)lut16(q[i] & 0x0F0F0F0Fu, 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu);
            w[4 + i] = (int)lut16((q[i] >> 4) & 0x0F0F0F0Fu, 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};
// K-quant blocks are 16-byte aligned (144 / 176 bytes; rows of whole blocks)
struct IQ4_K : TQ4_K {
    DEV void decode_i8(const u8* b, int p, int* w, float* sc, float* mn) {
        kquant_scales(*(const uint4*)b, p >> 1, sc, mn);
        const uint4 v = *(const uint4*)(b + 16 + 16 * p);
        const u32 q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = (int)(q[i] & 0x0F0F0F0Fu);
            w[4 + i] = (int)((q[i] >> 4) & 0x0F0F0F0Fu);
        }
    }
};
struct IQ5_K : TQ5_K {
    DEV void decode_i8(const u8* b, int p, int* w, float* sc, float* mn) {
        const int g = p >> 1, h = p & 1;
        kquant_scales(*(const uint4*)b, g, sc, mn);
        const uint4 v = *(const uint4*)(b + 48 + 16 * p);
        const uint4 hv = *(const uint4*)(b + 16 + 16 * h);
        const u32 q[4] = {v.x, v.y, v.z, v.w};
        const u32 hh[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = (int)((q[i] & 0x0F0F0F0Fu) | (((hh[i] >> (2 * g)) & 0x01010101u) << 4));
            w[4 + i] = (int)(((q[i] >> 4) & 0x0F0F0F0Fu) | (((hh[i] >> (2 * g + 1)) & 0x01010101u) << 4));
        }
    }
};
// Q6_K blocks (210 bytes) are only 2-byte aligned
struct IQ6_K : TQ6_K {
    DEV void decode_i8(const u8* b, int p, int* w, float* sc, float* mn) {
        const int h = p >> 2, l0 = 8 * (p & 3);
        u32 a[2], c[2], e[2], s[2];
        lda2<2>(b + 64 * h + l0, a);                  // ql[l0..+8)
        lda2<2>(b + 64 * h + 32 + l0, c);             // ql[32+l0..+8)
        lda2<2>(b + 128 + 32 * h + l0, e);            // qh[l0..+8)
        lda2<2>(b + 192 + 8 * h + (l0 >> 4), s);      // scales[2r], r = 0..3: bytes 0, 2, 4, 6
        const float d = ldh(b + 208);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            w[i] = vsub((a[i] & 0x0F0F0F0Fu) | ((e[i] & 0x03030303u) << 4), 0x20202020u);
            w[2 + i] = vsub((c[i] & 0x0F0F0F0Fu) | (((e[i] >> 2) & 0x03030303u) << 4), 0x20202020u);
            w[4 + i] = vsub(((a[i] >> 4) & 0x0F0F0F0Fu) | (((e[i] >> 4) & 0x03030303u) << 4), 0x20202020u);
            w[6 + i] = vsub(((c[i] >> 4) & 0x0F0F0F0Fu) | (((e[i] >> 6) & 0x03030303u) << 4), 0x20202020u);
        }
        sc[0] = d * (float)(signed char)(s[0] & 0xFFu);
        sc[1] = d * (float)(signed char)((s[0] >> 16) & 0xFFu);
        sc[2] = d * (float)(signed char)(s[1] & 0xFFu);
        sc[3] = d * (float)(signed char)((s[1] >> 16) & 0xFFu);
        mn[0] = mn[1] = mn[2] = mn[3] = 0.f;
    }
};

// ---------------------------------------------------------------- activations
// x (float32 [n, K], row stride ldx) -> the integer path's activations of blocks of
// BS values, after an optional prologue (the op before the matmul, so it needs no
// launch of its own):
//   PRO 1: x * rsqrt(mean(x^2) + eps) * pw   (RMSNorm; each block sums the row's squares)
//   PRO 2: silu(x) * pu,  3: gelu_tanh(x) * pu   (GLU; pu has x's layout)
// Out: xq int8 [n, K], xd float [n, K/BS], xs float [n, K/16] = xd * sum of 16 codes.
// A warp per 256 values (8 a lane), 8 warps a block; grid (ceil(K / 2048), n).
// K % 32 == 0 (and K % 256 == 0 when BS == 256).
DEV float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// RMSNorm's sum of squares of a row, in one order wherever it is computed: per 256-value
// group (8 consecutive values a lane: a chain of fmaf, then the warp's butterfly), then
// the groups' sums in order
constexpr int Q8_MAXG = 128;                  // rows of up to 32768 values
DEV void q8_load8(const float* xr, int e, int K, float (&v)[8]) {
    if (e < K) {
        const float4 a = *(const float4*)(xr + e), b = *(const float4*)(xr + e + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = 0.f;
    }
}
DEV float q8_ss8(const float (&v)[8]) {
    float p = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) p = fmaf(v[i], v[i], p);
    return p;
}
DEV float q8_bfly(float p) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
    return p;
}
DEV float q8_rn(const float* gs, int ng, int K, float eps) {
    float tot = 0.f;
    for (int g = 0; g < ng; g++) tot += gs[g];
    return 1.0f / sqrtf(tot / K + eps);
}
DEV float gelu_mul(float g, float u) {
    const float c = 0.7978845608028654f;
    return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))) * u;
}

// One warp's 256 values (8 a lane, element e = lane's first) rounded to int8 blocks of
// BS: codes to xq[e..e+8), steps to xd[e / BS], xd * sum of 16 codes to xs[e / 16]
// (row pointers).  All 32 lanes take part (lanes past K with v = 0 and ok = false).
// xi (BS 256, optional): the 16 run sums of each block as int16, in the order mvk reads
// them (qmvk.cuh): run i = 8t + 4g + 2f + h at short (2(2g + h) + t) * 2 + f of the block.
// tnb > 0 (the decode megakernel's bulk ring, BS 32): the codes' 4-byte words transposed,
// word u of block b at word u tnb + b of xq (tnb: the row's blocks), and no xs.
template <int BS>
DEV void q8_store(const float (&v)[8], bool ok, int lane, int e, signed char* __restrict__ xq,
                  float* __restrict__ xd, float* __restrict__ xs, short* __restrict__ xi = nullptr,
                  int tnb = 0) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 1; o < BS / 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float idv = amax > 0.f ? 127.0f / amax : 0.f;
    int sum = 0;
    u32 word[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int q = __float2int_rn(v[i] * idv);
        sum += q;
        word[i >> 2] |= ((u32)q & 0xFFu) << (8 * (i & 3));
    }
    const int s16 = sum + __shfl_xor_sync(0xffffffffu, sum, 1);
    if (!ok) return;
    const float d = amax / 127.0f;
    if (tnb > 0) {
        const int w = e / 4, b = w >> 3, u = w & 7;   // words u, u + 1 of block b
        ((u32*)xq)[u * tnb + b] = word[0];
        ((u32*)xq)[(u + 1) * tnb + b] = word[1];
    } else {
        *(uint2*)(xq + e) = make_uint2(word[0], word[1]);
        if ((lane & 1) == 0) xs[e / 16] = d * (float)s16;
    }
    if ((lane & (BS / 8 - 1)) == 0) xd[e / BS] = d;
    if constexpr (BS == 256) {
        if (xi != nullptr && (lane & 1) == 1) {
            const int i = lane >> 1, t = i >> 3, g = (i >> 2) & 1, f = (i >> 1) & 1, h = i & 1;
            xi[(e / 256) * 16 + (2 * (2 * g + h) + t) * 2 + f] = (short)s16;
        }
    }
}

// x's 8 values at element e of row n after the prologue (zeros past K), for q8_act and
// f16_act: one definition of the prologue, so both paths see the same activations.  A
// warp per 256 values (8 a lane), 8 warps a block; grid (ceil(K / 2048), n).
template <int PRO>
DEV void act_prologue(const float* __restrict__ x, int ldx, const float* __restrict__ pw,
                      const float* __restrict__ pu, float eps, int K, int n, int e, int lane, int warp,
                      float (&v)[8]) {
    const float* xr = x + (long long)n * ldx;
    const bool ok = e < K;                    // whole groups of 4 lanes (K % 32 == 0)
    float w[8];                               // the norm's weights: no kernel writes them,
    if constexpr (PRO == 1) {                 // so they load before the wait (pdl.cuh)
        if (ok) {
#pragma unroll
            for (int i = 0; i < 8; i++) w[i] = pw[e + i];
        }
    }
    PDL_ENTER();
    float rn = 1.f;
    if constexpr (PRO == 1) {                 // every block sums the whole row's squares
        __shared__ float gs[Q8_MAXG];
        const int ng = (K + 255) / 256, gown = e / 256;
        // the warp's own group (gown = warp mod 8) is one of its groups here: its values
        // are kept from this pass, so the row takes one trip to memory, not two
#pragma unroll 2
        for (int g = warp; g < ng; g += 8) {
            float u[8];
            q8_load8(xr, g * 256 + lane * 8, K, u);
            const float t = q8_bfly(q8_ss8(u));
            if (lane == 0) gs[g] = t;
            if (g == gown) {
#pragma unroll
                for (int i = 0; i < 8; i++) v[i] = u[i];
            }
        }
        __syncthreads();
        rn = q8_rn(gs, ng, K, eps);
    }
    if (ok) {
        if constexpr (PRO != 1) {
            const float4 a = *(const float4*)(xr + e), b = *(const float4*)(xr + e + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            if constexpr (PRO == 1) {
                v[i] = v[i] * rn * w[i];
            } else if constexpr (PRO == 2) {
                v[i] = silu_mul(v[i], pu[(long long)n * ldx + e + i]);
            } else if constexpr (PRO == 3) {
                v[i] = gelu_mul(v[i], pu[(long long)n * ldx + e + i]);
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = 0.f;
    }
}

template <int BS, int PRO>
__global__ void __launch_bounds__(256) q8_act(const float* __restrict__ x, int ldx, const float* __restrict__ pw,
                                              const float* __restrict__ pu, float eps, int K,
                                              signed char* __restrict__ xq, float* __restrict__ xd,
                                              float* __restrict__ xs, short* __restrict__ xi) {
    const int n = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = (blockIdx.x * 8 + warp) * 256 + lane * 8;
    float v[8];
    act_prologue<PRO>(x, ldx, pw, pu, eps, K, n, e, lane, warp, v);
    q8_store<BS>(v, e < K, lane, e, xq + (long long)n * K, xd + (long long)n * (K / BS), xs + (long long)n * (K / 16),
                 xi ? xi + (long long)n * (K / 16) : nullptr);
}

// The prompt path's activations: x after the prologue as fp16 [n, K] (cuBLAS's operand),
// the rounding of each value the plain conversion's (__float2half_rn)
template <int PRO>
__global__ void __launch_bounds__(256) f16_act(const float* __restrict__ x, int ldx, const float* __restrict__ pw,
                                               const float* __restrict__ pu, float eps, int K,
                                               __half* __restrict__ y) {
    const int n = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int e = (blockIdx.x * 8 + warp) * 256 + lane * 8;
    float v[8];
    act_prologue<PRO>(x, ldx, pw, pu, eps, K, n, e, lane, warp, v);
    if (e < K) {
        union { __half2 h[4]; uint4 u; } pk;
#pragma unroll
        for (int i = 0; i < 4; i++) pk.h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
        *(uint4*)(y + (long long)n * K + e) = pk.u;
    }
}

// ---------------------------------------------------------------- the matvec
// y[n, m] (+)= sum_k x[n, k] * W[m, k] for NR <= 8 rows of x (their activations as
// made by q8_act with BS = T::QK).  Each warp computes R consecutive output rows and
// walks K in chunks of 1024 weights, one 32-weight part a lane a row; for each chunk:
//   1. loads the R rows' chunk bytes, at any alignment, with coalesced 16-byte loads
//      (R * NV words spread over the lanes, LPL a lane) into its shared memory;
//   2. issues its next chunk's loads and activations at once, so it always has a chunk
//      of each of its rows in flight while it computes;
//   3. decodes, a lane its part of every row, from shared memory (narrow and unaligned
//      reads are cheap there, not in L1) and dots it with the part's int8 activations,
//      loaded once for the R rows.
// Warps are independent (4 a block, no block-wide sync; splitting K over the block's
// warps, tried, was slower on the H200: a warp then has no next chunk to overlap); the
// sum over lanes is a butterfly.  The operations giving y[n, m] do not depend on NR or
// R (batch invariance).  Up to three weights of one type in one launch (blockIdx.y
// picks): q/k/v, gate/up.  mode 0: y = xW^T (+ bias);  mode 1: y += xW^T.
constexpr int MVS_WARPS = 4;
constexpr int MVS_CW = 1024;

template <class T, int NR>
struct MvsX {                                 // a part's activations, NR rows
    int w[NR][T::PE / 4];
    float d[NR];
    float s[NR][T::NRUN];
};

template <class T, int NR>
DEV void mvs_load_x(MvsX<T, NR>& X, const signed char* __restrict__ xq, const float* __restrict__ xd,
                    const float* __restrict__ xs, int K, int blk, int part) {
    constexpr int WPR = T::RLEN / 4;
#pragma unroll
    for (int n = 0; n < NR; n++) {
        X.d[n] = xd[(long long)n * (K / T::QK) + blk];
#pragma unroll
        for (int u = 0; u < T::NRUN; u++) {
            const int e0 = blk * T::QK + T::run_start(part, u);
            const signed char* p = xq + (long long)n * K + e0;
            if constexpr (WPR == 4) {
                const uint4 a = *(const uint4*)p;
                X.w[n][4 * u] = (int)a.x; X.w[n][4 * u + 1] = (int)a.y;
                X.w[n][4 * u + 2] = (int)a.z; X.w[n][4 * u + 3] = (int)a.w;
            } else {
                const uint2 a = *(const uint2*)p;
                X.w[n][2 * u] = (int)a.x; X.w[n][2 * u + 1] = (int)a.y;
            }
            if constexpr (T::HAS_MIN) X.s[n][u] = xs[(long long)n * (K / 16) + e0 / 16];
        }
    }
}

// one part (b: its block in shared memory) dotted with the part's activations of NR
// rows of x, added to acc[n]; the sums every integer matvec makes, in one order
template <class T, int NR>
DEV void mvs_dot(const u8* b, int part, const MvsX<T, NR>& xc, float (&acc)[NR]) {
    constexpr int WPR = T::RLEN / 4;
    int w[T::PE / 4];
    float sc[T::NRUN], mn[T::NRUN];
    T::decode_i8(b, part, w, sc, mn);
#pragma unroll
    for (int n = 0; n < NR; n++) {
        float t = 0.f;
#pragma unroll
        for (int u = 0; u < T::NRUN; u++) {
            int si = 0;
#pragma unroll
            for (int k = 0; k < WPR; k++) si = __dp4a(w[u * WPR + k], xc.w[n][u * WPR + k], si);
            t = fmaf(sc[u], (float)si, t);
        }
        acc[n] = fmaf(t, xc.d[n], acc[n]);
        if constexpr (T::HAS_MIN) {
#pragma unroll
            for (int u = 0; u < T::NRUN; u++) acc[n] = fmaf(mn[u], xc.s[n][u], acc[n]);
        }
    }
}

// Two orders of summing a row, each the same wherever a type's rows are summed (every
// integer matvec, any batch: batch invariance), so decode and speculative verify agree
// bit for bit:
//  - lane order (most types): lane l adds parts l, l + 32, ... of its row (mvs_dot's
//    fmaf chain), then the lanes' sums by q8_bfly;
//  - chunk order (types with CSUM: Q8_0): each 32-block chunk's products (mvs_dot from 0)
//    added over the warp by q8_bfly_up (partners 1, 2, 4, 8, 16 apart), then a row's chunk
//    sums in order from 0.f.  A thread holding two neighbouring blocks starts that tree by
//    adding them, so the decode megakernel's bulk ring (a thread a block pair) needs no
//    second pass over a slot to keep these sums.
template <class T, class = void>
struct csum_of { static constexpr bool v = false; };
template <class T>
struct csum_of<T, decltype((void)T::CSUM)> { static constexpr bool v = T::CSUM; };
template <class T>
constexpr bool csum_v = csum_of<T>::v;

DEV float q8_bfly_up(float p) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
    return p;
}

// q8_bfly_up of V values a lane at once (V a power of two, at most 32): lane l is left
// with value (l % V)'s sum.  Each stage halves the values a lane holds (it keeps the ones
// its lane bit selects, sends its partner the others), so V values cost V - 1 + 5 - log2 V
// shuffles, not 5 V, and every sum is the one q8_bfly_up makes (lane l's value plus lane
// l ^ o's at each stage).
template <int V, int N = V, int S = 0>
DEV float q8_bfly_up_many(float (&a)[V], int lane) {
    static_assert(V >= 1 && V <= 32 && (V & (V - 1)) == 0, "V a power of two");
    if constexpr (S == 5) {
        return a[0];
    } else {
        constexpr int o = 1 << S;
        if constexpr (N > 1) {                        // N values still held: keep half
            const bool hi = lane & o;
#pragma unroll
            for (int i = 0; i < N / 2; i++) {
                const float keep = hi ? a[2 * i + 1] : a[2 * i], send = hi ? a[2 * i] : a[2 * i + 1];
                a[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
            return q8_bfly_up_many<V, N / 2, S + 1>(a, lane);
        } else {
            a[0] += __shfl_xor_sync(0xffffffffu, a[0], o);
            return q8_bfly_up_many<V, 1, S + 1>(a, lane);
        }
    }
}

// one chunk of R rows from shared memory (sm: the chunk's R row pieces as laid out by
// the loads; c: chunk index) into acc.
// Chunk order (csum_v<T>): acc[0][0] is lane l's output l's sum so far (output r NR + n).
template <class T, int NR, int R>
DEV void mvs_chunk(const uint4* sm, const MvsX<T, NR>& xc, float (&acc)[R][NR], long long base,
                   long long row_bytes, int c, int nrows, int nparts, int lane) {
    constexpr int CB = MVS_CW / T::QK * T::BB;
    constexpr int NV = (CB + 30) / 16;
    const int gp = c * 32 + lane;
    if constexpr (csum_v<T>) {
        if (c * 32 >= nparts) return;                 // the whole warp
        constexpr int RN = R * NR;                    // values a lane, padded to a power of two
        constexpr int V = RN <= 1 ? 1 : RN <= 2 ? 2 : RN <= 4 ? 4 : RN <= 8 ? 8 : RN <= 16 ? 16 : 32;
        float t[V];
#pragma unroll
        for (int i = 0; i < V; i++) t[i] = 0.f;
        if (gp < nparts) {
            const int boff = (gp - c * (MVS_CW / T::QK)) * T::BB;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r < nrows) {
                    const long long s = base + r * row_bytes + (long long)c * CB;
                    float p[NR];
#pragma unroll
                    for (int n = 0; n < NR; n++) p[n] = 0.f;
                    mvs_dot<T, NR>((const u8*)(sm + r * NV) + (int)(s & 15) + boff, 0, xc, p);
#pragma unroll
                    for (int n = 0; n < NR; n++) t[r * NR + n] = p[n];
                }
            }
        }
        acc[0][0] += q8_bfly_up_many<V>(t, lane);
        return;
    }
    if (gp >= nparts) return;
    const int blk = gp / T::PPB, part = gp % T::PPB;
    const int boff = (blk - c * (MVS_CW / T::QK)) * T::BB;
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r < nrows) {
            const long long s = base + r * row_bytes + (long long)c * CB;
            mvs_dot<T, NR>((const u8*)(sm + r * NV) + (int)(s & 15) + boff, part, xc, acc[r]);
        }
    }
}

// the warp's R x NR sums over its lanes; lane r*NR+n stores output (r, n).  SUMMED: the
// sums are whole already, lane l's in acc[0][0] (chunk order)
template <int NR, int R, bool SUMMED = false>
DEV void mvs_store(float (&acc)[R][NR], float* y, const float* bias, int ldy, int m0, int nrows, int lane,
                   int mode) {
    float mine = acc[0][0];
    if constexpr (!SUMMED) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int n = 0; n < NR; n++) {
            float v = acc[r][n];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == r * NR + n) mine = v;
        }
    }
    const int r = lane / NR, n = lane % NR;
    if (lane < R * NR && r < nrows) {
        float* dst = y + (long long)n * ldy + m0 + r;
        if (mode == 1) *dst += mine;
        else *dst = bias ? mine + bias[m0 + r] : mine;
    }
}

// mvs for one weight W (y, bias, M: its output): the warp's R rows.  PRE: chunk 0's
// weights are loaded before the PDL wait, which the body then makes (no kernel writes
// weights); else the caller has waited (mvs_id: which weights is itself an input).
template <class T, int NR, int R, bool PRE>
DEV void mvs_run(const u8* __restrict__ W, float* y, const float* bias, int M, int K, long long row_bytes,
                 const signed char* __restrict__ xq, const float* __restrict__ xd, const float* __restrict__ xs,
                 int ldy, int mode) {
    constexpr int CB = MVS_CW / T::QK * T::BB;        // bytes of a row's full chunk
    constexpr int NV = (CB + 30) / 16;                // 16-byte words covering them at any alignment
    constexpr int LPL = (R * NV + 31) / 32;           // loads a lane
    static_assert(T::PE == 32 && MVS_CW / T::PE == 32, "one part a lane a row");
    static_assert(R * NR <= 32, "a lane per output");
    __shared__ uint4 smem[MVS_WARPS][R * NV + 1];     // +1: lda2 reads a word past a block

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m0 = (blockIdx.x * MVS_WARPS + warp) * R;
    if (m0 >= M) return;                              // the whole warp
    const int nrows = min(R, M - m0);
    const int nparts = K / T::QK * T::PPB;
    const int nch = (K + MVS_CW - 1) / MVS_CW;
    const long long base = (long long)m0 * row_bytes;
    uint4* sm = smem[warp];

    uint4 buf[LPL];
    MvsX<T, NR> xa;
    // issue chunk c: its R row pieces as 16-byte words, and this lane's activations
    auto issue = [&](int c, bool weights = true, bool acts = true) {
        const int cb = min(MVS_CW, K - c * MVS_CW) / T::QK * T::BB;
        if (weights) {
#pragma unroll
        for (int i = 0; i < LPL; i++) {
            const int j = lane + 32 * i, r = j / NV, v = j - r * NV;
            const long long s = base + r * row_bytes + (long long)c * CB, a = s & ~15LL;
            uint4 val = make_uint4(0u, 0u, 0u, 0u);
            if (r < nrows && a + 16 * v < s + cb) val = ldg_w<0>(W + a + 16 * v);
            buf[i] = val;
        }
        }
        const int gp = c * 32 + lane;
        if (acts && gp < nparts) mvs_load_x<T, NR>(xa, xq, xd, xs, K, gp / T::PPB, gp % T::PPB);
    };

    float acc[R][NR];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int n = 0; n < NR; n++) acc[r][n] = 0.f;

    issue(0, true, false);                            // weights before the wait (PRE: no kernel writes them)
    if constexpr (PRE) {
        PDL_WAIT();
        PDL_LATE_TRIGGER();
    }
    issue(0, false, true);
    for (int c = 0; c < nch; c++) {
        __syncwarp();                                 // the last chunk's reads are done
#pragma unroll
        for (int i = 0; i < LPL; i++) {
            const int j = lane + 32 * i;
            if (j < R * NV) sm[j] = buf[i];
        }
        __syncwarp();
        const MvsX<T, NR> xc = xa;
        if (c + 1 < nch) issue(c + 1);
        mvs_chunk<T, NR, R>(sm, xc, acc, base, row_bytes, c, nrows, nparts, lane);
    }
    mvs_store<NR, R, csum_v<T>>(acc, y, bias, ldy, m0, nrows, lane, mode);
}

template <class T, int NR, int R>
__global__ void __launch_bounds__(32 * MVS_WARPS) mvs(
        const u8* __restrict__ W0, const u8* __restrict__ W1, const u8* __restrict__ W2,
        float* y0, float* y1, float* y2,
        const float* b0, const float* b1, const float* b2,
        int M0, int M1, int M2,
        int K, long long row_bytes, const signed char* __restrict__ xq, const float* __restrict__ xd,
        const float* __restrict__ xs, int ldy0, int ldy1, int ldy2, int mode) {
    PDL_EARLY_TRIGGER();
    const int wsel = blockIdx.y;
    const u8* W = wsel == 0 ? W0 : (wsel == 1 ? W1 : W2);
    float* y = wsel == 0 ? y0 : (wsel == 1 ? y1 : y2);
    const float* bias = wsel == 0 ? b0 : (wsel == 1 ? b1 : b2);
    const int M = wsel == 0 ? M0 : (wsel == 1 ? M1 : M2);
    const int ldy = wsel == 0 ? ldy0 : (wsel == 1 ? ldy1 : ldy2);
    mvs_run<T, NR, R, true>(W, y, bias, M, K, row_bytes, xq, xd, xs, ldy, mode);
}
