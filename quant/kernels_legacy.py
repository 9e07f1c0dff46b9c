"""Integer-dot matmul kernels for the 32-element formats (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, MXFP4).

Each W row is decoded once (simd.unpack_*: a few vector instructions per
block) into an int16 scratch row of codes plus a float scale (and, for
Q4_1/Q5_1, a float min) per block.  Then for every activation row, block by
block, simd.madd_acc adds scale_w * scale_x * (pairwise int32 products of
the 32 codes with the row's int8 codes from act_quant.quantize_q8_32) into 16
float lanes - as llama.cpp's AVX kernels do, no horizontal sum per block.  Two
lane sets alternate between even and odd blocks to halve the FMA dependency
chain; the 32 lanes are summed once per output in a fixed tree (simd.hsum32),
and the mins add m_w * s_x per block.  Nothing here depends on n or on the
other rows: batch invariant.

Arguments of rows_*: w uint8 [M, row_nbytes] (read-only); xq int16 [n, K],
xd, xs f32 [n, K/32]; out f32 [n, M]; one worker's scratch wq int16 [K],
wf f32 [2, K/32] (scales, mins), acc f32 [32]; W rows m0..m1-1.  par_* run
nch chunks of rows in parallel with per-chunk scratch [nch, ...].
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .dequant import _KV_MXFP4, _h, _u32, e8m0_half
from .simd import hsum32, madd_acc, unpack_nibbles, unpack_nibbles_5, widen_i8

F32 = np.float32


@njit(inline="always")
def _lanes(acc, wq, xr, ws, dr, nb):
    for i in range(32):
        acc[i] = F32(0.0)
    # two blocks per iteration at fixed lane offsets, so LLVM keeps both lane
    # sets in registers (checked in the asm); with a computed offset
    # (b & 1) * 16 each block reloaded its lanes from the store of two blocks
    # before, putting store-forwarding latency on the dependency chain
    for b2 in range(nb // 2):
        b = 2 * b2
        madd_acc(acc, 0, wq, b * 32, xr, b * 32, ws[b] * dr[b])
        madd_acc(acc, 16, wq, b * 32 + 32, xr, b * 32 + 32, ws[b + 1] * dr[b + 1])
    if nb & 1:
        b = nb - 1
        madd_acc(acc, 0, wq, b * 32, xr, b * 32, ws[b] * dr[b])
    return hsum32(acc)


@njit(inline="always")
def _rows(n, nb, xq, xd, out, m, wq, ws, acc):
    for r in range(n):
        out[r, m] = _lanes(acc, wq, xq[r], ws, xd[r], nb)


@njit(inline="always")
def _rows_min(n, nb, xq, xd, xs, out, m, wq, ws, wm, acc):
    for r in range(n):
        a = _lanes(acc, wq, xq[r], ws, xd[r], nb)
        sr = xs[r]
        t = F32(0.0)
        for b in range(nb):
            t += wm[b] * sr[b]
        out[r, m] = a + t


@njit(cache=True, fastmath=True, nogil=True)
def rows_q4_0(w, xq, xd, xs, out, wq, wf, acc, m0, m1):
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            ws[b] = _h(src, b * 18)
            unpack_nibbles(src, b * 18 + 2, wq, b * 32, 8)
        _rows(n, nb, xq, xd, out, m, wq, ws, acc)


@njit(cache=True, fastmath=True, nogil=True)
def rows_q4_1(w, xq, xd, xs, out, wq, wf, acc, m0, m1):
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    wm = wf[1]
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            ws[b] = _h(src, b * 20)
            wm[b] = _h(src, b * 20 + 2)
            unpack_nibbles(src, b * 20 + 4, wq, b * 32, 0)
        _rows_min(n, nb, xq, xd, xs, out, m, wq, ws, wm, acc)


@njit(cache=True, fastmath=True, nogil=True)
def rows_q5_0(w, xq, xd, xs, out, wq, wf, acc, m0, m1):
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            ws[b] = _h(src, b * 22)
            unpack_nibbles_5(src, b * 22 + 6, _u32(src, b * 22 + 2), wq, b * 32, 16)
        _rows(n, nb, xq, xd, out, m, wq, ws, acc)


@njit(cache=True, fastmath=True, nogil=True)
def rows_q5_1(w, xq, xd, xs, out, wq, wf, acc, m0, m1):
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    wm = wf[1]
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            ws[b] = _h(src, b * 24)
            wm[b] = _h(src, b * 24 + 2)
            unpack_nibbles_5(src, b * 24 + 8, _u32(src, b * 24 + 4), wq, b * 32, 0)
        _rows_min(n, nb, xq, xd, xs, out, m, wq, ws, wm, acc)


@njit(cache=True, fastmath=True, nogil=True)
def rows_q8_0(w, xq, xd, xs, out, wq, wf, acc, m0, m1):
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            ws[b] = _h(src, b * 34)
            widen_i8(src, b * 34 + 2, wq, b * 32)
        _rows(n, nb, xq, xd, out, m, wq, ws, acc)


@njit(cache=True, fastmath=True, nogil=True)
def rows_mxfp4(w, xq, xd, xs, out, wq, wf, acc, m0, m1):
    """MXFP4: the codes are ggml's doubled E2M1 values (int8, |v| <= 12) by table lookup,
    the block's scale its E8M0 byte as e8m0_half."""
    n = xq.shape[0]
    nb = xq.shape[1] // 32
    ws = wf[0]
    for m in range(m0, m1):
        src = w[m]
        for b in range(nb):
            o = b * 17
            ws[b] = e8m0_half(src[o])
            for j in range(16):
                q = src[o + 1 + j]
                wq[b * 32 + j] = _KV_MXFP4[q & 15]
                wq[b * 32 + 16 + j] = _KV_MXFP4[q >> 4]
        _rows(n, nb, xq, xd, out, m, wq, ws, acc)


# One par_ and one multi_ wrapper a type, written out (kernels_k and kernels_legacy alike):
# each must be its own cached Numba function that calls its rows_ kernel by name, so LLVM
# sees one callee in the parallel region.  A factory closing over rows_* is not cached
# across runs (Numba hashes a closure's pickled cells, and a Dispatcher pickles with a
# uuid4 of its process), and a type switch inside the prange, or the kernel passed as an
# argument, changes what LLVM inlines where (rows_q6_k's note: results moved by 1e-6).
@njit(parallel=True, cache=True, nogil=True)
def par_q4_0(w, xq, xd, xs, out, wqbuf, wfbuf, accbuf, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q4_0(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], accbuf[c], c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def par_q4_1(w, xq, xd, xs, out, wqbuf, wfbuf, accbuf, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q4_1(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], accbuf[c], c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def par_q5_0(w, xq, xd, xs, out, wqbuf, wfbuf, accbuf, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q5_0(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], accbuf[c], c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def par_q5_1(w, xq, xd, xs, out, wqbuf, wfbuf, accbuf, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q5_1(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], accbuf[c], c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def par_q8_0(w, xq, xd, xs, out, wqbuf, wfbuf, accbuf, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_q8_0(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], accbuf[c], c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def par_mxfp4(w, xq, xd, xs, out, wqbuf, wfbuf, accbuf, nch):
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        rows_mxfp4(w, xq, xd, xs, out, wqbuf[c], wfbuf[c], accbuf[c], c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def multi_q4_0(ws, xq, xd, xs, outs, wqbuf, wfbuf, accbuf, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        rows_q4_0(ws[cw[c]], xq, xd, xs, outs[cw[c]], wqbuf[c], wfbuf[c], accbuf[c], cm0[c], cm1[c])


@njit(parallel=True, cache=True, nogil=True)
def multi_q4_1(ws, xq, xd, xs, outs, wqbuf, wfbuf, accbuf, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        rows_q4_1(ws[cw[c]], xq, xd, xs, outs[cw[c]], wqbuf[c], wfbuf[c], accbuf[c], cm0[c], cm1[c])


@njit(parallel=True, cache=True, nogil=True)
def multi_q5_0(ws, xq, xd, xs, outs, wqbuf, wfbuf, accbuf, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        rows_q5_0(ws[cw[c]], xq, xd, xs, outs[cw[c]], wqbuf[c], wfbuf[c], accbuf[c], cm0[c], cm1[c])


@njit(parallel=True, cache=True, nogil=True)
def multi_q5_1(ws, xq, xd, xs, outs, wqbuf, wfbuf, accbuf, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        rows_q5_1(ws[cw[c]], xq, xd, xs, outs[cw[c]], wqbuf[c], wfbuf[c], accbuf[c], cm0[c], cm1[c])


@njit(parallel=True, cache=True, nogil=True)
def multi_q8_0(ws, xq, xd, xs, outs, wqbuf, wfbuf, accbuf, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        rows_q8_0(ws[cw[c]], xq, xd, xs, outs[cw[c]], wqbuf[c], wfbuf[c], accbuf[c], cm0[c], cm1[c])


@njit(parallel=True, cache=True, nogil=True)
def multi_mxfp4(ws, xq, xd, xs, outs, wqbuf, wfbuf, accbuf, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        rows_mxfp4(ws[cw[c]], xq, xd, xs, outs[cw[c]], wqbuf[c], wfbuf[c], accbuf[c], cm0[c], cm1[c])
