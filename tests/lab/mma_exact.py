"""Does the tensor cores' fp32 accumulation keep integer sums exact?  The question a
batch-invariant tensor-core matvec rests on (quant/cuda/NOTES.md, session 34): with fp16
operands holding integers (activation codes |x| <= 127, weights times their run scale
|sc * q| <= 945), every product and partial sum is an integer below 2^24, which fp32 holds
exactly, but the tensor cores' adder aligns and may truncate.  Here `mma.sync.m16n8k16`
(f16 in, f32 accumulate; sm_80+) sums T such tiles (k = 16 T) of random integers, its result
set against numpy's exact int64 sums: any mismatch means the route is closed.

    PYTHONPATH=tests python -m lab.mma_exact [--trials 2000] [--tiles 4]
"""
from __future__ import annotations

import argparse

import numpy as np

SRC = r"""
#include <cuda_fp16.h>
// one warp: D[16 x 8] = sum over T tiles of A_t[16 x 16] B_t[16 x 8], A row-major (m, k),
// B given as Bt[8 x 16] (n, k); fp32 accumulators, starting from zero
extern "C" __global__ void mma_sum(const __half* A, const __half* Bt, float* D, int T) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const long long w = blockIdx.x;
    A += w * T * 256; Bt += w * T * 128; D += w * 128;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < T; i++) {
        const __half* a = A + i * 256;
        const __half* b = Bt + i * 128;
        __half2 a0 = __halves2half2(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]);
        __half2 a1 = __halves2half2(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]);
        __half2 a2 = __halves2half2(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]);
        __half2 a3 = __halves2half2(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9]);
        __half2 b0 = __halves2half2(b[g * 16 + 2 * t], b[g * 16 + 2 * t + 1]);
        __half2 b1 = __halves2half2(b[g * 16 + 2 * t + 8], b[g * 16 + 2 * t + 9]);
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(*(unsigned*)&a0), "r"(*(unsigned*)&a1), "r"(*(unsigned*)&a2), "r"(*(unsigned*)&a3),
                       "r"(*(unsigned*)&b0), "r"(*(unsigned*)&b1));
    }
    D[g * 8 + 2 * t] = c[0]; D[g * 8 + 2 * t + 1] = c[1];
    D[(g + 8) * 8 + 2 * t] = c[2]; D[(g + 8) * 8 + 2 * t + 1] = c[3];
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2000, help="warps (independent 16 x 8 sums)")
    ap.add_argument("--tiles", default="1,4,8", help="k tiles of 16 summed, each count a run")
    ap.add_argument("--amax", type=int, default=127)
    ap.add_argument("--bmax", type=int, default=945)
    a = ap.parse_args(argv)
    import cupy as cp
    fn = cp.RawModule(code=SRC, options=("-std=c++17",)).get_function("mma_sum")
    rng = np.random.default_rng(0)
    bad_all = 0
    for T in (int(v) for v in a.tiles.split(",")):
        W = a.trials
        # extremes often: the largest magnitudes are where an adder would drop bits
        A = rng.integers(-a.amax, a.amax + 1, (W, T, 16, 16))
        B = rng.integers(-a.bmax, a.bmax + 1, (W, T, 8, 16))
        ext = rng.random(A.shape) < 0.3
        A[ext] = np.sign(A[ext]) * a.amax
        ext = rng.random(B.shape) < 0.3
        B[ext] = np.sign(B[ext]) * a.bmax
        exact = np.einsum("wtmk,wtnk->wmn", A, B)          # int64
        D = cp.empty((W, 16, 8), cp.float32)
        fn((W,), (32,), (cp.asarray(A.astype(np.float16)), cp.asarray(B.astype(np.float16)), D, np.int32(T)))
        got = D.get().astype(np.int64)
        bad = int((got != exact).sum())
        bad_all += bad
        print(f"k = {16 * T:4d}: {W * 128} sums, max |sum| {np.abs(exact).max()} (2^24 = {1 << 24}), "
              f"mismatches {bad}", flush=True)
    print("exact" if bad_all == 0 else "NOT exact")
    return 0 if bad_all == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
