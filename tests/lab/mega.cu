// The decode step of a llama-family model (n = 1 token) as one persistent kernel.
//
// Why: a decode step is ~11 dependent kernels a layer; each launch on the H200 costs
// its ramp-up and tail with the DRAM idle, so the step read weights at ~35% of the
// copy bandwidth although the large matvecs alone reach ~50-70%.  Here one block per
// SM runs every op of every layer, blocks meeting at a grid barrier where an op needs
// the whole result of the one before (6 a layer).  Weights do not depend on the
// activations, so each warp keeps streaming the next weights it will use into a ring
// of shared-memory slots (cp.async, MG_S - 1 slots ahead, across op boundaries and
// barriers), and before a barrier or the attention it asks the L2 for the slots after
// those (prefetch): the DRAM keeps working while blocks wait, round activations, or
// walk the KV cache.
//
// sm_90+ with Q8_0 weights (MG_BULK): the block, not the warp, owns the ring.  Its
// slots (MG_S of MG_SB bytes) hold whole rows of an op, dealt to the blocks interleaved;
// thread 0 refills a slot with one bulk copy (cp.async.bulk, quant/cuda/bulk.cuh) as soon
// as every thread has read it; a thread dots a pair of blocks of the slot against the
// input transposed in shared memory; a half warp's butterfly sums a 32-block chunk and a
// row's chunk sums are added after the next slot's barrier (qint8.cuh's chunk order, which
// every Q8_0 matvec keeps).  Its streaming alone reached ~86% of copy, against ~50% for
// the warp rings (quant/cuda/NOTES.md, session 26).
//
// Same sums as the eager kernels, bit for bit (a decode row must not depend on the
// batch: speculative decoding compares them):
//   * matvec rows by mvs_dot (qint8.cuh), one row a warp task, a lane's parts in the
//     order mvs gives them (rows a warp never change a sum), the same butterfly; Q8_0 in
//     chunk order (mvs_chunk: a chunk's butterfly, then the chunks in order);
//   * activations rounded by q8_store, RMSNorm's sum of squares by q8_ss8 / q8_bfly /
//     q8_rn in q8_act's order;
//   * attention by attn_split (cuda_attn.cuh), the merge in attn_merge_head's order,
//     RoPE by rope_cs / rope_lo / rope_hi.
//
// Per layer: [QKV] RMSNorm + int8 rounding of x (each block, into its shared memory),
// q/k/v rows | [ATT] RoPE of q on the fly, the new token's K/V into the cache by the
// split that holds it, splits | [MERGE] the splits combined, an output a thread |
// [O] rounding of the attention output, o rows added to x | [GU] RMSNorm + rounding,
// gate and up rows of one index by one warp, h = silu(g) * u | [DN] rounding of h,
// down rows added to x.  Then the output norm and the logits.
//
// Data one block wrote and another reads is read with ld.global.cg (L2; the L1 is not
// coherent across SMs).  All blocks must be resident at once (grid = #SMs, one block
// an SM by its registers): a barrier that waits over ~2 s sets *err and stops waiting.
#include "qint8.cuh"

// cp.async (sm_80+; a plain copy below): the ring's loads hold no registers in flight.
DEV void cp_async16(void* dst, const void* src, bool ok) {
#if __CUDA_ARCH__ >= 800
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
#else
    *(uint4*)dst = ok ? *(const uint4*)src : make_uint4(0u, 0u, 0u, 0u);
#endif
}
DEV void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
DEV void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
#include "cuda_attn.cuh"

#ifndef MG_WARPS
#define MG_WARPS 16
#endif
#ifndef MG_S
#define MG_S 4                  // ring slots a warp
#endif
#ifndef MG_SUB
#define MG_SUB 4                // 1024-weight chunks a slot
#endif
#ifndef MG_RW
#define MG_RW 146               // 16-byte words of a row's piece of a slot (+1: lda2 reads past a block)
#endif
#define MG_SLOT (2 * MG_RW)     // a slot: the task's two rows
#ifndef MG_PFA
#define MG_PFA 0                // slots a warp (bulk: a block) asks the L2 for, ahead of the ring, before attention
#endif
#ifndef MG_PFB
#define MG_PFB 0                // ... before a barrier
#endif
#ifndef MG_KMAX
#define MG_KMAX 14336           // widest matvec input
#endif
#ifndef MG_NPH
#define MG_NPH 129              // matvec ops
#endif
#ifndef MG_HD
#define MG_HD 128
#endif
#ifndef MG_G
#define MG_G 4
#endif
#ifndef MG_BULK
#define MG_BULK 0               // sm_90+, Q8_0 matvecs: a block's ring of whole-row slots, bulk-copied
#endif
#ifndef MG_SB
#define MG_SB 32768             // bytes a bulk slot
#endif
// experiments (MegaDecode(bulk=(S, SB, flags))): wrong results, for timing only
#ifndef MG_XROWS
#define MG_XROWS 0              // bulk: the rows' sums left out
#endif
#ifndef MG_XATT
#define MG_XATT 0               // attention and merge left out
#endif
#ifndef MG_XQUANT
#define MG_XQUANT 0             // the activations' rounding left out
#endif
#ifndef MG_TABN
#define MG_TABN 512             // block-table entries kept in shared memory (8192 keys at 16 a block)
#endif
#ifndef MG_XMERGE
#define MG_XMERGE 0             // the merge left out
#endif
#ifndef MG_XADD
#define MG_XADD 0               // bulk: the rows' addends not read (0)
#endif
#ifndef MG_EARLY
#define MG_EARLY 1              // bulk: a read slot refilled before the wait for the next (0: after it)
#endif
#if MG_BULK
#include "bulk.cuh"
constexpr int MB_P = (MG_SB / 68 + MG_WARPS * 32 - 1) / (MG_WARPS * 32);   // Q8_0 block pairs a thread a slot
constexpr int MB_BLOCKS = 2 * MB_P * MG_WARPS * 32;                         // blocks a slot, at most
constexpr int MB_CH = MB_BLOCKS / 32;                                        // 32-block chunks a slot, at most
constexpr int MB_AV = MG_WARPS * 32;                                         // addends an op a block keeps in shared memory (one a thread)
constexpr int MB_ROWS = 32;                                                  // rows a slot, at most: a lane of the last warp each (mega.py BULK_ROWS)
DEV int mb_stride(int nb) { return (nb + 31) & ~31; }                       // a row's blocks in a slot: whole chunks
#endif
constexpr int ATT_GROUPS = MG_WARPS / 4;
constexpr int MG_OPS = 6;                        // ops a layer (grid barriers between)         // 4-warp groups, one attention split each
constexpr int QB = (MG_KMAX / 256 + MG_WARPS - 1) / MG_WARPS;   // 256-value groups a warp rounds
static_assert(MG_WARPS % 4 == 0, "whole 4-warp groups");
static_assert((MG_KMAX + 255) / 256 <= Q8_MAXG, "row too long");

// ---------------------------------------------------------------- descriptors
// in global memory (all 8-byte fields), as the host writes them
struct MSeg { long long W, row_bytes, y, bias, type, M; };
struct MPhase {
    MSeg seg[3];
    long long nseg, K, ntasks, kind, act, bs, src, pw;
    double eps;
};
// kind 0: y = xW^T (+ bias); 1: y += xW^T; 2: gate (seg 0) / up (seg 1) rows of task t,
// y of seg 1 = silu(gate) * up.  act 0: rounds src; 1: rounds RMSNorm(src) * pw.
// The step's other arguments are kernel parameters (constant bank: no registers held).
// the copy each block keeps in shared memory (read at every row)
struct SPh {
    const u8* W[3];
    float* y[3];
    const float* bias[3];
    const float* src;
    const float* pw;
    int rb[3], M[3], type[3], T[3];             // row bytes, rows, type, tasks (row pairs)
    int K, ntasks, kind, nseg, act, bs, nsl;
    float eps;
    int cps;                                    // chunks a slot: 2 * MG_SUB of one row, MG_SUB of two
    int rps;                                    // MG_BULK: rows a slot (nsl: slots; T[k]: slots of segment k)
};
static_assert(sizeof(SPh) == 176, "SPh");

// shared memory: [head 1024: group sums 128 floats] [SPh x MG_NPH]
// [union: activations | attention] [ring MG_WARPS x MG_S x MG_SLOT words]
constexpr int MG_XQ_BYTES = (MG_KMAX + 15) / 16 * 16;
constexpr int MG_ACT_BYTES = MG_XQ_BYTES + (MG_KMAX / 32) * 4 + (MG_KMAX / 16) * 4;
constexpr int MG_ATT_FLOATS = 4 * MG_G * 2 + 4 * MG_G * MG_HD;     // per group
constexpr int MG_ATT_BYTES = ATT_GROUPS * MG_ATT_FLOATS * 4;
constexpr int MG_UNION = ((MG_ACT_BYTES > MG_ATT_BYTES ? MG_ACT_BYTES : MG_ATT_BYTES) + 15) / 16 * 16;
constexpr int MG_HEAD = 1024;
constexpr int MG_TAB_OFF = MG_HEAD;
constexpr int MG_UNI_OFF = MG_TAB_OFF + MG_NPH * (int)sizeof(SPh);
constexpr int MG_RING_OFF = MG_UNI_OFF + MG_UNION;

// ---------------------------------------------------------------- weight types present
template <class F>
DEV void by_type(int ty, F&& f) {
#if MG_T2
    if (ty == 2) { f(IQ4_0{}); return; }
#endif
#if MG_T3
    if (ty == 3) { f(IQ4_1{}); return; }
#endif
#if MG_T6
    if (ty == 6) { f(IQ5_0{}); return; }
#endif
#if MG_T7
    if (ty == 7) { f(IQ5_1{}); return; }
#endif
#if MG_T8
    if (ty == 8) { f(IQ8_0{}); return; }
#endif
#if MG_T12
    if (ty == 12) { f(IQ4_K{}); return; }
#endif
#if MG_T13
    if (ty == 13) { f(IQ5_K{}); return; }
#endif
#if MG_T14
    if (ty == 14) { f(IQ6_K{}); return; }
#endif
}

DEV int type_bb(int ty) {                        // bytes a block
    switch (ty) {
        case 2: return 18;
        case 3: return 20;
        case 6: return 22;
        case 7: return 24;
        case 8: return 34;
        case 12: return 144;
        case 13: return 176;
        default: return 210;
    }
}
DEV int type_qk(int ty) { return ty >= 12 ? 256 : 32; }

// ---------------------------------------------------------------- a warp's slot stream
// The weight bytes a warp reads in one step, in order: for each matvec op, its tasks
// t = gw, gw + nw, ...: row t of the op's weights (in slots of 2 * MG_SUB chunks), or
// for gate/up row t of both (slots of MG_SUB chunks of each: one activation load, two rows).
struct MIt {
    int ph, t, j, type, nr;
    const u8* row0;
    const u8* row1;
};

DEV void it_row(MIt& it, const SPh* P) {
    const SPh& p = P[it.ph];
    if (p.kind == 2) {
        it.row0 = p.W[0] + (long long)it.t * p.rb[0];
        it.row1 = p.W[1] + (long long)it.t * p.rb[1];
        it.type = p.type[0];
        it.nr = 2;
    } else {
        int s = 0, u = it.t;
        while (s + 1 < p.nseg && u >= p.M[s]) { u -= p.M[s]; s++; }
        it.row0 = p.W[s] + (long long)u * p.rb[s];
        it.row1 = it.row0;
        it.type = p.type[s];
        it.nr = 1;
    }
}
DEV void it_skip(MIt& it, const SPh* P, int nph, int gw) {
    while (it.ph < nph && it.t >= P[it.ph].ntasks) { it.ph++; it.t = gw; }
    if (it.ph < nph) it_row(it, P);
}
DEV void it_begin(MIt& it, const SPh* P, int nph, int gw) {
    it.ph = 0; it.t = gw; it.j = 0;
    it_skip(it, P, nph, gw);
}
DEV void it_next(MIt& it, const SPh* P, int nph, int gw, int nw) {
    if (++it.j < P[it.ph].nsl) return;
    it.j = 0;
    it.t += nw;
    it_skip(it, P, nph, gw);
}
// the slot's bytes of a row starting at `row`: [s0, s0 + n)
DEV void it_span(const MIt& it, const SPh* P, const u8* row, long long& s0, int& n) {
    const int bb = type_bb(it.type), qk = type_qk(it.type), cps = P[it.ph].cps;
    const int c0 = it.j * cps;
    s0 = (long long)row + (long long)c0 * (MVS_CW / qk) * bb;
    n = min(cps * MVS_CW, P[it.ph].K - c0 * MVS_CW) / qk * bb;
}
// the slot into shared memory: per row, 16-byte words from the aligned address at or below s0
DEV void it_issue(const MIt& it, const SPh* P, uint4* slot, int lane) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (r < it.nr) {
            long long s0;
            int n;
            it_span(it, P, r ? it.row1 : it.row0, s0, n);
            const long long a0 = s0 & ~15LL;
            const int nv = (int)((s0 - a0 + n + 15) >> 4);
            for (int w = lane; w < nv; w += 32) cp_async16(slot + r * MG_RW + w, (const void*)(a0 + 16 * w), true);
        }
    }
}
DEV void it_prefetch(const MIt& it, const SPh* P, int lane) {
    for (int r = 0; r < it.nr; r++) {
        long long s0;
        int n;
        it_span(it, P, r ? it.row1 : it.row0, s0, n);
        const long long l0 = s0 & ~127LL;
        const int nl = (int)((s0 + n - 1 - l0) >> 7) + 1;
        for (int i = lane; i < nl; i += 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(l0 + 128 * i));
    }
}

// ---------------------------------------------------------------- grid barrier
// MG_PROF: stamps (thread 0's clock64) at entry, once the block is done, once all are
DEV void grid_sync(unsigned* cnt, int* err, long long* stamp) {
#if MG_PROF
    if (threadIdx.x == 0) stamp[0] = clock64();
#endif
    __syncthreads();
    if (threadIdx.x == 0) {
#if MG_PROF
        stamp[1] = clock64();
#endif
        __threadfence();
        atomicAdd(cnt, 1u);
        const long long t0 = clock64();
        unsigned v;
        int n = 0;
        while (true) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(cnt) : "memory");
            if (v >= gridDim.x) break;
            if (++n == 4096) {
                n = 0;
                if (*(volatile int*)err) break;
                if (clock64() - t0 > 4000000000LL) { atomicExch(err, 1); break; }
            }
        }
        __threadfence();
#if MG_PROF
        stamp[2] = clock64();
#endif
    }
    __syncthreads();
}

DEV void group_sync(int grp) { asm volatile("bar.sync %0, 128;" ::"r"(grp + 1) : "memory"); }
struct GroupSync {
    int grp;
    __device__ void operator()() const { group_sync(grp); }
};

// q of head `head0 + g`, dim d, rotated (RoPE over the whole head) from the raw q
struct MegaQ {
    const float* q;
    const float* cs;
    int neox;
    __device__ float operator()(int g, int d) const {
        const float* qh = q + g * MG_HD;
        int p, ia, ib;
        bool hi;
        if (neox) { hi = d >= MG_HD / 2; p = hi ? d - MG_HD / 2 : d; ia = p; ib = p + MG_HD / 2; }
        else { hi = d & 1; p = d >> 1; ia = 2 * p; ib = 2 * p + 1; }
        const float a = __ldcg(qh + ia), b = __ldcg(qh + ib), c = cs[2 * p], s = cs[2 * p + 1];
        return hi ? rope_hi(a, b, c, s) : rope_lo(a, b, c, s);
    }
};

// ---------------------------------------------------------------- activation rounding
// src (float32 [K], written by other blocks: read through L2) -> this block's xq/xd/xs,
// as q8_act<bs, act> computes them; all loads first (one trip to the L2)
DEV void mg_quant(const SPh& p, signed char* xq, float* xd, float* xs, float* gs) {
    const int K = p.K, ng = (K + 255) / 256;
    const float* src = p.src;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float v[QB][8], w[QB][8];
#pragma unroll
    for (int i = 0; i < QB; i++) {
        const int e = (warp + i * MG_WARPS) * 256 + lane * 8;
        if (e < K) {
            const float4 a = __ldcg((const float4*)(src + e)), b = __ldcg((const float4*)(src + e + 4));
            v[i][0] = a.x; v[i][1] = a.y; v[i][2] = a.z; v[i][3] = a.w;
            v[i][4] = b.x; v[i][5] = b.y; v[i][6] = b.z; v[i][7] = b.w;
            if (p.act == 1) {
                const float4 c = *(const float4*)(p.pw + e), d = *(const float4*)(p.pw + e + 4);
                w[i][0] = c.x; w[i][1] = c.y; w[i][2] = c.z; w[i][3] = c.w;
                w[i][4] = d.x; w[i][5] = d.y; w[i][6] = d.z; w[i][7] = d.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) v[i][k] = w[i][k] = 0.f;
        }
    }
    if (p.act == 1) {
#pragma unroll
        for (int i = 0; i < QB; i++) {
            const int g = warp + i * MG_WARPS;
            const float t = q8_bfly(q8_ss8(v[i]));
            if (lane == 0 && g < ng) gs[g] = t;
        }
        __syncthreads();
        const float rn = q8_rn(gs, ng, K, p.eps);
#pragma unroll
        for (int i = 0; i < QB; i++)
#pragma unroll
            for (int k = 0; k < 8; k++) v[i][k] = v[i][k] * rn * w[i][k];
    }
#pragma unroll
    for (int i = 0; i < QB; i++) {
        const int g = warp + i * MG_WARPS;
        if (g < ng) {
            const int e = g * 256 + lane * 8;
#if MG_BULK
            // straight into the bulk ring's transposed layout (Q8_0: blocks of 32)
            q8_store<32>(v[i], e < K, lane, e, xq, xd, xs, nullptr, K / 32);
#else
            if (p.bs == 256) q8_store<256>(v[i], e < K, lane, e, xq, xd, xs);
            else q8_store<32>(v[i], e < K, lane, e, xq, xd, xs);
#endif
        }
    }
    __syncthreads();
}

// a slot's parts of this lane (chunks c0 .. c0 + cps - 1 of the task's rows) into acc:
// each part's activations loaded once for the task's one or two rows
template <class T>
DEV void mg_slot(const MIt& it, int K, int cps, const u8* b0, const u8* b1, const signed char* xq,
                 const float* xd, const float* xs, float (&acc)[2], int lane) {
    const int nparts = K / T::QK * T::PPB;
    const int c0 = it.j * cps;
#pragma unroll
    for (int sc = 0; sc < 2 * MG_SUB; sc++) {
        const int gp = (c0 + sc) * 32 + lane;
        if constexpr (csum_v<T>) {                // chunk order: each chunk's butterfly, in order
            if (sc < cps && (c0 + sc) * 32 < nparts) {
                float p0[1] = {0.f}, p1[1] = {0.f};
                if (gp < nparts) {
                    const int off = (gp - c0 * (MVS_CW / T::QK)) * T::BB;
                    MvsX<T, 1> xc;
                    mvs_load_x<T, 1>(xc, xq, xd, xs, K, gp, 0);
                    mvs_dot<T, 1>(b0 + off, 0, xc, p0);
                    if (it.nr == 2) mvs_dot<T, 1>(b1 + off, 0, xc, p1);
                }
                acc[0] += q8_bfly_up(p0[0]);
                if (it.nr == 2) acc[1] += q8_bfly_up(p1[0]);
            }
        } else if (sc < cps && gp < nparts) {
            const int blk = gp / T::PPB, part = gp % T::PPB;
            const int off = (blk - c0 * (MVS_CW / T::QK)) * T::BB;
            MvsX<T, 1> xc;
            mvs_load_x<T, 1>(xc, xq, xd, xs, K, blk, part);
            float a0[1] = {acc[0]};
            mvs_dot<T, 1>(b0 + off, part, xc, a0);
            acc[0] = a0[0];
            if (it.nr == 2) {
                float a1[1] = {acc[1]};
                mvs_dot<T, 1>(b1 + off, part, xc, a1);
                acc[1] = a1[0];
            }
        }
    }
}

// the splits combined, attn_merge_head's sums in its order: 32 outputs (dims of one head)
// a block at a time, spread over the grid.  The block stages their splits' maxima, sums
// and weighted V in shared memory (sm: 34 floats a split) with every load in flight at
// once, one trip to the L2, where one thread an output would make two a group of splits;
// the last warp then finds the maximum and each split's factor a lane each, and adds the
// splits in order, a lane an output.
DEV void mg_merge(const float* part_m, const float* part_l, const float* part_acc, int n_splits, int kvh,
                  float* out, float* sm) {
    const int H = kvh * MG_G, nout = H * MG_HD, lane = threadIdx.x & 31;
    float* sl = sm;                               // [n_splits]
    float* smx = sm + n_splits;                   // [n_splits]: the split's max, then its factor
    float* sa = sm + 2 * n_splits;                // [n_splits][32]
    for (int o0 = blockIdx.x * 32; o0 < nout; o0 += gridDim.x * 32) {
        const int h = o0 / MG_HD, d0 = o0 % MG_HD, kh = h / MG_G, g = h % MG_G;
        const long long base = (long long)kh * n_splits;
        for (int i = threadIdx.x; i < n_splits * 34; i += blockDim.x) {
            const int sp = i / 34, k = i % 34;
            const long long pi = (base + sp) * MG_G + g;
            const float v = k < 32 ? __ldcg(part_acc + pi * MG_HD + d0 + k) : __ldcg((k == 32 ? part_l : part_m) + pi);
            if (k < 32) sa[sp * 32 + k] = v;
            else if (k == 32) sl[sp] = v;
            else smx[sp] = v;
        }
        __syncthreads();
        if (threadIdx.x >= blockDim.x - 32) {     // the last warp (warp 0 refills the ring)
            float mx = NEG_INF;
            for (int sp = lane; sp < n_splits; sp += 32)
                if (sl[sp] > 0.f) mx = fmaxf(mx, smx[sp]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            __syncwarp();
            for (int sp = lane; sp < n_splits; sp += 32)
                if (sl[sp] > 0.f) smx[sp] = expf(smx[sp] - mx);
            __syncwarp();
            float L = 0.f, A = 0.f;
            for (int sp = 0; sp < n_splits; ++sp) {
                const float lv = sl[sp];
                if (lv > 0.f) {
                    const float c = smx[sp];
                    L = fmaf(lv, c, L);
                    A = fmaf(sa[sp * 32 + lane], c, A);
                }
            }
            out[(long long)h * MG_HD + d0 + lane] = L > 0.f ? A / L : 0.f;
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(MG_WARPS * 32, 1) mega_decode(
        const MPhase* __restrict__ phases, int nph, const long long* __restrict__ kv, int L,
        const float* __restrict__ q, const float* __restrict__ kf, const float* __restrict__ vf, float* out,
        float* part_m, float* part_l, float* part_acc, float* cs, unsigned* cnt, int* err,
        const int* __restrict__ positions, const int* __restrict__ slots, const int* __restrict__ tables,
        const int* __restrict__ seq_of_token, int max_blocks, int block_size, int window, int n_splits, int neox,
        int kvh, const float* __restrict__ inv_freq, float attn_scale, float pos_scale, long long* prof_buf) {
    extern __shared__ __align__(16) unsigned char mg_smem[];
    float* gs = (float*)mg_smem;
    SPh* P = (SPh*)(mg_smem + MG_TAB_OFF);
    unsigned char* uni = mg_smem + MG_UNI_OFF;
    signed char* xq = (signed char*)uni;
    float* xd = (float*)(uni + MG_XQ_BYTES);
    float* xs = xd + MG_KMAX / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * MG_WARPS + warp, nw = gridDim.x * MG_WARPS;
#if !MG_BULK
    uint4* ring = (uint4*)(mg_smem + MG_RING_OFF) + warp * (MG_S * MG_SLOT);
#endif
    const int pos = positions[0];

    // the op table into shared memory
    {
        for (int i = threadIdx.x; i < nph; i += blockDim.x) {
            const MPhase& g = phases[i];
            SPh& s = P[i];
#pragma unroll
            for (int k = 0; k < 3; k++) {
                s.W[k] = (const u8*)g.seg[k].W;
                s.y[k] = (float*)g.seg[k].y;
                s.bias[k] = (const float*)g.seg[k].bias;
                s.rb[k] = (int)g.seg[k].row_bytes;
                s.M[k] = (int)g.seg[k].M;
                s.type[k] = (int)g.seg[k].type;
            }
            s.src = (const float*)g.src;
            s.pw = (const float*)g.pw;
            s.K = (int)g.K;
            s.ntasks = (int)g.ntasks;
            s.kind = (int)g.kind;
            s.nseg = (int)g.nseg;
            s.act = (int)g.act;
            s.bs = (int)g.bs;
            s.cps = s.kind == 2 ? MG_SUB : 2 * MG_SUB;
            s.nsl = ((int)g.K + s.cps * MVS_CW - 1) / (s.cps * MVS_CW);
#pragma unroll
            for (int k = 0; k < 3; k++) s.T[k] = s.M[k];
#if MG_BULK
            {   // whole rows a slot (gate/up: the same rows of both), each padded to whole chunks
                const int per = s.kind == 2 ? 2 : 1, rs = mb_stride(s.K / 32);
                s.rps = max(1, min(min(MG_SB / (per * rs * 34), MB_BLOCKS / (per * rs)), MB_ROWS));
                s.nsl = 0;
#pragma unroll
                for (int k = 0; k < 3; k++) {
                    s.T[k] = k < (s.kind == 2 ? 1 : s.nseg) ? (s.M[k] + s.rps - 1) / s.rps : 0;
                    s.nsl += s.T[k];
                }
            }
#endif
            s.eps = (float)g.eps;
        }
        __syncthreads();
    }

#if MG_BULK
    // The ring: MG_S slots of the block's share of each matvec op, in op order (op o's slots
    // s = blockIdx, + gridDim, ...), whole rows each, a row starting at a 32-block chunk
    // (gate/up: the rows of gate, then the same rows of up); thread 0 refills a slot as
    // soon as every thread has read it, across op boundaries and barriers (weights don't
    // wait for activations).  Sums in chunk order (qint8.cuh mvs_chunk): a half warp's
    // butterfly gives a chunk's sum; a row's chunk sums are added in order by a lane of the
    // last warp after the next slot's barrier, so one block-wide barrier a slot remains.
    __shared__ unsigned long long mb_full[MG_S];
    __shared__ int4 mb_desc[MG_S];                // a slot's segment, first row, rows
    __shared__ float mb_c[2][MB_CH];              // chunk sums, two slots
    uint4* bring = (uint4*)(mg_smem + MG_RING_OFF);
    __shared__ float mb_av[MB_AV];                // the op's addends of this block's rows (x of a residual add, the bias)
    // slot `slot` of op p (its slots are the op's segments' in order): segment, first row, rows
    auto locate = [&](const SPh& p, int slot, int& sg, int& r0, int& nr) {
        sg = 0;
        if (p.kind != 2) while (slot >= p.T[sg]) { slot -= p.T[sg]; ++sg; }
        r0 = slot * p.rps;
        nr = min(p.rps, p.M[sg] - r0);
    };
    int pph = 0, pslot = blockIdx.x, iss = 0;     // thread 0: the next slot to copy (op, slot); copies issued
    auto refill = [&](int upto) {                 // thread 0: slots issued up to `upto` (exclusive)
        while (iss < upto) {
            while (pph < nph && pslot >= P[pph].nsl) { ++pph; pslot = blockIdx.x; }
            if (pph == nph) return;
            const SPh& p = P[pph];
            int sg, r0, nr;
            locate(p, pslot, sg, r0, nr);
            const int buf = iss % MG_S, per = p.kind == 2 ? 2 : 1;
            char* dst = (char*)(bring + buf * (MG_SB / 16));
            const int rb = p.rb[sg], nb = p.K / 32, rs = mb_stride(nb) * 34;
            bulk_expect(mb_full + buf, (unsigned)(per * nr * rb));
            for (int h = 0; h < per; ++h) {       // gate/up: h 0 gate (seg 0), 1 up (seg 1)
                const u8* src = p.W[sg + h] + (long long)r0 * rb;
                if (rs == rb) bulk_load(dst + h * nr * rs, src, (unsigned)(nr * rb), mb_full + buf);
                else for (int i = 0; i < nr; ++i) bulk_load(dst + (h * nr + i) * rs, src + (long long)i * rb, (unsigned)rb, mb_full + buf);
            }
            mb_desc[buf] = make_int4(sg, r0, nr, 0);
            pslot += gridDim.x;
            ++iss;
        }
    };
    // thread 0: the n slots after the ring's asked of the L2 (where not asked already), so
    // the DRAM keeps streaming while the block waits at a barrier or walks the KV cache
    // beyond what the ring holds; their bulk copies then read the L2
    int qph = 0, qsl = blockIdx.x, qi = 0;        // the next slot to ask for, and its index
    auto l2_ahead = [&](int n) {
        if (qi < iss) { qph = pph; qsl = pslot; qi = iss; }
        while (qi < iss + n) {
            while (qph < nph && qsl >= P[qph].nsl) { ++qph; qsl = blockIdx.x; }
            if (qph == nph) return;
            const SPh& p = P[qph];
            int sg, r0, nr;
            locate(p, qsl, sg, r0, nr);
            for (int h = 0; h < (p.kind == 2 ? 2 : 1); ++h)
                bulk_prefetch_l2(p.W[sg + h] + (long long)r0 * p.rb[sg], (unsigned)(nr * p.rb[sg]));
            qsl += gridDim.x;
            ++qi;
        }
    };
    bulk_init(mb_full, MG_S);
    if (threadIdx.x == 0) refill(MG_S);
    int kc = 0;                                   // slots read so far
#else
    // the cursors: computed (ci), copied into the ring (ii, MG_S - 1 ahead), asked of the L2 (pi)
    MIt ci, ii, pi;
    it_begin(ci, P, nph, gw);
    ii = ci;
    pi = ci;
    int iseq = 0, pseq = 0;                       // slots issued / prefetched so far
#pragma unroll 1
    for (int k = 0; k < MG_S - 1; k++) {
        if (ii.ph < nph) { it_issue(ii, P, ring + k * MG_SLOT, lane); it_next(ii, P, nph, gw, nw); iseq++; }
        cp_async_commit();
    }
    int seq = 0;                                  // the slot computed next, in stream order
    // the slots after the ring's into L2, up to n ahead of it
    auto l2_ahead = [&](int n) {
        if (pseq < iseq) { pi = ii; pseq = iseq; }
        while (pseq < iseq + n && pi.ph < nph) { it_prefetch(pi, P, lane); it_next(pi, P, nph, gw, nw); pseq++; }
    };
#endif

    // the sequence's block table, fixed for the step: in shared memory where it fits, so a
    // warp's first key in attention costs one trip to memory, not three (the sequence, the
    // table entry, the row); read after the first barrier
    __shared__ int mg_tab[MG_TABN];
    const int* gtab = tables + (long long)seq_of_token[0] * max_blocks;
    for (int i = threadIdx.x; i < min(max_blocks, MG_TABN); i += blockDim.x) mg_tab[i] = gtab[i];
    const int* table = max_blocks <= MG_TABN ? (const int*)mg_tab : gtab;

    // this token's RoPE cos/sin (all layers share them): block 0, read after a barrier
    if (blockIdx.x == 0) {
        for (int p = threadIdx.x; p < MG_HD / 2; p += blockDim.x) {
            float c, s;
            rope_cs(pos, pos_scale, inv_freq[p], c, s);
            cs[2 * p] = c;
            cs[2 * p + 1] = s;
        }
    }

#if MG_BULK
    // the rows of slot `ks` (descriptor d, the block's ord-th slot of the op) finished: lane
    // rr of the last warp adds row rr's chunk sums in order (gate/up: both rows', then
    // silu(gate) * up) and writes it, plus its addend (x of a residual add, or the bias:
    // from mb_av, or past MB_AV `pav`, which the lane read a slot earlier)
    auto rows_out = [&](const SPh& p, int4 d, int ks, int ord, float pav) {
        if (MG_XROWS || warp != MG_WARPS - 1 || lane >= d.z) return;
        const int ai = ord * p.rps + lane;
        const float av = ai < MB_AV ? mb_av[ai] : pav;
        const float* c = mb_c[ks & 1];
        const int cr = mb_stride(p.K / 32) / 32, r = d.y + lane;
        float s0 = 0.f;
        for (int k = 0; k < cr; ++k) s0 += c[lane * cr + k];
        if (p.kind == 2) {
            float s1 = 0.f;
            for (int k = 0; k < cr; ++k) s1 += c[(d.z + lane) * cr + k];
            p.y[1][r] = silu_mul(s0, s1);
        } else {
            p.y[d.x][r] = p.kind == 1 ? av + s0 : (p.bias[d.x] ? s0 + av : s0);
        }
    };
    // one matvec op: round its input into shared memory, then this block's slots: a thread
    // MB_P Q8_0 block pairs of each (mvs_dot's products), a half warp's butterfly a chunk
    auto matvec = [&](int ph, long long* stamp) {
        const SPh& p = P[ph];
        // the addends of this block's rows of the op (slot o's row i at o rps + i), asked of
        // the L2 before the rounding's loads (one trip for both), kept from after it
        const bool add = p.kind == 1 || (p.kind == 0 && (p.bias[0] || p.bias[1] || p.bias[2]));
        auto addend = [&](int sg, int r) { return p.kind == 1 ? __ldcg(p.y[sg] + r) : (p.bias[sg] ? p.bias[sg][r] : 0.f); };
        const int nmine = (p.nsl - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
        float av0 = 0.f;
        if (!MG_XADD && add && (int)threadIdx.x < min(nmine * p.rps, MB_AV)) {
            int sg, r0, nr;
            locate(p, blockIdx.x + threadIdx.x / p.rps * gridDim.x, sg, r0, nr);
            const int i = threadIdx.x % p.rps;
            if (i < nr) av0 = addend(sg, r0 + i);
        }
        if (!MG_XQUANT) mg_quant(p, xq, xd, xs, gs);
        if (add) mb_av[threadIdx.x] = av0;        // read after the slot loop's first barrier
#if MG_PROF
        if (threadIdx.x == 0) stamp[3] = clock64();
#endif
        const int nb = p.K / 32, rs = mb_stride(nb), per = p.kind == 2 ? 2 : 1;
        int bj[MB_P];                             // block pair q = thread + 512 i: its first block's index in its row
#pragma unroll
        for (int i = 0; i < MB_P; i++) bj[i] = 2 * (threadIdx.x + i * MG_WARPS * 32) % rs;
        int4 pd = make_int4(0, 0, 0, 0);
        int pk = -1, pord = 0, ord = 0;           // the slot whose rows are still to be finished, its ordinal
        float pav = 0.f;                          // ... and this lane's addend for it, past MB_AV
#pragma unroll 1
        for (int sl = blockIdx.x; sl < p.nsl; sl += gridDim.x, ++kc) {
            const int buf = kc % MG_S;
#if MG_EARLY
            __syncthreads();                      // slot kc - 1 read and its chunk sums stored, by all
            if (threadIdx.x == 0) refill(kc + MG_S);   // its buffer refilled before waiting for slot kc
            bulk_wait(mb_full + buf, (kc / MG_S) & 1);
#else
            bulk_wait(mb_full + buf, (kc / MG_S) & 1);
            __syncthreads();                      // slot kc - 1 read and its chunk sums stored, by all
            if (threadIdx.x == 0) refill(kc + MG_S);
#endif
            if (pk >= 0) rows_out(p, pd, pk, pord, pav);
            const int4 d = mb_desc[buf];
            const int nblk = per * d.z * rs;      // the slot's blocks, padding included (whole chunks)
            // this slot's addends, asked of the L2 now and used a slot later (latency hidden):
            // x of a residual add (written before the last grid barrier), or the bias
            if (!MG_XADD && add && warp == MG_WARPS - 1 && lane < d.z && ord * p.rps + lane >= MB_AV)
                pav = addend(d.x, d.y + lane);
            const unsigned* sw = (const unsigned*)(bring + buf * (MG_SB / 16));
            // a thread a pair of blocks (68 bytes: 17 aligned words, lane l at bank 17 l: no
            // conflict); word u of both blocks' inputs by one 8-byte load (transposed input)
            const int* xt = (const int*)xq;
#pragma unroll
            for (int i = 0; i < MB_P; i++) {
                const int q = threadIdx.x + i * MG_WARPS * 32;
                float v = 0.f;
                if (2 * q < nblk && bj[i] < nb) {
                    const unsigned* W = sw + 17 * q;
                    unsigned w[17];
#pragma unroll
                    for (int u = 0; u < 17; u++) w[u] = W[u];
                    int s00 = 0, s01 = 0, s10 = 0, s11 = 0;     // block (0: 2q, 1: 2q + 1), run of 16
#pragma unroll
                    for (int u = 0; u < 8; u++) {
                        const int2 x = *(const int2*)(xt + u * nb + bj[i]);
                        const int a = (int)__funnelshift_r(w[u], w[u + 1], 16);   // block 2q's bytes from 2
                        if (u < 4) { s00 = __dp4a(a, x.x, s00); s10 = __dp4a((int)w[9 + u], x.y, s10); }
                        else { s01 = __dp4a(a, x.x, s01); s11 = __dp4a((int)w[9 + u], x.y, s11); }
                    }
                    const float d0 = __half2float(__ushort_as_half((unsigned short)(w[0] & 0xFFFFu)));
                    const float d1 = __half2float(__ushort_as_half((unsigned short)(w[8] >> 16)));
                    const float2 xs2 = *(const float2*)(xd + bj[i]);
                    // mvs_dot's product of each block, then q8_bfly_up's first stage (blocks 2q, 2q + 1)
                    v = fmaf(fmaf(d0, (float)s01, fmaf(d0, (float)s00, 0.f)), xs2.x, 0.f) +
                        fmaf(fmaf(d1, (float)s11, fmaf(d1, (float)s10, 0.f)), xs2.y, 0.f);
                }
#pragma unroll
                for (int o = 1; o < 16; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);   // its other stages
                if ((lane & 15) == 0 && 2 * q < nblk) mb_c[kc & 1][q >> 4] = v;
            }
            pd = d;
            pk = kc;
            pord = ord++;
        }
        __syncthreads();                          // the last slot's chunk sums stored
        if (threadIdx.x == 0) refill(kc + MG_S);  // its buffer refilled now: the ring full across the barrier
        if (pk >= 0) rows_out(p, pd, pk, pord, pav);   // (the next barrier orders these writes)
    };
#else
    // one matvec op: round its input into shared memory, then this warp's tasks
    auto matvec = [&](int ph, long long* stamp) {
        const SPh& p = P[ph];
        mg_quant(p, xq, xd, xs, gs);
#if MG_PROF
        if (threadIdx.x == 0) stamp[3] = clock64();
#endif
        const int kind = p.kind;
#pragma unroll 1
        for (int t = gw; t < p.ntasks; t += nw) {
            float acc[2] = {0.f, 0.f};
            bool summed = false;
#pragma unroll 1
            for (int j = 0; j < p.nsl; j++) {
                __syncwarp();
                if (ii.ph < nph) {
                    it_issue(ii, P, ring + ((seq + MG_S - 1) % MG_S) * MG_SLOT, lane);
                    it_next(ii, P, nph, gw, nw);
                    iseq++;
                }
                cp_async_commit();
                cp_async_wait<MG_S - 1>();
                __syncwarp();
                long long s0, s1;
                int n;
                it_span(ci, P, ci.row0, s0, n);
                it_span(ci, P, ci.row1, s1, n);
                const u8* slot = (const u8*)(ring + (seq % MG_S) * MG_SLOT);
                const u8* b0 = slot + (int)(s0 & 15);
                const u8* b1 = slot + MG_RW * 16 + (int)(s1 & 15);
                by_type(ci.type, [&](auto tag) {
                    summed = csum_v<decltype(tag)>;
                    mg_slot<decltype(tag)>(ci, p.K, p.cps, b0, b1, xq, xd, xs, acc, lane);
                });
                seq++;
                it_next(ci, P, nph, gw, nw);
            }
            // mvs_store's butterfly (lane order), or the sums already whole (chunk order)
            const float v0 = summed ? acc[0] : q8_bfly(acc[0]);
            const float v1 = kind == 2 ? (summed ? acc[1] : q8_bfly(acc[1])) : 0.f;
            if (lane == 0) {
                if (kind == 2) {
                    p.y[1][t] = silu_mul(v0, v1);
                } else {
                    int s = 0, r = t;
                    while (s + 1 < p.nseg && r >= p.M[s]) { r -= p.M[s]; s++; }
                    float* y = p.y[s];
                    if (kind == 0) {
                        const float* bias = p.bias[s];
                        y[r] = bias ? v0 + bias[r] : v0;
                    } else {
                        y[r] = __ldcg(y + r) + v0;
                    }
                }
            }
        }
    };

#endif

    // attention of layer l: splits by 4-warp groups (partials; the merge is an op of its own)
    auto attention = [&](int l) {
        const int grp = warp >> 2, tid = threadIdx.x & 127;
        float* sm = (float*)uni + grp * MG_ATT_FLOATS;
        __half* kc = (__half*)kv[2 * l];
        __half* vc = (__half*)kv[2 * l + 1];
        const int nvg = n_splits * kvh;
#pragma unroll 1
        for (int vb = blockIdx.x * ATT_GROUPS + grp; vb < nvg; vb += gridDim.x * ATT_GROUPS) {
            const int sp = vb % n_splits, kh = vb / n_splits;
            int j0, j1;
            split_keys(pos, window, sp, n_splits, j0, j1);
            if (j0 <= pos && pos < j1) {          // this split holds the new token: its K/V first
                const long long dst = ((long long)slots[0] * kvh + kh) * MG_HD;
                for (int d = tid; d < MG_HD; d += 128) {
                    int p, ia, ib;
                    bool hi;
                    if (neox) { hi = d >= MG_HD / 2; p = hi ? d - MG_HD / 2 : d; ia = p; ib = p + MG_HD / 2; }
                    else { hi = d & 1; p = d >> 1; ia = 2 * p; ib = 2 * p + 1; }
                    const float* kr = kf + kh * MG_HD;
                    const float a = __ldcg(kr + ia), b = __ldcg(kr + ib), c = cs[2 * p], s = cs[2 * p + 1];
                    kc[dst + d] = __float2half_rn(hi ? rope_hi(a, b, c, s) : rope_lo(a, b, c, s));
                    vc[dst + d] = __float2half_rn(__ldcg(vf + kh * MG_HD + d));
                }
                group_sync(grp);
            }
            const MegaQ qf{q + (long long)kh * MG_G * MG_HD, cs, neox};
            attn_split<MG_HD, MG_G, 4>(qf, GroupSync{grp}, kc, vc, table, j0, j1, block_size, kvh, kh, 0, sp,
                                       n_splits, attn_scale, sm, sm + 4 * MG_G, sm + 8 * MG_G, tid,
                                       part_m, part_l, part_acc, out);
            group_sync(grp);
        }
    };

    // ops in order: per layer q/k/v, attention, merge, o, gate/up, down; then the logits;
    // a grid barrier before each but the first (one loop: each op's code once)
#if MG_PROF
    long long* prof = prof_buf + (long long)blockIdx.x * (MG_OPS * L + 1) * 4;
    if (threadIdx.x == 0) prof[2] = clock64();   // op 0 starts here
#else
    long long* prof = nullptr;
#endif
#pragma unroll 1
    for (int st = 0; st <= MG_OPS * L; st++) {
        long long* stamp = prof ? prof + 4 * st : nullptr;
        const int l = st / MG_OPS, op = st % MG_OPS;
        if (st > 0) {
#if MG_BULK
            if (threadIdx.x == 0 && (op == 1 ? MG_PFA : MG_PFB) > 0) l2_ahead(op == 1 ? MG_PFA : MG_PFB);
#else
            l2_ahead(op == 1 ? MG_PFA : MG_PFB);
#endif
            grid_sync(cnt + st - 1, err, stamp);
        }
        if (st == MG_OPS * L) matvec(4 * L, stamp);
        else if (op == 0) matvec(4 * l, stamp);
        else if (op == 1) { if (!MG_XATT) attention(l); }
        else if (op == 2) { if (n_splits > 1 && !MG_XATT && !MG_XMERGE) mg_merge(part_m, part_l, part_acc, n_splits, kvh, out, (float*)uni); }
        else matvec(4 * l + op - 2, stamp);
    }
#if MG_PROF
    __syncthreads();
    if (threadIdx.x == 0) prof_buf[(long long)gridDim.x * (MG_OPS * L + 1) * 4 + blockIdx.x] = clock64();
#endif
#if !MG_BULK
    cp_async_wait<0>();
#endif
}
