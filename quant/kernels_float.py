"""Matmul kernels for the float weight types (F32, F16, BF16).

x stays float32 (there is nothing to gain from quantizing it: the weights are
not integers).  F16/BF16 rows are widened into a float32 scratch row once
(vcvtph2ps / a 16-bit shift, vectorized) and dotted with every activation row;
F32 rows are dotted in place.  The dot is a single fastmath loop over K, so
its summation order depends only on K: row r's result is the same for any n.

w is the weight matrix viewed as float32 [M, K] (F32) or uint16 [M, K]
(F16, BF16 with bf16=True); buf float32 [K] is one worker's scratch.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .dequant import deq_row
from .half import bits_to_f32, f16_to_f32

F32 = np.float32


@njit(inline="always")
def _dots(x, wr, out, m):
    K = x.shape[1]
    for r in range(x.shape[0]):
        xr = x[r]
        s = F32(0.0)
        for k in range(K):
            s += xr[k] * wr[k]
        out[r, m] = s


@njit(cache=True, fastmath=True, nogil=True)
def rows_f32(x, w, out, m0, m1):
    for m in range(m0, m1):
        _dots(x, w[m], out, m)


@njit(cache=True, fastmath=True, nogil=True)
def rows_f16(x, w, out, buf, bf16, m0, m1):
    K = x.shape[1]
    for m in range(m0, m1):
        src = w[m]
        if bf16:
            for k in range(K):
                buf[k] = bits_to_f32(np.uint32(src[k]) << np.uint32(16))
        else:
            for k in range(K):
                buf[k] = f16_to_f32(src[k])
        _dots(x, buf, out, m)


@njit(parallel=True, cache=True, nogil=True)
def par_f32(x, w, out, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_f32(x, w, out, c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def par_f16(x, w, out, bufs, bf16, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_f16(x, w, out, bufs[c], bf16, c * per, min(M, (c + 1) * per))


@njit(cache=True, fastmath=True, nogil=True)
def rows_dequant_fma(qt, x, w, out, buf, L, m0, m1):
    """The float-FMA alternative for quantized W (benchmark comparison only):
    dequantize each row exactly (dequant.deq_row) into buf, FMA with float x."""
    for m in range(m0, m1):
        deq_row(qt, w[m], buf, L)
        _dots(x, buf, out, m)


@njit(parallel=True, cache=True, nogil=True)
def par_dequant_fma(qt, x, w, out, bufs, L, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_dequant_fma(qt, x, w, out, bufs[c], L, c * per, min(M, (c + 1) * per))
