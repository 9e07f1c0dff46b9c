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
def _quantize_block(xr, o, L, q, qo):
    """Round xr[o:o+L] to int8 range with step amax/127 into q[qo:qo+L] (an int16
    or int8 array: the codes fit both); returns the step."""
    amax = F32(0.0)
    for i in range(L):
        amax = max(amax, abs(xr[o + i]))
    if amax == F32(0.0):
        for i in range(L):
            q[qo + i] = 0
        return F32(0.0)
    idv = F32(127.0) / amax
    for i in range(L):
        q[qo + i] = np.rint(xr[o + i] * idv)
    return amax / F32(127.0)


@njit(cache=True)
def quantize_q8_32(x, xq, xd, xs):
    """x f32 [n, K] -> xq int16 [n, K], xd f32 [n, K/32] steps, xs f32 [n, K/32] = xd * sum(q)."""
    n, K = x.shape
    for r in range(n):
        xr = x[r]
        xq_r = xq[r]
        for b in range(K // 32):
            d = _quantize_block(xr, b * 32, 32, xq_r, b * 32)
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
            xd[r, b] = _quantize_block(xr, b * 256, 256, xq_r, b * 256)
        for j in range(K // 32):
            s = 0
            for i in range(32):
                s += xq_r[j * 32 + i]
            xb[r, j] = s


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
            d = _quantize_block(xr, b * 32, 32, xq, o)
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
            xd[r * nsb + b] = _quantize_block(xr, b * 256, 256, xq, r * K + b * 256)
        for j in range(K // 16):
            s = 0
            for i in range(16):
                s += np.int32(xq[r * K + j * 16 + i])
            xb16[r * (K // 16) + j] = s
        for j in range(K // 32):
            xb[r * (K // 32) + j] = xb16[r * (K // 16) + 2 * j] + xb16[r * (K // 16) + 2 * j + 1]


@njit(inline="always")
def _grp_r(n):
    t = n - 16 * ((n - 1) // 16)
    return 4 if t <= 4 else 8 if t <= 8 else 16


@njit(inline="always")
def _group_codes(xq, n, K, xg):
    """Flat int8 codes [n*K] -> row groups of 16 (the last of R = 4, 8 or 16
    rows), group gi at xg[gi*16*K:]: chunk c of a group (64 bytes) holds
    codes c*4G..c*4G+4G-1 of each of its R rows, G = 16 // R."""
    ng = (n + 15) // 16
    for gi in range(ng):
        R = 16 if gi < ng - 1 else _grp_r(n)
        G = 16 // R
        base = gi * 16 * K
        for c in range(K // (4 * G)):
            for r in range(R):
                row = gi * 16 + r
                o = base + c * 64 + r * 4 * G
                if row < n:
                    src = row * K + c * 4 * G
                    for t in range(4 * G):
                        xg[o + t] = xq[src + t]
                else:
                    for t in range(4 * G):
                        xg[o + t] = 0


@njit(cache=True)
def group_q8_32(n, K, xq, xd, xsum, xs, xg, xdg, xsumg, xsg):
    """Regroup quantize_q8_32_i8's flat outputs for vnni.leg_grp: codes as
    _group_codes, lane arrays [ng, nb*16] (blocks b..b+G-1, b a multiple of
    G, in one 16-lane vector: block b+t of row r in lane r*G + t): xdg
    steps, xsumg code sums, xsg = xd * xsum."""
    _group_codes(xq, n, K, xg)
    nb = K // 32
    ng = (n + 15) // 16
    xdg[:ng * nb * 16] = 0
    xsumg[:ng * nb * 16] = 0
    xsg[:ng * nb * 16] = 0
    for row in range(n):
        gi = row // 16
        R = 16 if gi < ng - 1 else _grp_r(n)
        G = 16 // R
        for b in range(nb):
            # block b of row r: vector b // G, lane r*G + b % G
            i = gi * nb * 16 + (b // G) * 16 + (row % 16) * G + b % G
            xdg[i] = xd[row * nb + b]
            xsumg[i] = xsum[row * nb + b]
            xsg[i] = xs[row * nb + b]
