// The non-matmul ops of a transformer step on the GPU (the matmuls are in quant/cuda).
// Plain CUDA C for sm_75 and newer; float32 activations, fp16 KV cache.
#include "cuda_attn.cuh"
#include "pdl.cuh"

// out[r] = x[r] / rms(x[r]) * w; one block per row (rows may be heads)
ADEV void rmsnorm_row(const float* __restrict__ xr, const float* __restrict__ w, float eps, float* __restrict__ o,
                     int D) {
    __shared__ float red[32];
    float ss = 0.f;
    for (int j = threadIdx.x; j < D; j += blockDim.x) ss = fmaf(xr[j], xr[j], ss);
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    const float r = 1.0f / sqrtf(red[0] / D + eps);
    for (int j = threadIdx.x; j < D; j += blockDim.x) o[j] = xr[j] * r * w[j];
}

extern "C" __global__ void rmsnorm(const float* __restrict__ x, const float* __restrict__ w, float eps,
                                   float* __restrict__ out, int D) {
    PDL_ENTER();
    rmsnorm_row(x + (long long)blockIdx.x * D, w, eps, out + (long long)blockIdx.x * D, D);
}

// two RMSNorms of one width in one launch (Qwen3's and Gemma 3's q and k heads): blocks below
// rows1 take x1's rows, the rest x2's; each row's operations are rmsnorm's
extern "C" __global__ void rmsnorm2(const float* __restrict__ x1, const float* __restrict__ w1, float* __restrict__ out1,
                                    int rows1, const float* __restrict__ x2, const float* __restrict__ w2,
                                    float* __restrict__ out2, float eps, int D) {
    PDL_ENTER();
    const bool first = (int)blockIdx.x < rows1;
    const long long r = first ? blockIdx.x : blockIdx.x - rows1;
    rmsnorm_row((first ? x1 : x2) + r * D, first ? w1 : w2, eps, (first ? out1 : out2) + r * D, D);
}

// rotate x [N, H, D] in place by each token's position; angles in double, as the CPU does;
// cos and sin times mscale (YaRN's / LongRoPE's magnitude, 1 for plain RoPE)
extern "C" __global__ void rope(float* x, const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                int N, int H, int D, int half, int neox, float pos_scale, float mscale) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * H * half) return;
    const int k = (int)(i % half);
    const int hh = (int)((i / half) % H);
    const int t = (int)(i / ((long long)half * H));
    float c, s;
    rope_cs(positions[t], pos_scale, inv_freq[k], c, s);
    c *= mscale;
    s *= mscale;
    float* xr = x + ((long long)t * H + hh) * D;
    const int ia = neox ? k : 2 * k, ib = neox ? k + half : 2 * k + 1;
    const float a = xr[ia], b = xr[ib];
    xr[ia] = rope_lo(a, b, c, s);
    xr[ib] = rope_hi(a, b, c, s);
}

extern "C" __global__ void silu_mul(float* g, const float* __restrict__ u, long long n) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { float v = g[i]; g[i] = v / (1.0f + expf(-v)) * u[i]; }
}

extern "C" __global__ void gelu_mul(float* g, const float* __restrict__ u, long long n) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float c = 0.7978845608028654f;
        float v = g[i];
        g[i] = 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v))) * u[i];
    }
}

// gpt-oss's experts: g = (clamp(u, -7, 7) + 1) * v * sigmoid(1.702 v), v = min(g, 7) (the CPU's
// swiglu_oai_mul; llama.cpp's swiglu_oai with its fixed alpha and limit)
extern "C" __global__ void swiglu_oai_mul(float* g, const float* __restrict__ u, long long n) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = fminf(g[i], 7.f), w = fminf(fmaxf(u[i], -7.f), 7.f);
    g[i] = (w + 1.f) * (v / (1.f + expf(-1.702f * v)));
}

// y[p, c] += bias[ids[p], c]: an expert's bias by the (row, slot) pair's expert id (gpt-oss's
// experts routed on the device).  One add after the matvec's store, as the host-routed path's
// matvec adds it in its store (mine + bias[m]): the same bits.
extern "C" __global__ void add_bias_ids(float* y, const float* __restrict__ bias, const int* __restrict__ ids,
                                        int M, long long n) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long p = i / M;
    y[i] += bias[(long long)ids[p] * M + (i - p * M)];
}

extern "C" __global__ void add_inplace(float* x, const float* __restrict__ y, long long n) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// out[i, :] = x[idx[i], :]
extern "C" __global__ void gather_rows(const float* __restrict__ x, const int* __restrict__ idx, int n, int D,
                                       float* __restrict__ out) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * D) return;
    const int r = (int)(i / D), j = (int)(i % D);
    out[i] = x[(long long)idx[r] * D + j];
}

// the new tokens' K and V (float32 [N, KVH*D]) into the fp16 pools at their slots
extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v,
                                    __half* kp, __half* vp, const int* __restrict__ slots, int N, int row) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * row) return;
    const int t = (int)(i / row), j = (int)(i % row);
    const long long dst = (long long)slots[t] * row + j;
    kp[dst] = __float2half_rn(k[i]);
    vp[dst] = __float2half_rn(v[i]);
}

// the new tokens' K (fp16) and V (q8_0: int8 values, an fp16 scale per 32) at their
// slots, for the k16v8 cache: one thread per value, a warp per block of 32 (row % 32 == 0,
// so a warp is all live or all past the end).  The CPU's rounding (kv_write): scale
// amax / 127, value x * (1 / scale) rounded half away from zero.
extern "C" __global__ void kv_write_v8(const float* __restrict__ k, const float* __restrict__ v,
                                       __half* kp, signed char* vq, __half* vs, const int* __restrict__ slots,
                                       int N, int row) {
    PDL_ENTER();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)N * row) return;
    const int t = (int)(i / row), j = (int)(i % row);
    const long long dst = (long long)slots[t] * row + j;
    kp[dst] = __float2half_rn(k[i]);
    const float x = v[i];
    float amax = fabsf(x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = __fdiv_rn(amax, 127.f);
    const float inv = d > 0.f ? __fdiv_rn(1.f, d) : 0.f;
    const float y = __fmul_rn(x, inv);
    vq[dst] = (signed char)(y >= 0.f ? (int)__fadd_rn(y, 0.5f) : -(int)__fsub_rn(0.5f, y));
    if ((threadIdx.x & 31) == 0) vs[dst / 32] = __float2half_rn(d);
}

#ifndef ATT_HD
#define ATT_HD 128
#endif
// ATT_V8: the V pool is q8_0 (the k16v8 cache; cuda_attn.cuh's V8): the attention kernels
// take its values and scales as two arguments where an f16 pool is one
#ifdef ATT_V8
#define V_PARAMS const signed char* __restrict__ vq, const __half* __restrict__ vs
#define V_POOL (V8{vq, vs})
#else
#define V_PARAMS const __half* __restrict__ vp
#define V_POOL vp
#endif
#ifndef ATT_G
#define ATT_G 4
#endif
#define ATT_WARPS 4
#ifndef ATT_PF
#define ATT_PF 2                              // keys a warp has in flight (attn_split_from)
#endif

// Paged attention (see attn_split in cuda_attn.cuh): block (split sp, kv head kh,
// token t), ATT_WARPS warps.  Token t at position pos attends to cache positions
// max(0, pos-window+1)..pos, split into n_splits equal ranges.
struct BlockSync {
    __device__ void operator()() const { __syncthreads(); }
};
struct QMem {                                 // q as stored (already rotated)
    const float* q;
    __device__ float operator()(int g, int d) const { return q[g * ATT_HD + d]; }
};

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attention(
        const float* __restrict__ q, const __half* __restrict__ kp, V_PARAMS,
        const int* __restrict__ tables, int max_blocks, const int* __restrict__ seq_of_token,
        const int* __restrict__ positions, int block_size, int window, float scale, int n_splits, int kvh,
        float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
        float* __restrict__ out, const float* __restrict__ sinks) {
    __shared__ float sm_m[ATT_WARPS * ATT_G], sm_l[ATT_WARPS * ATT_G];
    __shared__ float sm_acc[ATT_WARPS * ATT_G * ATT_HD];
    const int sp = blockIdx.x, kh = blockIdx.y, t = blockIdx.z;
    const int pos = positions[t];
    int j0, j1;
    split_keys(pos, window, sp, n_splits, j0, j1);
    const int* table = tables + (long long)seq_of_token[t] * max_blocks;
    // The step's inputs (positions, tables) and the K/V rows of positions before the
    // step's first new token (an earlier step wrote them; a sequence has at most
    // gridDim.z new tokens) are read before the wait (pdl.cuh): the table walk and the
    // warp's first key overlap the kernel ahead.
    const int jf = j0 + (threadIdx.x >> 5);
    float kn[ATT_HD / 32], vn[ATT_HD / 32];
    const bool early = jf < j1 && jf <= pos - (int)gridDim.z;
    const auto vpool = V_POOL;
    if (early) attn_key<ATT_HD>(kp, vpool, table, jf, block_size, kvh, kh, threadIdx.x & 31, kn, vn);
    PDL_ENTER();
    if (!early && jf < j1) attn_key<ATT_HD>(kp, vpool, table, jf, block_size, kvh, kh, threadIdx.x & 31, kn, vn);
    const QMem qf{q + ((long long)t * kvh * ATT_G + kh * ATT_G) * ATT_HD};
    attn_split_from<ATT_HD, ATT_G, ATT_WARPS, ATT_PF>(qf, BlockSync{}, kp, vpool, table, j0, j1, block_size, kvh, kh, t, sp,
                                              n_splits, scale, sm_m, sm_l, sm_acc, threadIdx.x, part_m, part_l,
                                              part_acc, out, kn, vn, sinks);
}

// Decode attention by key tiles: the same grid, arguments and partial results as
// `attention` (block: split sp, kv head kh, token t; 4 warps), for long contexts.  A
// split's keys come in tiles of DEC_BK, gathered by all 128 threads at once (K
// transposed into shared memory, V as rows: attn_prefill's layout), so a block has a
// whole tile of loads in flight instead of a warp's few keys.  A warp takes query heads
// warp, warp + 4, ... of the kv head: lane j scores key j of the tile (HD FMAs in eight
// chains), one max and one sum over the lanes a tile, then the lanes add p_j V_j into
// their dims.  `attention` spends a warp butterfly per key and head instead, which at
// 8000 keys took ~50 us a layer (L8).  Sums in another order than `attention`'s: the
// backend picks one kernel per context width (never per row count), so a verify row
// still equals its one-token step.
#define DEC_BK 32
extern "C" __global__ void __launch_bounds__(128) attn_tiles(
        const float* __restrict__ q, const __half* __restrict__ kp, V_PARAMS,
        const int* __restrict__ tables, int max_blocks, const int* __restrict__ seq_of_token,
        const int* __restrict__ positions, int block_size, int window, float scale, int n_splits, int kvh,
        float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
        float* __restrict__ out, const float* __restrict__ sinks) {
    constexpr int HD = ATT_HD, G = ATT_G, BK = DEC_BK, NW = 4;
    constexpr int DP2 = HD / 64, RW = (G + NW - 1) / NW;
    static_assert(HD % 64 == 0, "head dim a multiple of 64");
    __shared__ __align__(16) float sq[G][HD];
    __shared__ __half2 skt[HD / 2][BK + 1];
    __shared__ __align__(16) __half2 sv[BK][HD / 2];
    const int sp = blockIdx.x, kh = blockIdx.y, t = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int H = kvh * G;
    const int pos = positions[t];
    int j0, j1;
    split_keys(pos, window, sp, n_splits, j0, j1);
    const int* table = tables + (long long)seq_of_token[t] * max_blocks;
    // a thread's NCH 16-byte pieces of a tile's K and V rows; the next tile's are loaded
    // into registers while this one is computed (H200 at 8000 tokens of context: L8 -3.7%,
    // Q15 -2.4% against loading each tile at its turn; at 2048, one tile a split, +0.4% and
    // +3.2%; the same sums either way)
    constexpr int NCH = BK * (HD / 8) / 128;
    static_assert(BK * (HD / 8) % 128 == 0, "whole pieces a thread");
    uint4 kr[NCH], vr[NCH];
    const auto vpool = V_POOL;
    auto fetch = [&](int jt) {
#pragma unroll
        for (int c = 0; c < NCH; c++) {
            const int e = threadIdx.x + 128 * c, jj = e / (HD / 8), cc = (e % (HD / 8)) * 8;
            kv_piece<HD>(kp, vpool, table, jt + jj, j1, block_size, kvh, kh, cc, kr[c], vr[c]);
        }
    };
    // the first tile's keys before the wait when an earlier step wrote them all (pdl.cuh;
    // a sequence has at most gridDim.z new tokens): its loads overlap the kernel ahead
    const bool early = j0 < j1 && min(j1, j0 + BK) - 1 <= pos - (int)gridDim.z;
    if (early) fetch(j0);
    PDL_ENTER();
    for (int e = threadIdx.x; e < G * HD; e += 128)
        sq[e / HD][e % HD] = q[((long long)t * H + kh * G + e / HD) * HD + e % HD] * scale;
    float acc[RW][2 * DP2], m[RW], l[RW];
    rows_empty(acc, m, l);
    if (j0 < j1 && !early) fetch(j0);
    for (int jt = j0; jt < j1; jt += BK) {
        __syncthreads();                      // the previous tile is used up (and sq written)
#pragma unroll
        for (int c = 0; c < NCH; c++) {
            const int e = threadIdx.x + 128 * c, jj = e / (HD / 8), cc = (e % (HD / 8)) * 8;
            *(uint4*)&sv[jj][cc / 2] = vr[c];
            const __half2* k2 = (const __half2*)&kr[c];
#pragma unroll
            for (int i = 0; i < 4; i++) skt[cc / 2 + i][jj] = k2[i];
        }
        if (jt + BK < j1) fetch(jt + BK);
        __syncthreads();
        const bool valid = jt + lane < j1;
#pragma unroll
        for (int i = 0; i < RW; i++) {
            const int r = warp + NW * i;
            if (r >= G) break;
            tile_row<HD, BK>(sq[r], skt, sv, lane, valid, m[i], l[i], acc[i]);   // lane 0's key counts: true
        }
    }
#pragma unroll
    for (int i = 0; i < RW; i++) {
        const int r = warp + NW * i;
        if (r >= G) continue;
        if (n_splits == 1) {
            float* o = out + ((long long)t * H + kh * G + r) * HD;
            const float inv = sinks ? sink_inv(l[i], m[i], sinks, kh * G + r) : (l[i] > 0.f ? 1.f / l[i] : 0.f);
#pragma unroll
            for (int k = 0; k < DP2; k++)
                *(float2*)&o[2 * (lane + 32 * k)] = make_float2(acc[i][2 * k] * inv, acc[i][2 * k + 1] * inv);
        } else {
            const long long pi = ((long long)(t * kvh + kh) * n_splits + sp) * G + r;
#pragma unroll
            for (int k = 0; k < DP2; k++)
                *(float2*)&part_acc[pi * HD + 2 * (lane + 32 * k)] = make_float2(acc[i][2 * k], acc[i][2 * k + 1]);
            if (lane == 0) { part_m[pi] = m[i]; part_l[pi] = l[i]; }
        }
    }
}

// Prompt attention (steps of more than 16 tokens of one sequence at consecutive
// positions): block (query tile, kv head kh) of PRE_PQ tokens x G query heads, 4 warps.
// Each tile of 32 keys is gathered from the paged cache once for all of the block's
// rows, K transposed into shared memory (lane j reads key j's dims: no bank
// conflicts), V as rows.  A warp takes rows warp, warp + 4, ...: lane j scores key j
// against the row's query (read from shared memory, the same address for all lanes),
// the row's online softmax takes the tile's max and sum over the lanes, and the lanes
// then add p_j V_j into their HD/32 dims, p_j shuffled from lane j.  No N x N matrix:
// per row a running (max, sum, HD sums).  The decode kernel above walked every key
// of every token with a warp butterfly a key and head (~5 TFLOP/s at 512 tokens).
// Not batch-invariant with the decode kernel (sums in another order): steps of up to
// 16 tokens (decode, speculative verify) keep that one.
#define PRE_BK 32
#ifndef PRE_PQ
#define PRE_PQ 8                              // tokens a block: the backend compiles in _prefill_pq(HD, G)
#endif
extern "C" __global__ void __launch_bounds__(128) attn_prefill(
        const float* __restrict__ q, const __half* __restrict__ kp, V_PARAMS,
        const int* __restrict__ tables, int max_blocks, const int* __restrict__ seq_of_token,
        const int* __restrict__ positions, int n, int block_size, int window, float scale, int kvh,
        float* __restrict__ out, const float* __restrict__ sinks) {
    constexpr int HD = ATT_HD, G = ATT_G, PQ = PRE_PQ, ROWS = PQ * G, BK = PRE_BK, NW = 4;
    constexpr int DP2 = HD / 64, RW = (ROWS + NW - 1) / NW;     // a lane's dims: DP2 pairs
    static_assert(HD % 64 == 0, "head dim a multiple of 64");
    __shared__ __align__(16) float sq[ROWS][HD];
    __shared__ __half2 skt[HD / 2][BK + 1];    // K transposed, dims in pairs: lane j reads key j
    __shared__ __align__(16) __half2 sv[BK][HD / 2];
    PDL_ENTER();
    // the last query tiles attend to the most keys: they go out first
    const int t0 = (gridDim.x - 1 - blockIdx.x) * PQ, kh = blockIdx.y;
    const int nq = min(PQ, n - t0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int H = kvh * G;
    const int p0 = positions[t0], plast = p0 + nq - 1;
    const int* table = tables + (long long)seq_of_token[t0] * max_blocks;
    for (int e = threadIdx.x; e < ROWS * HD; e += 128) {
        const int r = e / HD, d = e % HD, tq = r / G;
        sq[r][d] = tq < nq ? q[((long long)(t0 + tq) * H + kh * G + r % G) * HD + d] * scale : 0.f;
    }
    float acc[RW][2 * DP2], m[RW], l[RW];
    rows_empty(acc, m, l);
    const int lo = window_lo(p0, window);
    for (int j0 = lo; j0 <= plast; j0 += BK) {
        __syncthreads();                      // the previous tile is used up (and sq written)
        for (int e = threadIdx.x; e < BK * (HD / 8); e += 128) {
            const int jj = e / (HD / 8), c = (e % (HD / 8)) * 8;
            uint4 kv4, vv4;
            kv_piece<HD>(kp, V_POOL, table, j0 + jj, plast + 1, block_size, kvh, kh, c, kv4, vv4);
            *(uint4*)&sv[jj][c / 2] = vv4;
            const __half2* k2 = (const __half2*)&kv4;
#pragma unroll
            for (int i = 0; i < 4; i++) skt[c / 2 + i][jj] = k2[i];
        }
        __syncthreads();
        const int j = j0 + lane;
#pragma unroll
        for (int i = 0; i < RW; i++) {
            const int r = warp + NW * i;
            if (r >= ROWS) break;
            const int tq = r / G, pr = p0 + tq;
            const int lr = window_lo(pr, window);
            const bool valid = tq < nq && j <= pr && j >= lr;
            tile_row<HD, BK>(sq[r], skt, sv, lane, valid, m[i], l[i], acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < RW; i++) {
        const int r = warp + NW * i;
        if (r >= ROWS || r / G >= nq) continue;
        float* o = out + ((long long)(t0 + r / G) * H + kh * G + r % G) * HD;
        const float inv = sinks ? sink_inv(l[i], m[i], sinks, kh * G + r % G) : (l[i] > 0.f ? 1.f / l[i] : 0.f);
#pragma unroll
        for (int k = 0; k < DP2; k++)
            *(float2*)&o[2 * (lane + 32 * k)] = make_float2(acc[i][2 * k] * inv, acc[i][2 * k + 1] * inv);
    }
}

// Prompt attention on the tensor cores (head dims 64 and 128; the kernel above takes the
// rest): mma.sync m16n8k8 (fp16 operands, fp32 sums; sm_75 and newer), FlashAttention-2's
// layout.  Block (query tile, kv head kh): 64 rows (MMA_PQ tokens x the G query heads
// of kh), 16 a warp; tiles of 32 keys gathered from the paged cache into shared memory
// once for the block (K as rows, V transposed, both padded against bank conflicts).
// Per tile a warp's S = Q K^T (16 x 32) stays in the accumulator registers, its
// online softmax runs there (a row's values on 4 lanes), and P, rounded to fp16, is
// the A operand of P V as it lies (the accumulator's layout is the A fragment's).  Q is
// rounded to fp16 once, pre-scaled by scale * log2(e) (exp2 in the softmax): the
// prompt's GEMMs take fp16 operands too.  Rows of different tokens see different keys
// (causal, windows) by masking; a warp skips tiles past its last row's position.
// gridDim.z > 1 splits each block's key tiles into that many shares (a chunk of few query
// tiles and KV heads would leave SMs idle): each share writes (max, sum, unnormalized
// output) per row for attn_merge, in decode's layout, instead of the output.
#define MMA_BK 32
__device__ __forceinline__ unsigned pack_h2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *(unsigned*)&h;
}
__device__ __forceinline__ void mma_m16n8k8(float (&c)[4], const unsigned (&a)[2], unsigned b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b));
}

template <int HD, int G, class VPool>
ADEV void attn_prefill_mma_body(const float* __restrict__ q, const __half* __restrict__ kp,
                                VPool vp, const int* __restrict__ tables, int max_blocks,
                                const int* __restrict__ seq_of_token, const int* __restrict__ positions, int n,
                                int block_size, int window, float scale, int kvh, float* __restrict__ out,
                                float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
                                const float* __restrict__ sinks) {
    constexpr int NW = 4, PQ = 16 * NW / G, ROWS = PQ * G, BK = MMA_BK;
    constexpr int KS = HD / 8, NT = BK / 8, ND = HD / 8, KP = HD + 8, VP = BK + 8;
    __shared__ __align__(16) __half sk[BK][KP];
    __shared__ __align__(16) __half svt[HD][VP];
    PDL_ENTER();
    const int t0 = (gridDim.x - 1 - blockIdx.x) * PQ, kh = blockIdx.y;
    const int nq = min(PQ, n - t0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gi = lane >> 2, ti = lane & 3;
    const int H = kvh * G;
    const int p0 = positions[t0], plast = p0 + nq - 1;
    const int* table = tables + (long long)seq_of_token[t0] * max_blocks;
    // this lane's rows of the warp's 16: gi and gi + 8
    int rr[2], pr[2], lo[2];
    bool ok[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        rr[h] = warp * 16 + gi + 8 * h;
        ok[h] = rr[h] < ROWS && rr[h] / G < nq;
        pr[h] = p0 + rr[h] / G;
        lo[h] = window_lo(pr[h], window);
    }
    const int wlast = min(warp * 16 + 15, ROWS - 1) / G;              // the warp's last token
    const int pmax = p0 + min(wlast, nq - 1);
    const bool active = warp * 16 < ROWS && warp * 16 / G < nq;
    unsigned qa[KS][2];
    const float qs = scale * 1.4426950408889634f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float* qr = q + ((long long)(t0 + rr[h] / G) * H + kh * G + rr[h] % G) * HD + 2 * ti;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const float2 v = ok[h] ? *(const float2*)(qr + 8 * ks) : make_float2(0.f, 0.f);
            qa[ks][h] = pack_h2(v.x * qs, v.y * qs);
        }
    }
    float o[ND][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int nd = 0; nd < ND; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
    // key split blockIdx.z of gridDim.z: a share of the block's key tiles (prompts with
    // few KV heads have few query tiles; the splits give the GPU enough blocks)
    const int jlo = window_lo(p0, window);
    const int n_tiles = (plast - jlo) / BK + 1, ns = gridDim.z, sp = blockIdx.z;
    const int jb = jlo + BK * (int)((long long)n_tiles * sp / ns);
    const int je = min(plast + 1, jlo + BK * (int)((long long)n_tiles * (sp + 1) / ns));
    for (int j0 = jb; j0 < je; j0 += BK) {
        __syncthreads();                      // the previous tile is used up
        for (int e = threadIdx.x; e < BK * (HD / 8); e += 32 * NW) {
            const int jj = e / (HD / 8), c = (e % (HD / 8)) * 8;
            uint4 kv4, vv4;
            kv_piece<HD>(kp, vp, table, j0 + jj, je, block_size, kvh, kh, c, kv4, vv4);
            *(uint4*)&sk[jj][c] = kv4;
            const __half* vh = (const __half*)&vv4;
#pragma unroll
            for (int i = 0; i < 8; i++) svt[c + i][jj] = vh[i];
        }
        __syncthreads();
        if (!active || j0 > pmax) continue;
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                mma_m16n8k8(s[nt], qa[ks], *(const unsigned*)&sk[8 * nt + gi][8 * ks + 2 * ti]);
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int h = i >> 1, j = j0 + 8 * nt + 2 * ti + (i & 1);
                const bool valid = ok[h] && j <= pr[h] && j >= lo[h];
                s[nt][i] = valid ? s[nt][i] : NEG_INF;
                mx[h] = fmaxf(mx[h], s[nt][i]);
            }
        float corr[2], mn[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            mn[h] = fmaxf(m[h], mx[h]);
            corr[h] = mn[h] == NEG_INF ? 1.f : exp2f(m[h] - mn[h]);
        }
        unsigned pa[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            float p[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int h = i >> 1;
                p[i] = mn[h] == NEG_INF ? 0.f : exp2f(s[nt][i] - mn[h]);
                sum[h] += p[i];
            }
            pa[nt][0] = pack_h2(p[0], p[1]);
            pa[nt][1] = pack_h2(p[2], p[3]);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
            sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
            l[h] = fmaf(l[h], corr[h], sum[h]);
            m[h] = mn[h];
        }
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
            o[nd][0] *= corr[0]; o[nd][1] *= corr[0]; o[nd][2] *= corr[1]; o[nd][3] *= corr[1];
        }
#pragma unroll
        for (int ks = 0; ks < NT; ks++)
#pragma unroll
            for (int nd = 0; nd < ND; nd++)
                mma_m16n8k8(o[nd], pa[ks], *(const unsigned*)&svt[8 * nd + gi][8 * ks + 2 * ti]);
    }
    if (ns > 1) {       // (max in natural-log units, sum, unnormalized acc) for attn_merge
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (!ok[h]) continue;
            const long long pi = ((long long)((t0 + rr[h] / G) * kvh + kh) * ns + sp) * G + rr[h] % G;
            if (ti == 0) {
                part_m[pi] = m[h] == NEG_INF ? NEG_INF : m[h] * 0.6931471805599453f;
                part_l[pi] = l[h];
            }
#pragma unroll
            for (int nd = 0; nd < ND; nd++)
                *(float2*)(part_acc + pi * HD + 8 * nd + 2 * ti) = make_float2(o[nd][2 * h], o[nd][2 * h + 1]);
        }
        return;
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (!ok[h]) continue;
        // (m in log2 units: exp2 in the softmax; the sink's logit is in natural units)
        const float inv = sinks ? sink_inv(l[h], m[h] * 0.6931471805599453f, sinks, kh * G + rr[h] % G)
                                : (l[h] > 0.f ? 1.f / l[h] : 0.f);
        float* orow = out + ((long long)(t0 + rr[h] / G) * H + kh * G + rr[h] % G) * HD + 2 * ti;
#pragma unroll
        for (int nd = 0; nd < ND; nd++)
            *(float2*)(orow + 8 * nd) = make_float2(o[nd][2 * h] * inv, o[nd][2 * h + 1] * inv);
    }
}

extern "C" __global__ void __launch_bounds__(128) attn_prefill_mma(
        const float* __restrict__ q, const __half* __restrict__ kp, V_PARAMS,
        const int* __restrict__ tables, int max_blocks, const int* __restrict__ seq_of_token,
        const int* __restrict__ positions, int n, int block_size, int window, float scale, int kvh,
        float* __restrict__ out, float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_acc,
        const float* __restrict__ sinks) {
#if ATT_HD <= 256 && ATT_HD % 64 == 0 && ATT_G <= 64     // (the backend launches it for these only)
    attn_prefill_mma_body<ATT_HD, ATT_G>(q, kp, V_POOL, tables, max_blocks, seq_of_token, positions, n, block_size,
                                         window, scale, kvh, out, part_m, part_l, part_acc, sinks);
#endif
}

// attn_merge_head's sums for up to MERGE_MAX splits in two trips to memory: every
// split's (max, sum) at once, one thread a split, and each split's weight
// exp(m - max) computed once into shared memory; then every split's part of a dim at
// once.  The float operations and their order are attn_merge_head's.
#define MERGE_MAX 64
template <int HD, int G>
ADEV void attn_merge_staged(const float* __restrict__ part_m, const float* __restrict__ part_l,
                            const float* __restrict__ part_acc, int n_splits, int kvh, int t, int h,
                            float* __restrict__ out, int tid, int nt, const float* __restrict__ sinks) {
    __shared__ float s_l[MERGE_MAX], s_c[MERGE_MAX], s_mx[32];
    const int H = kvh * G;
    const int kh = h / G, g = h % G;
    const long long base = (long long)(t * kvh + kh) * n_splits;
    float lv = 0.f, mv = NEG_INF;
    if (tid < n_splits) { lv = part_l[(base + tid) * G + g]; mv = part_m[(base + tid) * G + g]; }
    float mx = lv > 0.f ? mv : NEG_INF;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if ((tid & 31) == 0) s_mx[tid >> 5] = mx;
    __syncthreads();
    mx = NEG_INF;
    for (int w = 0; w < (nt + 31) / 32; w++) mx = fmaxf(mx, s_mx[w]);
    if (tid < n_splits) { s_l[tid] = lv; s_c[tid] = lv > 0.f ? expf(mv - mx) : 0.f; }
    __syncthreads();
    for (int d = tid; d < HD; d += nt) {
        float av[MERGE_MAX];
#pragma unroll
        for (int s = 0; s < MERGE_MAX; s++) av[s] = s < n_splits ? part_acc[((base + s) * G + g) * HD + d] : 0.f;
        float L = 0.f, A = 0.f;
#pragma unroll
        for (int s = 0; s < MERGE_MAX; s++) {
            if (s < n_splits && s_l[s] > 0.f) {
                L = fmaf(s_l[s], s_c[s], L);
                A = fmaf(av[s], s_c[s], A);
            }
        }
        out[((long long)t * H + h) * HD + d] = sinks ? A * sink_inv(L, mx, sinks, h) : (L > 0.f ? A / L : 0.f);
    }
}

// combine the context splits: one block per (token, query head), one thread per dim
extern "C" __global__ void attn_merge(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                      const float* __restrict__ part_acc, int n_splits, int kvh,
                                      float* __restrict__ out, const float* __restrict__ sinks) {
    PDL_ENTER();
    const int H = kvh * ATT_G;
    if (n_splits <= MERGE_MAX && (int)blockDim.x >= n_splits) {
        attn_merge_staged<ATT_HD, ATT_G>(part_m, part_l, part_acc, n_splits, kvh, blockIdx.x / H, blockIdx.x % H,
                                         out, threadIdx.x, blockDim.x, sinks);
        return;
    }
    attn_merge_head<ATT_HD, ATT_G, false>(part_m, part_l, part_acc, n_splits, kvh, blockIdx.x / H, blockIdx.x % H,
                                          out, threadIdx.x, blockDim.x, sinks);
}

// RoPE on q and k, then k and v into the fp16 cache at the tokens' slots: the three
// ops before attention in one launch.  One thread per (token, head of q|k, pair);
// pairs cover the whole head (rope_dim == head_dim), so the k-head threads also
// carry v's two elements.
extern "C" __global__ void rope_qk_kv_write(float* q, float* k, const float* __restrict__ v,
                                            __half* kp, __half* vp, const int* __restrict__ slots,
                                            const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                            int N, int H, int KVH, int D, int neox, float pos_scale, float mscale) {
    const int half = D / 2;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = i < (long long)N * (H + KVH) * half;
    const int p = (int)(i % half);
    const int hh = (int)((i / half) % (H + KVH));
    const int t = (int)(i / ((long long)half * (H + KVH)));
    // the angle from the step's positions and the constant frequencies: before the wait
    // (pdl.cuh), so its double-precision sin / cos overlap the kernel ahead
    float c = 0.f, s = 0.f;
    if (live) {
        rope_cs(positions[t], pos_scale, inv_freq[p], c, s);
        c *= mscale;
        s *= mscale;
    }
    PDL_ENTER();
    if (!live) return;
    const int ia = neox ? p : 2 * p, ib = neox ? p + half : 2 * p + 1;
    if (hh < H) {
        float* xr = q + ((long long)t * H + hh) * D;
        const float a = xr[ia], b = xr[ib];
        xr[ia] = rope_lo(a, b, c, s);
        xr[ib] = rope_hi(a, b, c, s);
    } else {
        const int kh = hh - H;
        float* xr = k + ((long long)t * KVH + kh) * D;
        const float a = xr[ia], b = xr[ib];
        const float ra = rope_lo(a, b, c, s), rb = rope_hi(a, b, c, s);
        xr[ia] = ra;
        xr[ib] = rb;
        const long long dst = ((long long)slots[t] * KVH + kh) * D;
        kp[dst + ia] = __float2half_rn(ra);
        kp[dst + ib] = __float2half_rn(rb);
        const float* vr = v + ((long long)t * KVH + kh) * D;
        vp[dst + ia] = __float2half_rn(vr[ia]);
        vp[dst + ib] = __float2half_rn(vr[ib]);
    }
}

// busy-wait ~cycles clocks: keeps the GPU busy while the host enqueues the next op,
// so events around that op time its kernels, not the host's launch gap (profiling only)
extern "C" __global__ void spin(long long cycles) {
    PDL_ENTER();
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}

// Greedy decoding's argmax of each logits row, on the device: out[r] = the index np.argmax
// gives (the first maximum; any NaN counts as the maximum, the first NaN wins; -0.0 == 0.0).
// Each (value, index) becomes one 64-bit key that orders as np.argmax does: the value's
// bits made monotonic in the high word, ~index in the low one (the lower index is the
// larger key).  Blocks fold their chunk into best[r] by atomicMax; the row's last block
// (counted in count[r]) writes out[r] and zeroes best[r] and count[r] for the next launch,
// so the kernel can sit in a replayed graph.  best and count start zeroed.  Grid (nb, rows).
// out may be pinned host memory (a decode graph's: the token needs no copy node after).
__device__ __forceinline__ unsigned long long argmax_key(float v, unsigned int i) {
    // on the bits alone: float compares would flush subnormals to zero under -ftz
    const unsigned int u = __float_as_uint(v), a = u & 0x7fffffffu;
    unsigned int o;
    if (a > 0x7f800000u) o = 0xffffffffu;              // NaN: above +inf
    else if (a == 0u) o = 0x80000000u;                 // -0.0 and +0.0 alike
    else o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)o << 32) | (unsigned long long)(0xffffffffu - i);
}

extern "C" __global__ void argmax_rows(const float* __restrict__ x, int n, long long stride,
                                       unsigned long long* best, unsigned int* count, int* out) {
    PDL_ENTER();
    __shared__ unsigned long long red[32];
    __shared__ bool last;
    const int r = blockIdx.y;
    const float* xr = x + (long long)r * stride;
    const int per = (n + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * per, hi = min(n, lo + per);
    unsigned long long k = 0;
#pragma unroll 4
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const unsigned long long c = argmax_key(xr[i], (unsigned int)i);
        k = c > k ? c : k;
    }
    for (int o = 16; o; o >>= 1) {
        const unsigned long long c = __shfl_xor_sync(0xffffffffu, k, o);
        k = c > k ? c : k;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = k;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (blockDim.x >> 5); ++w) k = red[w] > k ? red[w] : k;
        if (k) atomicMax(best + r, k);
        __threadfence();
        last = atomicAdd(count + r, 1u) == gridDim.x - 1;
        if (last) {
            __threadfence();
            const unsigned long long b = atomicMax(best + r, 0ull);   // read through L2
            out[r] = (int)(0xffffffffu - (unsigned int)(b & 0xffffffffu));
            best[r] = 0ull;
            count[r] = 0u;
        }
    }
}
