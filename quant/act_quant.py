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


@njit(inline="always")
def _quantize_block_i8(xr, o, L, q, qo):
    """As _quantize_block, into int8 q[qo:qo+L]; returns (step, sum of codes)."""
    amax = F32(0.0)
    for i in range(L):
        amax = max(amax, abs(xr[o + i]))
    if amax == F32(0.0):
        for i in range(L):
            q[qo + i] = 0
        return F32(0.0)
    idv = F32(127.0) / amax
    for i in range(L):
        q[qo + i] = np.int8(np.rint(xr[o + i] * idv))
    return amax / F32(127.0)


@njit(cache=True)
def quantize_q8_32_i8(x, xq, xd, xsum, xs):
    """For the VNNI kernels: x f32 [n, K] -> xq int8 [n*K] (flat), and flat
    [n*K/32] xd steps, xsum int32 code sums, xs = xd * xsum.  Same codes and
    steps as quantize_q8_32."""
    n, K = x.shape
    nb = K // 32
    for r in range(n):
        xr = x[r]
        for b in range(nb):
            o = r * K + b * 32
            d = _quantize_block_i8(xr, b * 32, 32, xq, o)
            s = 0
            for i in range(32):
                s += np.int32(xq[o + i])
            xd[r * nb + b] = d
            xsum[r * nb + b] = s
            xs[r * nb + b] = d * F32(s)


@njit(cache=True)
def quantize_q8_256_i8(x, xq, xd, xb, xb16):
    """For the VNNI kernels, all flat: x f32 [n, K] -> xq int8 [n*K], xd f32
    [n*K/256], code sums xb int32 [n*K/32] and xb16 int32 [n*K/16]."""
    n, K = x.shape
    nsb = K // 256
    for r in range(n):
        xr = x[r]
        for b in range(nsb):
            xd[r * nsb + b] = _quantize_block_i8(xr, b * 256, 256, xq, r * K + b * 256)
        for j in range(K // 16):
            s = 0
            for i in range(16):
                s += np.int32(xq[r * K + j * 16 + i])
            xb16[r * (K // 16) + j] = s
        for j in range(K // 32):
            xb[r * (K // 32) + j] = xb16[r * (K // 16) + 2 * j] + xb16[r * (K // 16) + 2 * j + 1]
