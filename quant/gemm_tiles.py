"""Prompt-processing matmul: dequantize a tile of W rows, sgemm it, all inside
Numba's thread pool.

Why not np.matmul between Numba kernels: numpy's OpenBLAS has its own threads.
After every Numba parallel region the OpenMP workers spin for a while (that is
what makes decode's many short regions cheap), and during that time OpenBLAS's
threads fight them for the same cores.  Measured on 2 cores, Qwen2.5-0.5B
pp512: 44 t/s with OpenMP spinning vs 146 t/s with OMP_WAIT_POLICY=PASSIVE --
but passive OpenMP halves decode speed.  Here each Numba worker dequantizes
its own tile into a private buffer and calls OpenBLAS's single-threaded sgemm
on it, writing straight into its columns of the output: one thread pool, no
spinning against another one, and each weight block decoded once per call.

The sgemm is called through its C address (found by quant.blas_threads in the
OpenBLAS that numpy loaded), passed in as an integer so the kernel stays
cacheable.  Where no OpenBLAS is found, callers keep the np.matmul path.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .dequant import deq_row

_CBLAS_ROW_MAJOR, _CBLAS_NO_TRANS, _CBLAS_TRANS = 101, 111, 112


@intrinsic
def _sgemm_xwT(typingctx, fn, wide, n, t, K, x, w, out, m0):
    """out[:, m0:m0+t] = x[:n] @ w[:t].T through cblas_sgemm at address fn
    (wide: True for the 64-bit-integer interface)."""
    if not isinstance(wide, types.BooleanLiteral):
        return None
    iw = ir.IntType(64 if wide.literal_value else 32)
    sig = types.void(fn, wide, n, t, K, x, w, out, m0)

    def codegen(context, builder, signature, args):
        fn_v, _, n_v, t_v, k_v, x_v, w_v, out_v, m0_v = args
        f32p = ir.FloatType().as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, iw, iw, iw, ir.FloatType(), f32p, iw,
                                               f32p, iw, ir.FloatType(), f32p, iw])
        fptr = builder.inttoptr(fn_v, fnty.as_pointer())

        xa, wa, oa = (context.make_array(ty)(context, builder, v)
                      for ty, v in zip(signature.args[5:8], (x_v, w_v, out_v)))
        xp, wp, op = xa.data, wa.data, oa.data
        ldc = builder.extract_value(oa.shape, 1)
        cp = builder.gep(op, [m0_v])

        def iwv(v):
            return builder.trunc(v, iw) if iw.width < 64 else v

        builder.call(fptr, [ir.Constant(i32, _CBLAS_ROW_MAJOR), ir.Constant(i32, _CBLAS_NO_TRANS),
                            ir.Constant(i32, _CBLAS_TRANS), iwv(n_v), iwv(t_v), iwv(k_v),
                            ir.Constant(ir.FloatType(), 1.0), xp, iwv(k_v), wp, iwv(k_v),
                            ir.Constant(ir.FloatType(), 0.0), cp, iwv(ldc)])
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, cache=True, nogil=True)
def gemm_tiles(fn, wide, qt, wdata, x, out, wbuf, tile):
    """out = x @ dequant(W).T: tiles of `tile` W rows handed out to the pool
    (chunk size 1, set by the caller), each dequantized into the worker's own
    slice of wbuf [threads, tile, K] and multiplied by sgemm in that worker."""
    M = wdata.shape[0]
    n, K = x.shape
    ntiles = (M + tile - 1) // tile
    for ti in prange(ntiles):
        w = wbuf[numba.get_thread_id()]
        m0 = ti * tile
        t = min(M, m0 + tile) - m0
        for i in range(t):
            deq_row(qt, wdata[m0 + i], w[i], 32)
        if wide:
            _sgemm_xwT(fn, True, n, t, K, x, w, out, m0)
        else:
            _sgemm_xwT(fn, False, n, t, K, x, w, out, m0)


def tile_rows(M: int, threads: int, most: int = 256) -> int:
    """Rows per tile: at most `most` (a float32 tile of 256 rows x K <= 1536
    stays in a Zen4/Skylake L2), and at least two tiles per thread so the
    pool's dynamic hand-out can even out a descheduled thread; multiples of 16
    for the sgemm's register blocking."""
    per = -(-M // (2 * threads))
    return max(16, min(most, -(-per // 16) * 16))
