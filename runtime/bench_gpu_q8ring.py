"""The stream probe's best structure with real arithmetic: a decode step's Q8_0 matvecs in
one persistent kernel fed by bulk copies (sm_90+).

    python -m runtime.bench_gpu_q8ring [L8]

`bench_gpu_stream` bounds a persistent step fed by bulk copies, a counter an op, at ~82% of
copy for L8 Q8_0 with Q8_0's dp4a work (quant/cuda/NOTES.md, session 25), against 67% for
today's decode.  Its consumer only XORs or dp4a's bytes.  This kernel does a Q8_0 matvec's
whole work on each slot: the blocks' fp16 scales, the dot products against the op's int8
input and its scales (read from L2 into shared memory when the op starts, as a matvec must),
each row's sum across the block, and the outputs written.  Slots are whole rows (3 rows of
K = 4096, one of K = 14336), dealt to the SMs interleaved as in the probe.  Variants: `free`
(no op waits), `barrier` (each op waits for every block to finish the op before: a counter
an op).  What is left out: the ops between the matvecs (norms, RoPE, attention, the
activations' rounding), so the input is one fixed vector.  The first ops' outputs are
checked against float64 on the host before anything is timed.

Session 25's first run: correct, but 31-32% of copy against the probe's ~100% (free) and
~86% (barrier) for the same bytes: the consumer, not the streaming, sets the pace
(quant/cuda/NOTES.md).  PART splits its time;
V2 is a lighter consumer written after that run and not yet run on a GPU.
"""
from __future__ import annotations

import functools
import sys
import types

import numpy as np

from runtime.bench_gpu_stream import BULK_SRC, SLOT_BYTES, step_matrices

BLOCK_BYTES = 34            # Q8_0: fp16 scale, 32 int8
MAX_K = 16384               # the input in shared memory: K int8 and K / 32 float scales

_KERNEL = r"""
#include <cuda_fp16.h>
// op o: rows[o] rows of kdim[o] Q8_0 weights at base + start[o], rps[o] rows a slot (a slot
// of op o is rows [rps s, rps (s + 1))); block b reads slots b, b + n, ... of every op.
// Its outputs go to y + ystart[o].  barriers: op o waits for cnt[o - 1] to reach n.
// PART (what the time is made of): 0 the whole work, 1 without the dot products (no weight
// or input reads from shared memory), 2 without the row sums (each thread's value stored).
// V2 (with PART 0): the op's sizes kept in registers, the input transposed in shared memory
// (lane l reads word l: no bank conflict), a block's 32 weights as 9 aligned words shifted
// into place, a slot's row sums finished after the next slot's barrier (no second barrier)
template <int S, int PART, int V2>
__global__ void __launch_bounds__(512, 1)
q8_ring(const char* __restrict__ base, const long long* __restrict__ start, const int* __restrict__ rows,
        const int* __restrict__ kdim, const int* __restrict__ rps, const long long* __restrict__ ystart, int nops,
        unsigned* cnt, const int* __restrict__ xq, const float* __restrict__ xd, float* __restrict__ y,
        int barriers) {
    extern __shared__ uint4 ring[];                        // S slots, then the op's input
    __shared__ unsigned long long full[S];
    __shared__ float ws[32];                               // warps' sums (V2: two slots' worth)
    int* xs = (int*)(ring + S * (SLOT_BYTES / 16));
    float* xds = (float*)(xs + MAX_K / 4);
    const int t = threadIdx.x, b = blockIdx.x, n = gridDim.x;
    auto nslots = [&](int o) { return (rows[o] + rps[o] - 1) / rps[o]; };
    auto row_bytes = [&](int o) { return (long long)(kdim[o] / 32) * 34; };
    int pop = 0, ps = b;                                   // the next slot to copy: op, slot
    auto issue = [&](int slot) {
        while (pop < nops && ps >= nslots(pop)) { ++pop; ps = b; }
        if (t == 0) {
            if (pop < nops) {
                const int r0 = ps * rps[pop], nr = min(rps[pop], rows[pop] - r0);
                bulk_copy(ring + slot * (SLOT_BYTES / 16), base + start[pop] + r0 * row_bytes(pop),
                          (unsigned)(nr * row_bytes(pop)), full + slot);
            } else {
                bulk_none(full + slot);
            }
        }
        if (pop < nops) ps += n;
    };
    int cop = 0, cs = b, xop = -1;                         // the next slot to read; the input held
    int K = 0, nb = 0, crps = 0, crows = 0;                // V2: op cop's sizes
    long long cys = 0;
    int pend_nr = 0, pend_buf = 0, pend_wpr = 0;           // V2: the row sums left to finish
    long long pend_y = 0;
    auto flush = [&]() {                                   // after a barrier
        if (t < pend_nr) {
            float a = 0.f;
            for (int w = t * pend_wpr; w < (t + 1) * pend_wpr; ++w) a += ws[16 * pend_buf + w];
            y[pend_y + t] = a;
        }
        pend_nr = 0;
    };
    auto pass = [&]() {                                    // ops whose share this block has read
        while (cop < nops && cs >= nslots(cop)) {
            if (barriers) {
                __syncthreads();
                if (V2) {                                  // the op's outputs written before it is passed
                    flush();
                    __syncthreads();
                }
                if (t == 0) { __threadfence(); atomicAdd(cnt + cop, 1u); }
            }
            ++cop;
            cs = b;
        }
    };
    bulk_init(full, S);
    for (int s = 0; s < S - 1; ++s) issue(s);
    pass();
    for (int k = 0; cop < nops; ++k) {
        bulk_wait(full + k % S, (k / S) & 1);
        __syncthreads();                                   // slot (k - 1) % S read by all
        issue((k + S - 1) % S);
        if (V2) flush();
        else { K = kdim[cop]; nb = K / 32; }
        if (xop != cop) {                                  // the op's input, once the op before is done
            if (t == 0 && barriers && cop > 0) {
                while (*(volatile const unsigned*)(cnt + cop - 1) < (unsigned)n) __nanosleep(20);
                __threadfence();
            }
            __syncthreads();
            if (V2) {
                K = kdim[cop]; nb = K / 32; crps = rps[cop]; crows = rows[cop]; cys = ystart[cop];
                for (int w = t; w < K / 4; w += 512) xs[(w & 7) * nb + (w >> 3)] = __ldcg(xq + w);
            } else {
                for (int i = t; i < K / 4; i += 512) xs[i] = __ldcg(xq + i);
            }
            for (int i = t; i < nb; i += 512) xds[i] = __ldcg(xd + i);
            __syncthreads();
            xop = cop;
        }
        const int r0 = cs * (V2 ? crps : rps[cop]), nr = min(V2 ? crps : rps[cop], (V2 ? crows : rows[cop]) - r0);
        float v = 0.f;
        if (V2 && t < nr * nb) {                           // block t of the slot starts at byte 34 t
            const unsigned* W = (const unsigned*)(ring + (k % S) * (SLOT_BYTES / 16)) + ((34 * t) >> 2);
            const unsigned sh = (t & 1) ? 32u : 16u;       // odd blocks' weights are word-aligned
            unsigned w[9];
#pragma unroll
            for (int i = 0; i < 9; ++i) w[i] = W[i];
            const int bi = t % nb;
            int s0 = 0, s1 = 0;
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                s0 = __dp4a((int)__funnelshift_rc(w[i], w[i + 1], sh), xs[i * nb + bi], s0);
                s1 = __dp4a((int)__funnelshift_rc(w[i + 1], w[i + 2], sh), xs[(i + 1) * nb + bi], s1);
            }
            const unsigned short d = (unsigned short)(w[0] >> (sh - 16));
            v = __half2float(__ushort_as_half(d)) * xds[bi] * (float)(s0 + s1);
        }
        if (!V2 && PART != 1 && t < nr * nb) {             // a thread a Q8_0 block
            const int bi = t % nb;
            const unsigned short* h = (const unsigned short*)((const char*)(ring + (k % S) * (SLOT_BYTES / 16)) + t * 34);
            int s0 = 0, s1 = 0;
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                s0 = __dp4a((int)(h[1 + 2 * i] | ((unsigned)h[2 + 2 * i] << 16)), xs[bi * 8 + i], s0);
                s1 = __dp4a((int)(h[3 + 2 * i] | ((unsigned)h[4 + 2 * i] << 16)), xs[bi * 8 + i + 1], s1);
            }
            v = __half2float(__ushort_as_half(h[0])) * xds[bi] * (float)(s0 + s1);
        }
        if (PART == 2) {
            if (t < nr * nb && v == 1.2345f) y[ystart[cop] + r0] = v;
            cs += n;
            pass();
            continue;
        }
        // a row is nb consecutive threads, nb a multiple of 32: a warp's lanes share a row
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
        if (V2) {
            if ((t & 31) == 0) ws[16 * (k & 1) + (t >> 5)] = v;
            pend_nr = nr; pend_buf = k & 1; pend_wpr = nb / 32; pend_y = cys + r0;
            cs += n;
            pass();
            continue;
        }
        if ((t & 31) == 0) ws[t >> 5] = v;
        __syncthreads();
        if (t < nr) {
            float a = 0.f;
            for (int w = t * nb / 32; w < (t + 1) * nb / 32; ++w) a += ws[w];
            y[ystart[cop] + r0 + t] = a;
        }
        cs += n;                                           // this block's next slot of the op
        pass();
    }
    if (V2) {
        __syncthreads();
        flush();
    }
}
"""


def _source():
    return (BULK_SRC + _KERNEL).replace("SLOT_BYTES", str(SLOT_BYTES)).replace("MAX_K", str(MAX_K))


def _smem(S):
    """Dynamic shared memory: S slots, then the op's input (K int8 and K / 32 float scales)."""
    return S * SLOT_BYTES + MAX_K + MAX_K // 8


def q8_ops(shape: str):
    """[(rows, K)] of one decode step's matrices, in order (q/k/v and gate/up as one matrix each)."""
    return [(sum(r for _, r, _ in mats), mats[0][2]) for _, mats in step_matrices(shape)]


def slot_rows(k: int) -> int:
    """Whole rows a slot holds; a thread a Q8_0 block, so at most 512 blocks a slot."""
    nb = k // 32
    if k % 1024 or k > MAX_K:
        raise ValueError(f"K = {k}: rows must be whole warps of blocks (K % 1024 == 0) and K <= {MAX_K}")
    return max(1, min(SLOT_BYTES // (nb * BLOCK_BYTES), 512 // nb))


# (PART, V2) of each variant measured, and what it is
VARIANTS = {(0, 0): "whole work", (1, 0): "no dot products", (2, 0): "no row sums",
            (0, 1): "V2: aligned words, input transposed, row sums after the next barrier"}
CHECKED = [v for v, what in VARIANTS.items() if v[0] == 0]     # the variants that do the whole work


@functools.cache
def _kernel(cp, S, part=0, v2=0):
    name = f"q8_ring<{S},{part},{v2}>"
    mod = cp.RawModule(code=_source(), options=("-std=c++17",), name_expressions=[name])
    f = mod.get_function(name)
    f.max_dynamic_shared_size_bytes = _smem(S)
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


def measure(cp, shape="L8", S=8, reps=10, check_ops=4):
    """(weight bytes a step, {variant: seconds a step}, [max relative error of the first
    check_ops ops' outputs against float64])."""
    from runtime.bench_gpu import _graph_seconds
    ops = q8_ops(shape)
    sizes = [r * (k // 32 * BLOCK_BYTES) for r, k in ops]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    base = cp.zeros(int(sum(sizes)), cp.uint8)
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
                                rps=cp.asarray(np.array([slot_rows(k) for _, k in ops], np.int32)),
                                ystart=cp.asarray(ystart), cnt=cp.zeros(len(ops), cp.uint32),
                                xq=cp.asarray(xq.view(np.int32)), xd=cp.asarray(xd.astype(np.float32)),
                                y=cp.zeros(int(sum(rows)), cp.float32))
    sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])

    def launch(barriers, variant=(0, 0)):
        f = _kernel(cp, S, *variant)

        def run(_):
            dev.cnt.fill(0)
            f((sms,), (512,), (base, dev.start, dev.rows, dev.kdim, dev.rps, dev.ystart,
                               np.int32(len(ops)), dev.cnt, dev.xq, dev.xd, dev.y, np.int32(barriers)),
              shared_mem=_smem(S))
        return run

    refs = [_reference(blocks, xq, xd.astype(np.float32).astype(np.float64)) for blocks in host]
    errors = []
    for variant, barriers in ((v, bar) for v in CHECKED for bar in (0, 1)):
        dev.y.fill(np.nan)
        launch(barriers, variant)(0)
        y = cp.asnumpy(dev.y)
        for o, ref in enumerate(refs):
            got = y[ystart[o]:ystart[o] + rows[o]]
            errors.append(float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
        if np.isnan(y).any():
            raise RuntimeError(f"{VARIANTS[variant]}, barriers={barriers}: {int(np.isnan(y).sum())} outputs never written")
        if max(errors) > 1e-4:                 # float32 sums of exact block products: ~1e-6
            raise RuntimeError(f"{VARIANTS[variant]}, barriers={barriers}: outputs wrong "
                               f"(max relative error {max(errors):.2e})")
    times = {f"{name}, {what}": _graph_seconds(cp, launch(bar, v), 1, reps)
             for v, what in VARIANTS.items() for name, bar in (("free", 0), ("barrier", 1))}
    return int(sum(sizes)), times, errors


def main(argv=None) -> int:
    import cupy as cp

    from runtime.bench_gpu import copy_bandwidth
    args = list(argv or sys.argv[1:]) or ["L8"]
    if int(cp.cuda.Device().compute_capability) < 90:
        print("bulk copies need compute capability 9.0 or later")
        return 1
    bw = copy_bandwidth(cp)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: copy {bw / 1e9:.0f} GB/s")
    for shape in args:
        for S in (8,):
            nbytes, times, errors = measure(cp, shape, S)
            print(f"{shape} Q8_0 matvecs, {len(q8_ops(shape))} ops, {nbytes / 1e6:.1f} MB a step, {S} slots; "
                  f"first ops' max error against float64 (relative to the largest output): "
                  f"{max(errors):.2e}")
            for name, t in times.items():
                print(f"  {name}: {t * 1e3:.4f} ms a step, {nbytes / t / 1e9:.0f} GB/s, "
                      f"{100 * nbytes / t / bw:.1f}% of copy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
