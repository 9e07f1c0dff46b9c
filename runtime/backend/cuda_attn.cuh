// Attention pieces shared by the eager kernels (cuda_kernels.cu) and the decode
// megakernel (tests/lab/mega.cu), so both compute the same float operations in the same
// order: a decode step replayed by the megakernel equals the same token's row of an
// eager (speculative verify) step bit for bit.
#pragma once
#include <cuda_fp16.h>
#define NEG_INF __int_as_float(0xff800000)
#define ADEV static __device__ __forceinline__

ADEV float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// RoPE: the angle in double, as the CPU computes it; the rotation with its rounding
// fixed (no FMA contraction), so every kernel that rotates gets the same bits
ADEV void rope_cs(int pos, float pos_scale, float inv_freq, float& c, float& s) {
    const double ps = (double)pos / (double)pos_scale;
    const double ang = ps * (double)inv_freq;
    c = (float)cos(ang);
    s = (float)sin(ang);
}
ADEV float rope_lo(float a, float b, float c, float s) { return __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)); }
ADEV float rope_hi(float a, float b, float c, float s) { return __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c)); }

template <int DPL>
ADEV void load_h(const __half* p, float* f) {
    if constexpr (DPL == 1) {
        f[0] = __half2float(*p);
    } else if constexpr (DPL == 2) {
        float2 a = __half22float2(*(const __half2*)p);
        f[0] = a.x; f[1] = a.y;
    } else if constexpr (DPL == 4) {
        uint2 u = *(const uint2*)p;
        float2 a = __half22float2(*(const __half2*)&u.x), b = __half22float2(*(const __half2*)&u.y);
        f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
    } else {
#pragma unroll
        for (int c = 0; c < DPL; c += 8) {
            uint4 u = *(const uint4*)(p + c);
            unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float2 a = __half22float2(*(const __half2*)&w[e]);
                f[c + 2 * e] = a.x; f[c + 2 * e + 1] = a.y;
            }
        }
    }
}

// A q8_0 V pool (the k16v8 cache): int8 values [slot][kvh][HD] and one fp16 scale per 32
// of them [slot][kvh][HD/32], the CPU backend's layout.  The kernels take V as a
// `const __half*` (f16 pool) or a V8 and read it through the overloads below; a value
// dequantizes as (float)q * scale, as on the CPU.
struct V8 {
    const signed char* q;
    const __half* s;
};

// dims off .. off+DPL-1 of the V pool (element offset; DPL divides 32: one scale)
template <int DPL>
ADEV void load_v(const __half* vp, long long off, float* f) { load_h<DPL>(vp + off, f); }
template <int DPL>
ADEV void load_v(const V8& vp, long long off, float* f) {
    const float d = __half2float(vp.s[off / 32]);
    if constexpr (DPL % 4 == 0) {
#pragma unroll
        for (int c = 0; c < DPL; c += 4) {
            const char4 u = *(const char4*)(vp.q + off + c);
            f[c] = (float)u.x * d; f[c + 1] = (float)u.y * d; f[c + 2] = (float)u.z * d; f[c + 3] = (float)u.w * d;
        }
    } else {
#pragma unroll
        for (int c = 0; c < DPL; c++) f[c] = (float)vp.q[off + c] * d;
    }
}
// dims off .. off+7 of the V pool as 8 fp16 values (the tile kernels' shared-memory form;
// a q8_0 value rounds to fp16 there, as an f16 cache's value is)
ADEV uint4 load_v8h(const __half* vp, long long off) { return *(const uint4*)(vp + off); }
ADEV uint4 load_v8h(const V8& vp, long long off) {
    const float d = __half2float(vp.s[off / 32]);
    const uint2 u = *(const uint2*)(vp.q + off);
    const char4 a = *(const char4*)&u.x, b = *(const char4*)&u.y;
    __half2 h[4] = {__floats2half2_rn((float)a.x * d, (float)a.y * d), __floats2half2_rn((float)a.z * d, (float)a.w * d),
                    __floats2half2_rn((float)b.x * d, (float)b.y * d), __floats2half2_rn((float)b.z * d, (float)b.w * d)};
    return *(const uint4*)h;
}

template <bool CG>
ADEV float ldf(const float* p) {
    if constexpr (CG) return __ldcg(p);
    else return *p;
}

// What a row's output sums (weighted by exp(score - m), their total l; natural units) are
// multiplied by when an attention sink joins its softmax (gpt-oss: a learned logit per
// query head h in the denominator, with no value): exp(m - M) / (l exp(m - M) +
// exp(sink - M)), M = max(m, sink), so neither exponential overflows.  The callers keep
// their own A / L (or A * (1 / L)) when sinks is null: rows without sinks are unchanged.
ADEV float sink_inv(float l, float m, const float* sinks, int h) {
    const float s = sinks[h], mm = fmaxf(m, s), c = expf(m - mm);
    return c / fmaf(l, c, expf(s - mm));
}

// The first key a token at position pos sees: its sliding window's first (0 without one)
ADEV int window_lo(int pos, int window) {
    return (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
}

// Keys j0 .. j1-1 of context split sp of n_splits for a token at position pos: its
// window's keys (all from 0 without one) in equal ranges, the last one shorter.  Every
// decode kernel splits this way, so a split's keys do not depend on the kernel.
ADEV void split_keys(int pos, int window, int sp, int n_splits, int& j0, int& j1) {
    const int lo = window_lo(pos, window);
    const int chunk = (pos + 1 - lo + n_splits - 1) / n_splits;
    j0 = lo + sp * chunk;
    j1 = min(pos + 1, j0 + chunk);
}

// RW rows' running state for tile_row, empty: max -inf, sum 0, their dims' sums 0
template <int RW, int NA>
ADEV void rows_empty(float (&acc)[RW][NA], float (&m)[RW], float (&l)[RW]) {
#pragma unroll
    for (int i = 0; i < RW; i++) {
        m[i] = NEG_INF; l[i] = 0.f;
#pragma unroll
        for (int k = 0; k < NA; k++) acc[i][k] = 0.f;
    }
}

// One query row against a tile of BK keys staged in shared memory (K transposed in dim
// pairs, skt[HD/2][BK+1]: lane j reads key j without bank conflicts; V as rows,
// sv[BK][HD/2]): lane j scores key j (eight independent FMA chains, not one of HD),
// then the row's running max m and sum l, and the lane's dims 2 (lane + 32 k), +1 of acc
// (p_j V_j, p_j shuffled from lane j).  q: the row's HD values (pre-scaled), valid: lane
// j's key counts for the row.  False, nothing changed, when no lane's key counts.  The
// prompt kernel (attn_prefill) and the long-context decode kernel (attn_tiles) share it.
template <int HD, int BK>
ADEV bool tile_row(const float* q, const __half2 (*skt)[BK + 1], const __half2 (*sv)[HD / 2], int lane,
                   bool valid, float& m, float& l, float* acc) {
    constexpr int DP2 = HD / 64;
    float sa[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int d = 0; d < HD; d += 8) {
        const float4 qa = *(const float4*)&q[d], qb = *(const float4*)&q[d + 4];
        const float2 k0 = __half22float2(skt[d / 2][lane]), k1 = __half22float2(skt[d / 2 + 1][lane]);
        const float2 k2v = __half22float2(skt[d / 2 + 2][lane]), k3 = __half22float2(skt[d / 2 + 3][lane]);
        sa[0] = fmaf(qa.x, k0.x, sa[0]); sa[1] = fmaf(qa.y, k0.y, sa[1]);
        sa[2] = fmaf(qa.z, k1.x, sa[2]); sa[3] = fmaf(qa.w, k1.y, sa[3]);
        sa[4] = fmaf(qb.x, k2v.x, sa[4]); sa[5] = fmaf(qb.y, k2v.y, sa[5]);
        sa[6] = fmaf(qb.z, k3.x, sa[6]); sa[7] = fmaf(qb.w, k3.y, sa[7]);
    }
    float s = ((sa[0] + sa[1]) + (sa[2] + sa[3])) + ((sa[4] + sa[5]) + (sa[6] + sa[7]));
    s = valid ? s : NEG_INF;
    float mt = s;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
    if (mt == NEG_INF) return false;          // the whole warp agrees
    const float mn = fmaxf(m, mt);
    const float corr = expf(m - mn);
    const float p = valid ? expf(s - mn) : 0.f;
    l = fmaf(l, corr, warp_sum(p));
#pragma unroll
    for (int k = 0; k < 2 * DP2; k++) acc[k] *= corr;
#pragma unroll 8
    for (int jj = 0; jj < BK; jj++) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
        for (int k = 0; k < DP2; k++) {
            const float2 vf = __half22float2(sv[jj][lane + 32 * k]);
            acc[2 * k] = fmaf(pj, vf.x, acc[2 * k]);
            acc[2 * k + 1] = fmaf(pj, vf.y, acc[2 * k + 1]);
        }
    }
    m = mn;
    return true;
}

// Dims c .. c+7 of key j's K and V rows (kv head kh; a table entry, then 16 bytes of each),
// zeros for keys from `end` on: the piece a thread gathers of a key tile (attn_tiles,
// attn_prefill, attn_prefill_mma), each kernel then storing it in its own layout.
template <int HD, class VP>
ADEV void kv_piece(const __half* kp, VP vp, const int* table, int j, int end, int block_size, int kvh,
                   int kh, int c, uint4& k, uint4& v) {
    k = make_uint4(0, 0, 0, 0);
    v = make_uint4(0, 0, 0, 0);
    if (j < end) {
        const long long off = ((long long)table[j / block_size] * block_size + j % block_size) * kvh * HD + kh * HD + c;
        k = *(const uint4*)(kp + off);
        v = load_v8h(vp, off);
    }
}

// Key j's K and V rows, lane's HD/32 dims of kv head kh (a table entry, then the rows).
template <int HD, class VP>
ADEV void attn_key(const __half* kp, VP vp, const int* table, int j, int block_size, int kvh, int kh,
                   int lane, float* kn, float* vn) {
    constexpr int DPL = HD / 32;
    const long long rowstride = (long long)kvh * HD;
    const long long slot = (long long)table[j / block_size] * block_size + j % block_size;
    load_h<DPL>(kp + slot * rowstride + kh * HD + lane * DPL, kn);
    load_v<DPL>(vp, slot * rowstride + kh * HD + lane * DPL, vn);
}

// One (context split, kv head, token) of paged attention with an online softmax,
// flash-decoding style, by NW warps (tid 0 .. 32*NW-1): the G query heads that share
// kv head kh walk keys j0..j1-1 (key j to warp (j-j0) % NW); each lane holds HD/32
// dims; each K/V row is read once for the whole GQA group.  The warps' states merge
// in shared memory (sm_m, sm_l [NW][G], sm_acc [NW][G][HD]); with one split the
// result goes to out, else (max, sum, weighted V) to part_* for attn_merge_head.
// qf(g, d): query head kh*G+g, dim d (rotated); sync(): barrier of the NW warps.
// vp: the V pool, f16 (`const __half*`) or q8_0 (V8).
// attn_split_from takes the warp's first key (j0 + warp, when < j1) already in kn / vn:
// a caller may load it early (the decode kernel does, before its wait on the kernel
// ahead); attn_split below loads it itself.  PF: the warp's keys in flight (loaded
// ahead of the one it computes): a warp's keys are a chain of dependent loads (table
// entry, then the rows), so at long contexts the walk is latency; PF changes when a
// key is loaded, never a sum.  sinks (null: none): the query heads' sink logits, taken
// where a row's result is final (one split; else attn_merge takes them).
template <int HD, int G, int NW, int PF = 1, class QF, class SYNC, class VP>
ADEV void attn_split_from(const QF& qf, const SYNC& sync, const __half* kp, VP vp, const int* table,
                          int j0, int j1, int block_size, int kvh, int kh, int t, int sp, int n_splits, float scale,
                          float* sm_m, float* sm_l, float* sm_acc, int tid, float* part_m, float* part_l,
                          float* part_acc, float* out, float (&kn)[HD / 32], float (&vn)[HD / 32],
                          const float* sinks = nullptr) {
    constexpr int DPL = HD / 32;
    const int warp = tid >> 5, lane = tid & 31;
    const int H = kvh * G;
    float qr[G][DPL], m[G], l[G], acc[G][DPL];
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int i = 0; i < DPL; i++) { qr[g][i] = qf(g, lane * DPL + i) * scale; acc[g][i] = 0.f; }
        m[g] = NEG_INF; l[g] = 0.f;
    }
    // keys j0 + warp + NW r (r < PF) in a ring: key r's slot is refilled with key
    // r + PF as soon as it has been copied out for computing
    float kr[PF][DPL], vr[PF][DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) { kr[0][i] = kn[i]; vr[0][i] = vn[i]; }
#pragma unroll
    for (int r = 1; r < PF; r++)
        if (j0 + warp + NW * r < j1) attn_key<HD>(kp, vp, table, j0 + warp + NW * r, block_size, kvh, kh, lane, kr[r], vr[r]);
    for (int jb = j0 + warp; jb < j1; jb += NW * PF) {
#pragma unroll
        for (int r = 0; r < PF; r++) {
            const int j = jb + NW * r;
            if (j < j1) {
                float kf[DPL], vf[DPL];
#pragma unroll
                for (int i = 0; i < DPL; i++) { kf[i] = kr[r][i]; vf[i] = vr[r][i]; }
                if (j + NW * PF < j1) attn_key<HD>(kp, vp, table, j + NW * PF, block_size, kvh, kh, lane, kr[r], vr[r]);
#pragma unroll
                for (int g = 0; g < G; g++) {
                    float s = 0.f;
#pragma unroll
                    for (int i = 0; i < DPL; i++) s = fmaf(qr[g][i], kf[i], s);
                    s = warp_sum(s);
                    // branch-free online softmax: the G heads' updates are independent chains
                    const float mn = fmaxf(m[g], s);
                    const float corr = expf(m[g] - mn), p = expf(s - mn);
                    l[g] = fmaf(l[g], corr, p);
#pragma unroll
                    for (int i = 0; i < DPL; i++) acc[g][i] = fmaf(acc[g][i], corr, p * vf[i]);
                    m[g] = mn;
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) { sm_m[warp * G + g] = m[g]; sm_l[warp * G + g] = l[g]; }
#pragma unroll
        for (int i = 0; i < DPL; i++) sm_acc[(warp * G + g) * HD + lane * DPL + i] = acc[g][i];
    }
    sync();
    for (int e = tid; e < G * HD; e += 32 * NW) {
        const int g = e / HD, d = e % HD;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; w++) if (sm_l[w * G + g] > 0.f) mx = fmaxf(mx, sm_m[w * G + g]);
        float L = 0.f, A = 0.f;
#pragma unroll
        for (int w = 0; w < NW; w++) {
            if (sm_l[w * G + g] > 0.f) {
                const float c = expf(sm_m[w * G + g] - mx);
                L = fmaf(sm_l[w * G + g], c, L);
                A = fmaf(sm_acc[(w * G + g) * HD + d], c, A);
            }
        }
        if (n_splits == 1) {
            out[((long long)t * H + kh * G + g) * HD + d] =
                sinks ? A * sink_inv(L, mx, sinks, kh * G + g) : (L > 0.f ? A / L : 0.f);
        } else {
            const long long pi = ((long long)(t * kvh + kh) * n_splits + sp) * G + g;
            part_acc[pi * HD + d] = A;
            if (d == 0) { part_m[pi] = mx; part_l[pi] = L; }
        }
    }
}

// One (context split, kv head, token): attn_split_from with the first key loaded here.
template <int HD, int G, int NW, class QF, class SYNC, class VP>
ADEV void attn_split(const QF& qf, const SYNC& sync, const __half* kp, VP vp, const int* table,
                     int j0, int j1, int block_size, int kvh, int kh, int t, int sp, int n_splits, float scale,
                     float* sm_m, float* sm_l, float* sm_acc, int tid, float* part_m, float* part_l,
                     float* part_acc, float* out) {
    float kn[HD / 32], vn[HD / 32];
    if (j0 + (tid >> 5) < j1) attn_key<HD>(kp, vp, table, j0 + (tid >> 5), block_size, kvh, kh, tid & 31, kn, vn);
    attn_split_from<HD, G, NW>(qf, sync, kp, vp, table, j0, j1, block_size, kvh, kh, t, sp, n_splits, scale,
                               sm_m, sm_l, sm_acc, tid, part_m, part_l, part_acc, out, kn, vn);
}

// the context splits of (token t, query head h) combined, dims d = tid, tid + nt, ...:
// max over splits, then sum(l * exp(m - max)) and sum(acc * exp(m - max)) in split order.
// The loads of a batch of NB splits go out together (the split loop is short and its
// loads independent): one trip to the L2 per NB splits, not one per split; NB does
// not change a sum.
template <int HD, int G, bool CG, int NB = 16>
ADEV void attn_merge_head(const float* part_m, const float* part_l, const float* part_acc, int n_splits, int kvh,
                          int t, int h, float* out, int tid, int nt, const float* sinks = nullptr) {
    const int H = kvh * G;
    const int kh = h / G, g = h % G;
    const long long base = (long long)(t * kvh + kh) * n_splits;
    float mx = NEG_INF;
    for (int s0 = 0; s0 < n_splits; s0 += NB) {
        float lv[NB], mv[NB];
#pragma unroll
        for (int j = 0; j < NB; j++) {
            const long long pi = (base + s0 + j) * G + g;
            lv[j] = s0 + j < n_splits ? ldf<CG>(part_l + pi) : 0.f;
            mv[j] = s0 + j < n_splits ? ldf<CG>(part_m + pi) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < NB; j++)
            if (lv[j] > 0.f) mx = fmaxf(mx, mv[j]);
    }
    for (int d = tid; d < HD; d += nt) {
        float L = 0.f, A = 0.f;
        for (int s0 = 0; s0 < n_splits; s0 += NB) {
            float lv[NB], mv[NB], av[NB];
#pragma unroll
            for (int j = 0; j < NB; j++) {
                const long long pi = (base + s0 + j) * G + g;
                const bool in = s0 + j < n_splits;
                lv[j] = in ? ldf<CG>(part_l + pi) : 0.f;
                mv[j] = in ? ldf<CG>(part_m + pi) : 0.f;
                av[j] = in ? ldf<CG>(part_acc + pi * HD + d) : 0.f;
            }
#pragma unroll
            for (int j = 0; j < NB; j++) {
                if (lv[j] > 0.f) {
                    const float c = expf(mv[j] - mx);
                    L = fmaf(lv[j], c, L);
                    A = fmaf(av[j], c, A);
                }
            }
        }
        out[((long long)t * H + h) * HD + d] = sinks ? A * sink_inv(L, mx, sinks, h) : (L > 0.f ? A / L : 0.f);
    }
}
