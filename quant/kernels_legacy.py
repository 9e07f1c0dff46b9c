"""Integer-dot matmul kernels for the 32-element formats (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0).

Each W row is decoded once into an int16 scratch row of signed codes plus a
float scale (and, for Q4_1/Q5_1, a float min) per block; then for every
activation row and block an int32 dot of 32 codes with the row's int8 codes
(act_quant.quantize_q8_32) is scaled by d_w * d_x, plus m_w * s_x for the
mins.

Every short inner loop runs to a *runtime* trip count `L` (always 32) or L/2:
with a literal 32 LLVM fully unrolls the loop first, and then the SLP
vectorizer gives up - on the reductions, and on the decode stores because it
cannot prove the int16 scratch and the weight bytes do not alias.  With a
runtime count the loop vectorizer handles both (it adds an alias check) and
emits vpmovzxbw/vpmaddwd: measured 6x faster decoding, 4x faster dots.

Arguments: w uint8 [M, row_nbytes] (read-only); xq int16 [n, K], xd, xs f32
[n, K/32]; out f32 [n, M]; wq int16 [K] and wf f32 [2, K/32] (scales, mins)
scratch of one worker; L = 32; rows m0..m1-1 of W.  par_* run nch chunks of
rows in parallel with per-chunk scratch wqbuf [nch, K], wfbuf [nch, 2, K/32].
"""
from __future__ import annotations

import numpy as np
from numba import int16, int32, njit, prange

from .dequant import _h, _u32

F32 = np.float32


@njit(inline="always")
def _rows(n, nb, xq, xd, out, m, wq, ws, L):
    for r in range(n):
        xr = xq[r]
        dr = xd[r]
        a = F32(0.0)
        for b in range(nb):
            o = b * 32
            s = int32(0)
            for i in range(L):
                s = int32(s + int32(wq[o + i]) * int32(xr[o + i]))
            a += (ws[b] * dr[b]) * F32(s)
        out[r, m] = a


@njit(inline="always")
def _rows_min(n, nb, xq, xd, xs, out, m, wq, ws, wm, L):
    for r in range(n):
        xr = xq[r]
        dr = xd[r]
        sr = xs[r]
        a = F32(0.0)
        for b in range(nb):
            o = b * 32
            s = int32(0)
            for i in range(L):
                s = int32(s + int32(wq[o + i]) * int32(xr[o + i]))
            a += (ws[b] * dr[b]) * F32(s) + wm[b] * sr[b]
        out[r, m] = a


@njit(cache=True, fastmath=True)
def rows_q4_0(w, xq, xd, xs, out, wq, wf, L, m0, m1):
    """W rows [m0, m1) of out = x @ W.T (wq, wf: this worker's scratch)."""
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    H = L // 2
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            o = b * 18
            ws[b] = _h(src, o)
            for j in range(H):
                v = src[o + 2 + j]
                wq[b * 32 + j] = int16(v & 15) - 8
                wq[b * 32 + 16 + j] = int16(v >> 4) - 8
        _rows(n, nb, xq, xd, out, m, wq, ws, L)


@njit(cache=True, fastmath=True)
def rows_q4_1(w, xq, xd, xs, out, wq, wf, L, m0, m1):
    """W rows [m0, m1) of out = x @ W.T (wq, wf: this worker's scratch)."""
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    wm = wf[1]
    H = L // 2
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            o = b * 20
            ws[b] = _h(src, o)
            wm[b] = _h(src, o + 2)
            for j in range(H):
                v = src[o + 4 + j]
                wq[b * 32 + j] = int16(v & 15)
                wq[b * 32 + 16 + j] = int16(v >> 4)
        _rows_min(n, nb, xq, xd, xs, out, m, wq, ws, wm, L)


@njit(cache=True, fastmath=True)
def rows_q5_0(w, xq, xd, xs, out, wq, wf, L, m0, m1):
    """W rows [m0, m1) of out = x @ W.T (wq, wf: this worker's scratch)."""
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    H = L // 2
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            o = b * 22
            ws[b] = _h(src, o)
            qh = _u32(src, o + 2)
            for j in range(H):
                v = src[o + 6 + j]
                h0 = int16((qh >> np.uint32(j)) & np.uint32(1)) << 4
                h1 = int16((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
                wq[b * 32 + j] = (int16(v & 15) | h0) - 16
                wq[b * 32 + 16 + j] = (int16(v >> 4) | h1) - 16
        _rows(n, nb, xq, xd, out, m, wq, ws, L)


@njit(cache=True, fastmath=True)
def rows_q5_1(w, xq, xd, xs, out, wq, wf, L, m0, m1):
    """W rows [m0, m1) of out = x @ W.T (wq, wf: this worker's scratch)."""
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    wm = wf[1]
    H = L // 2
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            o = b * 24
            ws[b] = _h(src, o)
            wm[b] = _h(src, o + 2)
            qh = _u32(src, o + 4)
            for j in range(H):
                v = src[o + 8 + j]
                h0 = int16((qh >> np.uint32(j)) & np.uint32(1)) << 4
                h1 = int16((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
                wq[b * 32 + j] = int16(v & 15) | h0
                wq[b * 32 + 16 + j] = int16(v >> 4) | h1
        _rows_min(n, nb, xq, xd, xs, out, m, wq, ws, wm, L)


@njit(cache=True, fastmath=True)
def rows_q8_0(w, xq, xd, xs, out, wq, wf, L, m0, m1):
    """W rows [m0, m1) of out = x @ W.T (wq, wf: this worker's scratch)."""
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    H = L // 2
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            o = b * 34
            ws[b] = _h(src, o)
            for j in range(L):
                wq[b * 32 + j] = int16(np.int8(src[o + 2 + j]))
        _rows(n, nb, xq, xd, out, m, wq, ws, L)


@njit(parallel=True, cache=True)
def par_q4_0(w, xq, xd, xs, out, wqbuf, wfbuf, L, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q4_0(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], L, c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True)
def par_q4_1(w, xq, xd, xs, out, wqbuf, wfbuf, L, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q4_1(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], L, c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True)
def par_q5_0(w, xq, xd, xs, out, wqbuf, wfbuf, L, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q5_0(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], L, c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True)
def par_q5_1(w, xq, xd, xs, out, wqbuf, wfbuf, L, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q5_1(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], L, c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True)
def par_q8_0(w, xq, xd, xs, out, wqbuf, wfbuf, L, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q8_0(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], L, c * per, min(M, (c + 1) * per))
