"""Integer-dot matmul kernels for the K-quants (Q4_K, Q5_K, Q6_K).

Per 256-element super-block of a W row, the 4/5/6-bit codes are multiplied by
their (integer) sub-block scales into a 256 x int16 scratch block (|q*sc| <=
4064), which is then dotted with every activation row's int8 codes as one
int32 reduction over 256 elements - LLVM emits vpdpwssd/vpmaddwd for it - and
scaled once per super-block by d * dx (and the mins by dmin * dx).  So each
weight block is decoded once for all n rows, and rows are never mixed: the
float operations that produce y[r, m] are the same whatever n is.

Arguments of rows_*: w uint8 [M, row_nbytes] (read-only); xq int16 [n, K],
xd f32 [n, K/256], xb int32 [n, K/32] from act_quant.quantize_q8_256; out f32
[n, M]; one worker's scratch a f32 [n], wb int16 [256], mb int32 [8]; W rows
m0..m1-1.  par_* run nch chunks of rows in parallel with scratch [nch, ...].

Measured alternatives (single thread, 1024x4096, min of 40): decoding the
whole row first and accumulating float lanes with simd-style vpmaddwd (as
kernels_legacy does) was 25% slower at n=1 and n=8 than this per-super-block
scratch whose 256-long int32 loop LLVM turns into VNNI vpdpwssd.  The decode
loops keep literal trip counts: LLVM's SLP vectorizer handles these bodies
(vpmullw), and a runtime count measured 15-70% slower.
"""
from __future__ import annotations

import numpy as np
from numba import int16, int32, njit, prange

from .dequant import _h, scale_min_k4

F32 = np.float32


@njit(inline="always")
def _dot256(wb, xr, o):
    s = int32(0)
    for i in range(256):
        s = int32(s + int32(wb[i]) * int32(xr[o + i]))
    return s


@njit(inline="always")
def _rows_q4k_like(n, xq, xd, xb, a, wb, mb, sb, d, dmin):
    for r in range(n):
        xr = xq[r]
        isum = _dot256(wb, xr, sb * 256)
        msum = int32(0)
        for j in range(8):
            msum += mb[j] * xb[r, sb * 8 + j]
        dx = xd[r, sb]
        a[r] += (d * dx) * F32(isum) - (dmin * dx) * F32(msum)


# rows_q4_k and rows_q5_k share all but their decode loop (the header, scales, mins and
# the per-row dot: _rows_q4k_like), yet stay two kernels: that loop is the hot one, one
# body a bit layout with literal trip counts for LLVM's SLP vectorizer (the module note),
# and a merged body is a change to measure on a quiet machine, not to make blind.
@njit(cache=True, fastmath=True, nogil=True)
def rows_q4_k(w, xq, xd, xb, out, a, wb, mb, m0, m1):
    """W rows [m0, m1) of out = x @ W.T (a, wb, mb: this worker's scratch)."""
    n = xq.shape[0]
    nsb = xq.shape[1] // 256
    for m in range(m0, m1):
        src = w[m]
        for r in range(n):
            a[r] = F32(0.0)
        for sb in range(nsb):
            o = sb * 144
            d = _h(src, o)
            dmin = _h(src, o + 2)
            for g in range(4):
                sc0, mn0 = scale_min_k4(2 * g, src, o + 4)
                sc1, mn1 = scale_min_k4(2 * g + 1, src, o + 4)
                mb[2 * g] = mn0
                mb[2 * g + 1] = mn1
                s0 = int16(sc0)
                s1 = int16(sc1)
                q = o + 16 + 32 * g
                for l in range(32):
                    v = src[q + l]
                    wb[64 * g + l] = int16(v & 15) * s0
                    wb[64 * g + 32 + l] = int16(v >> 4) * s1
            _rows_q4k_like(n, xq, xd, xb, a, wb, mb, sb, d, dmin)
        for r in range(n):
            out[r, m] = a[r]


@njit(cache=True, fastmath=True, nogil=True)
def rows_q5_k(w, xq, xd, xb, out, a, wb, mb, m0, m1):
    """W rows [m0, m1) of out = x @ W.T (a, wb, mb: this worker's scratch)."""
    n = xq.shape[0]
    nsb = xq.shape[1] // 256
    for m in range(m0, m1):
        src = w[m]
        for r in range(n):
            a[r] = F32(0.0)
        for sb in range(nsb):
            o = sb * 176
            d = _h(src, o)
            dmin = _h(src, o + 2)
            for g in range(4):
                sc0, mn0 = scale_min_k4(2 * g, src, o + 4)
                sc1, mn1 = scale_min_k4(2 * g + 1, src, o + 4)
                mb[2 * g] = mn0
                mb[2 * g + 1] = mn1
                s0 = int16(sc0)
                s1 = int16(sc1)
                q = o + 48 + 32 * g
                for l in range(32):
                    v = src[q + l]
                    h = src[o + 16 + l]
                    v0 = int16(v & 15) | (int16((h >> (2 * g)) & 1) << 4)
                    v1 = int16(v >> 4) | (int16((h >> (2 * g + 1)) & 1) << 4)
                    wb[64 * g + l] = v0 * s0
                    wb[64 * g + 32 + l] = v1 * s1
            _rows_q4k_like(n, xq, xd, xb, a, wb, mb, sb, d, dmin)
        for r in range(n):
            out[r, m] = a[r]


# no fastmath: with it LLVM contracted the float update differently where the serial and
# the threaded callers inline this kernel (AVX2 hosts: rows 1e-6 apart), and a row's
# result must not depend on how the rows are split over threads
@njit(cache=True, nogil=True)
def rows_q6_k(w, xq, xd, xb, out, a, wb, mb, m0, m1):
    """W rows [m0, m1) of out = x @ W.T (a, wb, mb: this worker's scratch)."""
    n = xq.shape[0]
    nsb = xq.shape[1] // 256
    for m in range(m0, m1):
        src = w[m]
        for r in range(n):
            a[r] = F32(0.0)
        for sb in range(nsb):
            o = sb * 210
            d = _h(src, o + 208)
            for half in range(2):
                ql = o + 64 * half
                qh = o + 128 + 32 * half
                sc = o + 192 + 8 * half
                base = 128 * half
                for i in range(2):
                    s0 = int16(np.int8(src[sc + i]))
                    s1 = int16(np.int8(src[sc + i + 2]))
                    s2 = int16(np.int8(src[sc + i + 4]))
                    s3 = int16(np.int8(src[sc + i + 6]))
                    for t in range(16):
                        l = 16 * i + t
                        a0 = src[ql + l]
                        a1 = src[ql + l + 32]
                        h = src[qh + l]
                        wb[base + l] = ((int16(a0 & 15) | (int16(h & 3) << 4)) - 32) * s0
                        wb[base + l + 32] = ((int16(a1 & 15) | (int16((h >> 2) & 3) << 4)) - 32) * s1
                        wb[base + l + 64] = ((int16(a0 >> 4) | (int16((h >> 4) & 3) << 4)) - 32) * s2
                        wb[base + l + 96] = ((int16(a1 >> 4) | (int16((h >> 6) & 3) << 4)) - 32) * s3
            for r in range(n):
                isum = _dot256(wb, xq[r], sb * 256)
                a[r] += (d * xd[r, sb]) * F32(isum)
        for r in range(n):
            out[r, m] = a[r]


# One par_ and one multi_ wrapper a type, written out (kernels_k and kernels_legacy alike):
# each must be its own cached Numba function that calls its rows_ kernel by name, so LLVM
# sees one callee in the parallel region.  A factory closing over rows_* is not cached
# across runs (Numba hashes a closure's pickled cells, and a Dispatcher pickles with a
# uuid4 of its process), and a type switch inside the prange, or the kernel passed as an
# argument, changes what LLVM inlines where (rows_q6_k's note: results moved by 1e-6).
@njit(parallel=True, cache=True, nogil=True)
def par_q4_k(w, xq, xd, xb, out, acc, wbuf, mbuf, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q4_k(w, xq, xd, xb, out, acc[c], wbuf[c], mbuf[c], c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def par_q5_k(w, xq, xd, xb, out, acc, wbuf, mbuf, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q5_k(w, xq, xd, xb, out, acc[c], wbuf[c], mbuf[c], c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def par_q6_k(w, xq, xd, xb, out, acc, wbuf, mbuf, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q6_k(w, xq, xd, xb, out, acc[c], wbuf[c], mbuf[c], c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def multi_q4_k(ws, xq, xd, xb, outs, acc, wbuf, mbuf, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        rows_q4_k(ws[cw[c]], xq, xd, xb, outs[cw[c]], acc[c], wbuf[c], mbuf[c], cm0[c], cm1[c])


@njit(parallel=True, cache=True, nogil=True)
def multi_q5_k(ws, xq, xd, xb, outs, acc, wbuf, mbuf, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        rows_q5_k(ws[cw[c]], xq, xd, xb, outs[cw[c]], acc[c], wbuf[c], mbuf[c], cm0[c], cm1[c])


@njit(parallel=True, cache=True, nogil=True)
def multi_q6_k(ws, xq, xd, xb, outs, acc, wbuf, mbuf, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        rows_q6_k(ws[cw[c]], xq, xd, xb, outs[cw[c]], acc[c], wbuf[c], mbuf[c], cm0[c], cm1[c])
