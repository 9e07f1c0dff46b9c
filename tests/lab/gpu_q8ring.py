"""The stream probe's best structure with real arithmetic: a decode step's Q8_0 matvecs in
one persistent kernel fed by bulk copies (sm_90+).

    python -m lab.gpu_q8ring [L8] [zeros|random] [q8_stream<S,SB> ...]

`bench_gpu_stream` bounds a persistent step fed by bulk copies, a counter an op, at ~82% of
copy for L8 Q8_0 with Q8_0's dp4a work (quant/cuda/NOTES.md, session 25).  Its consumer only
XORs or dp4a's bytes.  This kernel does a Q8_0 matvec's whole work on each slot: the
blocks' fp16 scales, the dot products against the op's int8 input and its scales (read
from L2 into shared memory when the op starts, as a matvec must), each row's sum, and the
outputs written.  Slots are whole rows dealt to the SMs interleaved as in the probe.
Variants: `free` (no op waits), `barrier` (each op waits for every block to finish the op
before: a counter an op).  What is left out: the ops between the matvecs (norms, RoPE,
attention, the activations' rounding), so the input is one fixed vector, and mvs's order
of summation (the megakernel's bulk path, tests/lab/mega.cu, keeps it).  The
first ops' outputs are checked against float64 before anything is timed; the other
weights are zeros or hashed bytes (the same speed, session 26).

Session 26: 4 slots of 32 KB read at 91-92% of copy free and 86-87% with a counter an op;
6 slots of 32 KB and 8 of 16 KB were slower (79 / 71%, 69 / 66%).
"""
from __future__ import annotations

import functools
import sys
import types

import numpy as np

from lab.gpu_stream import BULK_SRC, step_matrices

BLOCK_BYTES = 34            # Q8_0: fp16 scale, 32 int8
MAX_K = 16384               # the input in shared memory: K int8 and K / 32 float scales
MAX_OPS = 256               # q8_stream's op tables in shared memory

_KERNEL = r"""
#include <cuda_fp16.h>
// op o: rows[o] rows of kdim[o] Q8_0 weights at base + start[o], rps[o] whole rows a slot of
// SB bytes; block b reads slots b, b + n, ... of every op in a ring of S slots, each
// bulk-copied by thread 0 as soon as every thread has read the one before.  A thread P
// blocks a slot (its 34 bytes as 9 aligned words shifted into place; the input transposed
// in shared memory, lane l at bank l), a row's sum by a butterfly a warp and, after the
// next slot's barrier, the last warp adding the warps' sums.  The op tables live in shared
// memory and only thread 0 walks them: session 26's first consumer (a thread a block, the
// tables read from global memory by every thread, two barriers a slot) ran at 35% of copy
// where this one runs at 86-92% (quant/cuda/NOTES.md).  barriers: op o waits for
// cnt[o - 1] to reach n.
template <int S, int SB>
__global__ void __launch_bounds__(512, 1)
q8_stream(const char* __restrict__ base, const long long* __restrict__ start, const int* __restrict__ rows,
          const int* __restrict__ kdim, const int* __restrict__ rps, const long long* __restrict__ ystart, int nops,
          unsigned* cnt, const int* __restrict__ xq, const float* __restrict__ xd, float* __restrict__ y,
          int barriers) {
    constexpr int P = (SB / 34 + 511) / 512;               // blocks a thread a slot, at most
    extern __shared__ uint4 ring[];                        // S slots, then the op's input
    __shared__ unsigned long long full[S];
    __shared__ float ws[2][16 * P];                        // a warp's sum, two slots' worth
    __shared__ long long o_start[MAX_OPS], o_y[MAX_OPS];
    __shared__ int o_rows[MAX_OPS], o_k[MAX_OPS], o_rps[MAX_OPS], o_ns[MAX_OPS];
    int* xs = (int*)(ring + S * (SB / 16));
    float* xds = (float*)(xs + MAX_K / 4);
    const int t = threadIdx.x, b = blockIdx.x, n = gridDim.x;
    for (int o = t; o < nops; o += 512) {
        o_start[o] = start[o]; o_y[o] = ystart[o]; o_rows[o] = rows[o]; o_k[o] = kdim[o]; o_rps[o] = rps[o];
        o_ns[o] = (rows[o] + rps[o] - 1) / rps[o];
    }
    int pop = 0, ps = b;                                   // thread 0: the next slot to copy
    auto issue = [&](int slot) {
        while (pop < nops && ps >= o_ns[pop]) { ++pop; ps = b; }
        if (pop < nops) {
            const int r0 = ps * o_rps[pop], nr = min(o_rps[pop], o_rows[pop] - r0);
            const long long rb = (long long)(o_k[pop] / 32) * 34;
            bulk_copy(ring + slot * (SB / 16), base + o_start[pop] + r0 * rb, (unsigned)(nr * rb), full + slot);
            ps += n;
        } else {
            bulk_none(full + slot);
        }
    };
    int cop = 0, cs = b, xop = -1, cns = 0, nb = 0, crps = 0, crows = 0;   // the slot to read, op's sizes
    long long cys = 0;
    int bi[P];                                             // block j = t + 512 p's index in its row
    int pend_nr = 0, pend_buf = 0, pend_wpr = 0;           // the row sums left to finish
    long long pend_y = 0;
    auto flush = [&]() {                                   // after a barrier, by the last warp
        if (t >= 480 && t - 480 < pend_nr) {
            const int r = t - 480;
            float a = 0.f;
            for (int w = r * pend_wpr; w < (r + 1) * pend_wpr; ++w) a += ws[pend_buf][w];
            y[pend_y + r] = a;
        }
        pend_nr = 0;
    };
    auto pass = [&]() {                                    // ops whose share this block has read
        while (cop < nops && cs >= cns) {
            if (barriers) {
                __syncthreads();
                flush();                                   // the op's outputs written before it is passed
                __syncthreads();
                if (t == 0) { __threadfence(); atomicAdd(cnt + cop, 1u); }
            }
            if (++cop < nops) cns = o_ns[cop];
            cs = b;
        }
    };
    bulk_init(full, S);                                    // (its barrier also orders the tables)
    if (t == 0) for (int s = 0; s < S - 1; ++s) issue(s);
    if (nops) cns = o_ns[0];
    pass();
    for (int k = 0; cop < nops; ++k) {
        bulk_wait(full + k % S, (k / S) & 1);
        __syncthreads();                                   // slot (k - 1) % S read by all
        if (t == 0) issue((k + S - 1) % S);
        flush();
        if (xop != cop) {                                  // the op's input, once the op before is done
            if (t == 0 && barriers && cop > 0) {
                while (*(volatile const unsigned*)(cnt + cop - 1) < (unsigned)n) __nanosleep(20);
                __threadfence();
            }
            __syncthreads();
            const int K = o_k[cop];
            nb = K / 32; crps = o_rps[cop]; crows = o_rows[cop]; cys = o_y[cop];
            for (int w = t; w < K / 4; w += 512) xs[(w & 7) * nb + (w >> 3)] = __ldcg(xq + w);
            for (int i = t; i < nb; i += 512) xds[i] = __ldcg(xd + i);
#pragma unroll
            for (int p = 0; p < P; ++p) bi[p] = (t + 512 * p) % nb;
            __syncthreads();
            xop = cop;
        }
        const int r0 = cs * crps, nr = min(crps, crows - r0), nblk = nr * nb;
        const unsigned* sl = (const unsigned*)(ring + (k % S) * (SB / 16));
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int j = t + 512 * p;
            if (j < nblk) {                                // warp-uniform: nblk is whole warps
                const unsigned* W = sl + ((34 * j) >> 2);  // block j starts at byte 34 j
                const unsigned sh = (j & 1) ? 32u : 16u;   // odd blocks' weights are word-aligned
                unsigned w[9];
#pragma unroll
                for (int i = 0; i < 9; ++i) w[i] = W[i];
                int s0 = 0, s1 = 0;
#pragma unroll
                for (int i = 0; i < 8; i += 2) {
                    s0 = __dp4a((int)__funnelshift_rc(w[i], w[i + 1], sh), xs[i * nb + bi[p]], s0);
                    s1 = __dp4a((int)__funnelshift_rc(w[i + 1], w[i + 2], sh), xs[(i + 1) * nb + bi[p]], s1);
                }
                const unsigned short d = (unsigned short)(w[0] >> (sh - 16));
                float v = __half2float(__ushort_as_half(d)) * xds[bi[p]] * (float)(s0 + s1);
#pragma unroll
                for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
                if ((t & 31) == 0) ws[k & 1][j >> 5] = v;
            }
        }
        pend_nr = nr; pend_buf = k & 1; pend_wpr = nb / 32; pend_y = cys + r0;
        cs += n;
        pass();
    }
    __syncthreads();
    flush();
}
"""


def _source():
    return (BULK_SRC + _KERNEL).replace("MAX_K", str(MAX_K)).replace("MAX_OPS", str(MAX_OPS))


def _smem(S, sb):
    """Dynamic shared memory: S slots of sb bytes, then the op's input (K int8, K / 32 float scales)."""
    return S * sb + MAX_K + MAX_K // 8


def q8_ops(shape: str):
    """[(rows, K)] of one decode step's matrices, in order (q/k/v and gate/up as one matrix each)."""
    return [(sum(r for _, r, _ in mats), mats[0][2]) for _, mats in step_matrices(shape)]


def slot_rows(k: int, sb: int) -> int:
    """Whole rows a slot of sb bytes holds: at most 2 x 512 Q8_0 blocks (a thread's share at
    most P = 2 blocks at 32 KB) and 32 rows (a lane of the last warp a row's sum)."""
    nb = k // 32
    if k % 1024 or k > MAX_K or nb * BLOCK_BYTES > sb:
        raise ValueError(f"K = {k}: rows must be whole warps of blocks (K % 1024 == 0), K <= {MAX_K}, "
                         f"a row within a slot of {sb} bytes")
    blocks = 512 * -(-sb // BLOCK_BYTES // 512)
    return max(1, min(sb // (nb * BLOCK_BYTES), blocks // nb, 32))


# the kernels timed: (template, slots, slot bytes)
VARIANTS = {("q8_stream<4,32768>", 4, 32768): "4 slots of 32 KB",
            ("q8_stream<6,32768>", 6, 32768): "6 slots of 32 KB",
            ("q8_stream<8,16384>", 8, 16384): "8 slots of 16 KB"}


@functools.cache
def _kernel(cp, name, S, sb):
    mod = cp.RawModule(code=_source(), options=("-std=c++17",), name_expressions=[name])
    f = mod.get_function(name)
    f.max_dynamic_shared_size_bytes = _smem(S, sb)
    return f


def _random_q8(rng, rows, k):
    """rows x k Q8_0 blocks as bytes: scales in [0.5, 1) / 64, weights uniform int8."""
    blocks = np.empty((rows, k // 32, BLOCK_BYTES), np.uint8)
    blocks[..., :2] = (rng.uniform(0.5, 1, (rows, k // 32)) / 64).astype(np.float16)[..., None].view(np.uint8)
    blocks[..., 2:] = rng.integers(0, 256, (rows, k // 32, 32), dtype=np.uint8)
    return blocks


def _reference(blocks, xq, xd):
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    q = blocks[..., 2:].view(np.int8).astype(np.int64)
    x = xq.view(np.int8)[: q.shape[1] * 32].reshape(-1, 32).astype(np.int64)
    return ((q * x).sum(-1) * d * xd[: q.shape[1]]).sum(-1)


def hash_fill(cp, buf):
    """buf (bytes, a multiple of 4) filled with a hash of each word's index: data as varied
    as real weights', made on the device (a whole step's weights from the host would take minutes)."""
    words = buf.view(cp.uint32)
    cp.ElementwiseKernel("", "uint32 y", "unsigned long long k = i; k = (k ^ (k >> 31)) * 0x9E3779B97F4A7C15ull; "
                         "y = (unsigned)(k >> 32) ^ (unsigned)k", "hash_words")(words)


def measure(cp, shape="L8", reps=10, check_ops=4, only=None, fill="zeros"):
    """(weight bytes a step, {variant: seconds a step}, [max relative error of the first
    check_ops ops' outputs against float64]); only: the kernels to run (default all); fill:
    the weights past the checked ops, zeros or hashed bytes ("random": their outputs are
    then not checked for NaN, since their fp16 scales are arbitrary bit patterns)."""
    only = only or [v[0] for v in VARIANTS]
    from lab.gpu_bench import _graph_seconds
    ops = q8_ops(shape)
    sizes = [r * (k // 32 * BLOCK_BYTES) for r, k in ops]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    base = cp.zeros(int(sum(sizes)), cp.uint8)
    if fill == "random":
        hash_fill(cp, base)
    rng = np.random.default_rng(0)
    host = []
    for o in range(min(check_ops, len(ops))):
        blocks = _random_q8(rng, *ops[o])
        base[int(starts[o]):int(starts[o]) + sizes[o]] = cp.asarray(blocks.reshape(-1))
        host.append(blocks)
    kmax = max(k for _, k in ops)
    xq = rng.integers(-127, 128, kmax, dtype=np.int8)
    xd = rng.uniform(0.5, 1, kmax // 32) / 128
    rows = [r for r, _ in ops]
    ystart = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    dev = types.SimpleNamespace(start=cp.asarray(starts), rows=cp.asarray(np.array(rows, np.int32)),
                                kdim=cp.asarray(np.array([k for _, k in ops], np.int32)),
                                ystart=cp.asarray(ystart), cnt=cp.zeros(len(ops), cp.uint32),
                                xq=cp.asarray(xq.view(np.int32)), xd=cp.asarray(xd.astype(np.float32)),
                                y=cp.zeros(int(sum(rows)), cp.float32))
    sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])

    def launch(barriers, variant):
        name, S, sb = variant
        f = _kernel(cp, name, S, sb)
        rps = cp.asarray(np.array([slot_rows(k, sb) for _, k in ops], np.int32))

        def run(_):
            dev.cnt.fill(0)
            f((sms,), (512,), (base, dev.start, dev.rows, dev.kdim, rps, dev.ystart,
                               np.int32(len(ops)), dev.cnt, dev.xq, dev.xd, dev.y, np.int32(barriers)),
              shared_mem=_smem(S, sb))
        return run

    refs = [_reference(blocks, xq, xd.astype(np.float32).astype(np.float64)) for blocks in host]
    errors = []
    for variant, barriers in ((v, bar) for v in VARIANTS if v[0] in only for bar in (0, 1)):
        dev.y.fill(np.nan)
        launch(barriers, variant)(0)
        y = cp.asnumpy(dev.y)
        for o, ref in enumerate(refs):
            got = y[ystart[o]:ystart[o] + rows[o]]
            errors.append(float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
        if np.isnan(y[:ystart[len(refs)]] if fill == "random" else y).any():
            raise RuntimeError(f"{VARIANTS[variant]}, barriers={barriers}: {int(np.isnan(y).sum())} outputs never written")
        if max(errors) > 1e-4:                 # float32 sums of exact block products: ~1e-6
            raise RuntimeError(f"{VARIANTS[variant]}, barriers={barriers}: outputs wrong "
                               f"(max relative error {max(errors):.2e})")
    times = {f"{name}, {what}": _graph_seconds(cp, launch(bar, v), 1, reps)
             for v, what in VARIANTS.items() if v[0] in only
             for name, bar in (("free", 0), ("barrier", 1))}
    return int(sum(sizes)), times, errors


def main(argv=None) -> int:
    import cupy as cp

    from lab.gpu_bench import copy_bandwidth
    args = list(argv or sys.argv[1:])
    only = [a for a in args if "<" in a] or None             # kernels named, e.g. 'q8_stream<4,32768>'
    fills = [a for a in args if a in ("zeros", "random")] or ["zeros"]
    args = [a for a in args if "<" not in a and a not in fills] or ["L8"]
    if int(cp.cuda.Device().compute_capability) < 90:
        print("bulk copies need compute capability 9.0 or later")
        return 1
    bw = copy_bandwidth(cp)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: copy {bw / 1e9:.0f} GB/s")
    for shape, fill in ((s, f) for s in args for f in fills):
        nbytes, times, errors = measure(cp, shape, only=only, fill=fill)
        print(f"{shape} Q8_0 matvecs, {len(q8_ops(shape))} ops, {nbytes / 1e6:.1f} MB a step, weights past the "
              f"checked ops {fill}; "
              f"first ops' max error against float64 (relative to the largest output): {max(errors, default=np.nan):.2e}")
        for name, t in times.items():
            print(f"  {name}: {t * 1e3:.4f} ms a step, {nbytes / t / 1e9:.0f} GB/s, "
                  f"{100 * nbytes / t / bw:.1f}% of copy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
