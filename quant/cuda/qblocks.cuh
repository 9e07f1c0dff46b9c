// GGML block formats, decoded in registers on the GPU.
//
// Every type is seen as blocks of QK weights of BB bytes (F32/F16/BF16 as
// "blocks" of 32 values).  A block splits into PPB parts of PE weights; one
// thread decodes one part.  A part is NRUN runs of RLEN consecutive weights;
// run r starts at element run_start(part, r) of the block.  decode() gives the
// integer-valued q of each weight as a float and, per run, a scale and a min:
//     weight = sc[r] * q + mn[r]
// so a dot product is sc * sum(q*x) + mn * sum(x) per run: one FMA a weight.
//
// Small integers become floats without the int->float converter (a quarter-
// rate unit): OR the byte into the mantissa of 2^23 and subtract 2^23.
//
// Blocks start at 2-byte alignment for Q4_0, Q5_0, Q8_0 and Q6_K (18, 22, 34,
// 210 bytes), so those are read 16 bits at a time; Q4_K/Q5_K blocks are
// 16-byte aligned and read with 16-byte loads.  Only plain CUDA C: sm_75 up.
#pragma once
#include <cuda_fp16.h>
#include "pdl.cuh"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#define DEV static __device__ __forceinline__

DEV u32 ld16(const u8* p) { return *(const u16*)p; }
DEV u32 ld32a2(const u8* p) { return ld16(p) | (ld16(p + 2) << 16); }
DEV u32 ld32(const u8* p) { return *(const u32*)p; }
DEV float ldh(const u8* p) { return __half2float(__ushort_as_half(*(const u16*)p)); }

// byte k of v (0..255) as float, minus `off`
template <int k>
DEV float bytef(u32 v, float off) {
    return __int_as_float(__byte_perm(v, 0x4B000000u, 0x7650 | k)) - (8388608.0f + off);
}

// the four bytes of v into q[0..3], each minus off
DEV void bytes4(u32 v, float off, float* q) {
    q[0] = bytef<0>(v, off); q[1] = bytef<1>(v, off);
    q[2] = bytef<2>(v, off); q[3] = bytef<3>(v, off);
}

DEV void scale_min_k4(int j, const u8* s, int& sc, int& mn) {
    if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
    else { sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

// ---------------------------------------------------------------- legacy 32-blocks
struct TQ4_0 {
    enum { QK = 32, BB = 18, PPB = 1, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 0 };
    DEV int run_start(int, int r) { return 16 * r; }
    DEV void decode(const u8* b, int, float* q, float* sc, float* mn) {
        float d = ldh(b);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 v = ld32a2(b + 2 + 4 * i);
            bytes4(v & 0x0F0F0F0Fu, 8.f, q + 4 * i);
            bytes4((v >> 4) & 0x0F0F0F0Fu, 8.f, q + 16 + 4 * i);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};

struct TQ4_1 {
    enum { QK = 32, BB = 20, PPB = 1, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 1 };
    DEV int run_start(int, int r) { return 16 * r; }
    DEV void decode(const u8* b, int, float* q, float* sc, float* mn) {
        float d = ldh(b), m = ldh(b + 2);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 v = ld32(b + 4 + 4 * i);
            bytes4(v & 0x0F0F0F0Fu, 0.f, q + 4 * i);
            bytes4((v >> 4) & 0x0F0F0F0Fu, 0.f, q + 16 + 4 * i);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = m;
    }
};

// 5th bits: bit j of qh belongs to element j; spread 4 of them to bit 4 of 4 bytes
DEV u32 hibits4(u32 qh, int j) {
    u32 h = (qh >> j) & 0xFu;
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

struct TQ5_0 {
    enum { QK = 32, BB = 22, PPB = 1, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 0 };
    DEV int run_start(int, int r) { return 16 * r; }
    DEV void decode(const u8* b, int, float* q, float* sc, float* mn) {
        float d = ldh(b);
        u32 qh = ld32a2(b + 2);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 v = ld32a2(b + 6 + 4 * i);
            bytes4((v & 0x0F0F0F0Fu) | hibits4(qh, 4 * i), 16.f, q + 4 * i);
            bytes4(((v >> 4) & 0x0F0F0F0Fu) | hibits4(qh, 16 + 4 * i), 16.f, q + 16 + 4 * i);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};

struct TQ5_1 {
    enum { QK = 32, BB = 24, PPB = 1, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 1 };
    DEV int run_start(int, int r) { return 16 * r; }
    DEV void decode(const u8* b, int, float* q, float* sc, float* mn) {
        float d = ldh(b), m = ldh(b + 2);
        u32 qh = ld32(b + 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 v = ld32(b + 8 + 4 * i);
            bytes4((v & 0x0F0F0F0Fu) | hibits4(qh, 4 * i), 0.f, q + 4 * i);
            bytes4(((v >> 4) & 0x0F0F0F0Fu) | hibits4(qh, 16 + 4 * i), 0.f, q + 16 + 4 * i);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = m;
    }
};

struct TQ8_0 {
    enum { QK = 32, BB = 34, PPB = 1, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 0 };
    DEV int run_start(int, int r) { return 16 * r; }
    DEV void decode(const u8* b, int, float* q, float* sc, float* mn) {
        float d = ldh(b);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            // flip the sign bits: signed byte s becomes s + 128
            u32 v = ld32a2(b + 2 + 4 * i) ^ 0x80808080u;
            bytes4(v, 128.f, q + 4 * i);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};

// MXFP4 (17-byte blocks: any byte alignment): E8M0 scale byte e, then 16 bytes of E2M1
// codes as Q4_0's nibbles.  The codes index a 16-byte table by __byte_perm (llama.cpp's
// trick): the low 3 bits of a code pick a byte of the table's low or high 8 bytes, the 4th
// picks between the two.  Values are ggml's doubled E2M1 (|v| <= 12, integers), the scale
// 2^(e-128) as a float32 (dequant.e8m0_half's bits: subnormal for e < 2).
DEV float e8m0_half(u32 e) { return __uint_as_float(e < 2u ? 0x00200000u << e : (e - 1u) << 23); }

// N 32-bit words from p at any byte alignment: N + 1 aligned loads and funnel shifts
// (reads up to 4 bytes past the N words)
template <int N>
DEV void ldu(const u8* p, u32* w) {
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

// the table bytes t[0..15] (as four little-endian words) at the 4 codes in the bytes of n
// (each 0..15)
DEV u32 lut16(u32 n, u32 t0, u32 t1, u32 t2, u32 t3) {
    const u32 c = n | (n >> 4);                        // codes 0,1 in byte 0; 2,3 in byte 2
    const u32 sel = (c & 0xFFu) | ((c >> 8) & 0xFF00u);  // code i in nibble i
    const u32 lo = __byte_perm(t0, t1, sel & 0x7777u), hi = __byte_perm(t2, t3, sel & 0x7777u);
    return __byte_perm(lo, hi, 0x3210u | ((sel & 0x8888u) >> 1));
}

// kvalues_mxfp4 + 12 (unsigned): {12,13,14,15,16,18,20,24, 12,11,10,9,8,6,4,0}
#define MXFP4_U0 0x0F0E0D0Cu
#define MXFP4_U1 0x18141210u
#define MXFP4_U2 0x090A0B0Cu
#define MXFP4_U3 0x00040608u

struct TMXFP4 {
    enum { QK = 32, BB = 17, PPB = 1, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 0 };
    DEV int run_start(int, int r) { return 16 * r; }
    DEV void decode(const u8* b, int, float* q, float* sc, float* mn) {
        const float d = e8m0_half(b[0]);
        u32 v[4];
        ldu<4>(b + 1, v);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            bytes4(lut16(v[i] & 0x0F0F0F0Fu, MXFP4_U0, MXFP4_U1, MXFP4_U2, MXFP4_U3), 12.f, q + 4 * i);
            bytes4(lut16((v[i] >> 4) & 0x0F0F0F0Fu, MXFP4_U0, MXFP4_U1, MXFP4_U2, MXFP4_U3), 12.f, q + 16 + 4 * i);
        }
        sc[0] = sc[1] = d; mn[0] = mn[1] = 0.f;
    }
};

// ---------------------------------------------------------------- K-quants (256)
// Q4_K: part i of 8 = 64-group g = i/2, half h = i%2: 16 low nibbles (sub-block 2g)
// and 16 high nibbles (sub-block 2g+1) of qs[32g + 16h .. +16].
struct TQ4_K {
    enum { QK = 256, BB = 144, PPB = 8, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 1 };
    DEV int run_start(int p, int r) { return 64 * (p >> 1) + 32 * r + 16 * (p & 1); }
    DEV void decode(const u8* b, int p, float* q, float* sc, float* mn) {
        float d = ldh(b), dmin = ldh(b + 2);
        int g = p >> 1;
        int s0, m0, s1, m1;
        scale_min_k4(2 * g, b + 4, s0, m0);
        scale_min_k4(2 * g + 1, b + 4, s1, m1);
        uint4 v = *(const uint4*)(b + 16 + 16 * p);
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            bytes4(w[i] & 0x0F0F0F0Fu, 0.f, q + 4 * i);
            bytes4((w[i] >> 4) & 0x0F0F0F0Fu, 0.f, q + 16 + 4 * i);
        }
        sc[0] = d * s0; mn[0] = -dmin * m0;
        sc[1] = d * s1; mn[1] = -dmin * m1;
    }
};

// Q5_K: as Q4_K; bit 2g (low) / 2g+1 (high) of qh[l] is the 5th bit of element l
struct TQ5_K {
    enum { QK = 256, BB = 176, PPB = 8, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 1 };
    DEV int run_start(int p, int r) { return 64 * (p >> 1) + 32 * r + 16 * (p & 1); }
    DEV void decode(const u8* b, int p, float* q, float* sc, float* mn) {
        float d = ldh(b), dmin = ldh(b + 2);
        int g = p >> 1, h = p & 1;
        int s0, m0, s1, m1;
        scale_min_k4(2 * g, b + 4, s0, m0);
        scale_min_k4(2 * g + 1, b + 4, s1, m1);
        uint4 v = *(const uint4*)(b + 48 + 16 * p);
        uint4 hv = *(const uint4*)(b + 16 + 16 * h);
        u32 w[4] = {v.x, v.y, v.z, v.w};
        u32 hh[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 lo = ((hh[i] >> (2 * g)) & 0x01010101u) << 4;
            u32 hi = ((hh[i] >> (2 * g + 1)) & 0x01010101u) << 4;
            bytes4((w[i] & 0x0F0F0F0Fu) | lo, 0.f, q + 4 * i);
            bytes4(((w[i] >> 4) & 0x0F0F0F0Fu) | hi, 0.f, q + 16 + 4 * i);
        }
        sc[0] = d * s0; mn[0] = -dmin * m0;
        sc[1] = d * s1; mn[1] = -dmin * m1;
    }
};

// Q6_K: part i of 8 = half h = i/4, l-range [8*(i%4), +8); runs r = 0..3 are
// elements 128h + 32r + l: low/high nibbles of ql[l] and ql[l+32], 2-bit pairs of qh[l].
struct TQ6_K {
    enum { QK = 256, BB = 210, PPB = 8, PE = 32, NRUN = 4, RLEN = 8, HAS_MIN = 0 };
    DEV int run_start(int p, int r) { return 128 * (p >> 2) + 32 * r + 8 * (p & 3); }
    DEV void decode(const u8* b, int p, float* q, float* sc, float* mn) {
        int h = p >> 2, l0 = 8 * (p & 3);
        const u8* ql = b + 64 * h + l0;
        const u8* qh = b + 128 + 32 * h + l0;
        const signed char* scales = (const signed char*)(b + 192 + 8 * h + (l0 >> 4));
        float d = ldh(b + 208);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            u32 a = ld32a2(ql + 4 * i), c = ld32a2(ql + 32 + 4 * i), e = ld32a2(qh + 4 * i);
            bytes4((a & 0x0F0F0F0Fu) | ((e & 0x03030303u) << 4), 32.f, q + 4 * i);
            bytes4((c & 0x0F0F0F0Fu) | (((e >> 2) & 0x03030303u) << 4), 32.f, q + 8 + 4 * i);
            bytes4(((a >> 4) & 0x0F0F0F0Fu) | (((e >> 4) & 0x03030303u) << 4), 32.f, q + 16 + 4 * i);
            bytes4(((c >> 4) & 0x0F0F0F0Fu) | (((e >> 6) & 0x03030303u) << 4), 32.f, q + 24 + 4 * i);
        }
#pragma unroll
        for (int r = 0; r < 4; r++) { sc[r] = d * (float)scales[2 * r]; mn[r] = 0.f; }
    }
};

// ---------------------------------------------------------------- float types
// word(v, f): the WE values of a 16-byte word as floats (decode's, and mvf's in qfloat.cuh)
struct TF32 {
    enum { QK = 32, BB = 128, PPB = 1, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 0, WE = 4 };
    DEV int run_start(int, int r) { return 16 * r; }
    DEV void word(uint4 v, float* f) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
    }
    DEV void decode(const u8* b, int, float* q, float* sc, float* mn) {
#pragma unroll
        for (int i = 0; i < 8; i++) word(((const uint4*)b)[i], q + 4 * i);
        sc[0] = sc[1] = 1.f; mn[0] = mn[1] = 0.f;
    }
};

struct TF16 {
    enum { QK = 32, BB = 64, PPB = 1, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 0, WE = 8 };
    DEV int run_start(int, int r) { return 16 * r; }
    DEV void word(uint4 v, float* f) {
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 t = __half22float2(*(const __half2*)&w[j]);
            f[2 * j] = t.x; f[2 * j + 1] = t.y;
        }
    }
    DEV void decode(const u8* b, int, float* q, float* sc, float* mn) {
#pragma unroll
        for (int i = 0; i < 4; i++) word(((const uint4*)b)[i], q + 8 * i);
        sc[0] = sc[1] = 1.f; mn[0] = mn[1] = 0.f;
    }
};

struct TBF16 {
    enum { QK = 32, BB = 64, PPB = 1, PE = 32, NRUN = 2, RLEN = 16, HAS_MIN = 0, WE = 8 };
    DEV int run_start(int, int r) { return 16 * r; }
    DEV void word(uint4 v, float* f) {
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            f[2 * j] = __int_as_float(w[j] << 16);
            f[2 * j + 1] = __int_as_float(w[j] & 0xFFFF0000u);
        }
    }
    DEV void decode(const u8* b, int, float* q, float* sc, float* mn) {
#pragma unroll
        for (int i = 0; i < 4; i++) word(((const uint4*)b)[i], q + 8 * i);
        sc[0] = sc[1] = 1.f; mn[0] = mn[1] = 0.f;
    }
};
