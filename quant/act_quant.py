"""8-bit quantization of activations for the integer-dot matmul kernels.

The weight kernels multiply small integers; x is rounded to int8 values per
block (kept in int16 storage because LLVM turns int16 x int16 -> int32
reductions into vpdpwssd / vpmaddwd, while int8 x uint8 patterns written in
Numba are not matched to vpdpbusd):
* 32-element blocks for the 32-element formats (like ggml's Q8_0/Q8_1):
  scale d per block and s = d * sum(q) for formats with an offset or a min;
* 256-element blocks for the K-quants (like ggml's Q8_K): one scale per
  super-block and integer sums per 32 for the mins.
Rows are quantized independently, so row r's codes do not depend on the
other rows (batch invariance).
"""
from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32


@njit(inline="always")
def _quantize_block(xr, o, L, xq_r):
    """Round xr[o:o+L] to int8 range with step amax/127; returns the step."""
    amax = F32(0.0)
    for i in range(L):
        amax = max(amax, abs(xr[o + i]))
    if amax == F32(0.0):
        for i in range(L):
            xq_r[o + i] = 0
        return F32(0.0)
    idv = F32(127.0) / amax
    for i in range(L):
        xq_r[o + i] = np.int16(np.rint(xr[o + i] * idv))
    return amax / F32(127.0)


@njit(cache=True)
def quantize_q8_32(x, xq, xd, xs):
    """x f32 [n, K] -> xq int16 [n, K], xd f32 [n, K/32] steps, xs f32 [n, K/32] = xd * sum(q)."""
    n, K = x.shape
    for r in range(n):
        xr = x[r]
        xq_r = xq[r]
        for b in range(K // 32):
            d = _quantize_block(xr, b * 32, 32, xq_r)
            s = 0
            for i in range(32):
                s += xq_r[b * 32 + i]
            xd[r, b] = d
            xs[r, b] = d * F32(s)


@njit(cache=True)
def quantize_q8_256(x, xq, xd, xb):
    """x f32 [n, K] -> xq int16 [n, K], xd f32 [n, K/256], xb int32 [n, K/32] sums of q per 32."""
    n, K = x.shape
    for r in range(n):
        xr = x[r]
        xq_r = xq[r]
        for b in range(K // 256):
            xd[r, b] = _quantize_block(xr, b * 256, 256, xq_r)
        for j in range(K // 32):
            s = 0
            for i in range(32):
                s += xq_r[j * 32 + i]
            xb[r, j] = s
