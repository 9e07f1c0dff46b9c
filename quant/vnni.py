"""AVX-512 VNNI decode kernels (u8 x s8 -> int32, vpdpbusd), as llama.cpp's.

Generic Numba code never becomes vpdpbusd (LLVM does not match the u8 x s8
pattern), and the int16 kernels in kernels_legacy / kernels_k are compute
bound at a quarter of the memory bandwidth.  Here the inner loops are written
directly in LLVM IR with the target intrinsic `llvm.x86.avx512.vpdpbusd.256`
(EVEX-encoded, needs AVX512_VNNI + AVX512VL; Zen4, Ice Lake and later).  On
AVX2-only CPUs (Haswell, Zen 1-3) quant/ir.py spells each vpdpbusd as llama.cpp
does there (vpmaddubsw + vpmaddwd: the same integers, so the same bits) and the
512-bit vectors as pairs of 256-bit ones.  INT8_DOT says whether this CPU runs
them; nothing here is compiled otherwise (the int16 kernels remain the path for
other CPUs: ARM, x86-64 without AVX2).

How a weight block is used: its codes are unpacked to 32 unsigned bytes
(nibbles, nibbles + 5th bit, or Q8_0's int8 xor 0x80) and multiplied with the
activation row's int8 codes (act_quant.quantize_q8_*_i8) by vpdpbusd.  The
unsigned offset (8, 16, 128, 32 for Q6_K) comes back out exactly with the
row's integer block sum.  The one-row kernel takes blocks in pairs: codes 0-15
of both blocks (their low nibbles) in one 32-byte register, codes 16-31 in
another, against activations stored in that order (act_quant.pair_pos), so
no byte crosses a 128-bit half and the pair's lane sums reduce with in-half
shuffles: 56 instructions for 8 Q4_0 blocks where one block a register took
88 (Q4_0 0.86 -> 0.64 ns a block on one Zen4 core, Q4_1 0.91 -> 0.76, Q5_0
1.09 -> 0.98, Q8_0 0.72 -> 0.76; same results bit for bit).

32-element formats: up to LEG_ROWS_MAX activation rows (decode, a draft's
catch-up) leg_rows (Q4_0 with K a multiple of 128: vnni_quad's 512-bit kernel, the
same bits), each W row decoded once for them all; more rows
(speculative verification, batched decode) leg_grp, the rows of a group in
the lanes of one zmm register and each W block decoded once for the whole
group (see "row groups" below).  K-quants (Q4_K, Q6_K): vnni_kq.kq_rows, up
to 8 activation rows per decode of a W super-block, any row count.

Exactness: for a given (row, output) the float operations are the same in
every kernel, whatever n is and whatever the other rows hold (batch
invariance), and the integer parts are exact.  The results differ from the
int16 kernels' in the last bits (different float summation order).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .act_quant import _grp_r as _grp_r_nb, group_q8_32, quantize_q8_256_i8, quantize_q8_32_i8, quantize_q8_32_quad
from .ir import HAVE_VNNI, I8_SIGNED, INT8_DOT  # noqa: F401  (this module's flags for its users: matmul_cpu, tests)
from .ir import (_c, _data, _f32, _fma_t, _fn, _i1, _i8, _i16, _i32, _i64, _literal, _load_vec, _shuf, _splat, _tree8,
                 _v8f32, _v8i32, _v16f32, _v16i8, _v16i32, _v32i8, _v64i8, _vpdpbusd, _vpdpbusd512, prefetch_span, vpdpwssd)
from .vnni_kq import kq_rows, kq_span1
from .vnni_quad import KIND as QUAD, quad_rows

F32 = np.float32

# Software prefetch of the 32-element formats' weight stream in the one-row and
# row-group kernels: (bytes ahead, llvm locality).  Without it they streamed at
# half of Q4_K's rate (which prefetches, vnni_kq._PREFETCH): Qwen2.5-0.5B's draft
# step with its matrices in Q4_0, Xeon (Emerald Rapids) 2 cores, 22.6-23.2 ms ->
# 11.2-16.7 ms.  1 KB into L1 and 2 KB into L2 measured between the two.
_LEG_PREFETCH = (4096, 2)

# Up to this many activation rows share one decode of a W row in the row kernel
# (leg_rows); more rows take the row-group kernel (leg_grp), whose smallest group
# is 4 rows.  Q4_0 9728x896 (a draft's catch-up), 2 rows: 0.35 ms in leg_rows
# against 0.45 in a 4-row group (one row 0.31); at 3 rows the group was as fast.
LEG_ROWS_MAX = 2


def _prefetch_blocks(builder, w, b0, t, BB):
    """Prefetch the bytes of blocks b0..b0+t-1 of the W row at w, _LEG_PREFETCH ahead."""
    prefetch_span(builder, w, builder.mul(b0, _c(BB)), t * BB, *_LEG_PREFETCH)


# legacy kinds: (block bytes, min offset or -1, qh offset or -1, qs offset, code kind, offset).
# MXFP4 (kind 6; 5 is vnni_quad's Q4_0) is one of them: its nibbles index a table of the
# doubled E2M1 values plus 12 (vpshufb: unsigned codes 0..24, the 12 taken back out with
# the code sum as Q4_0's 8 is), and its scale is an E8M0 byte, not an f16 (_scales8).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 = 0, 1, 2, 3, 4, 6
# Q8_0's codes xor 0x80 are unsigned with offset 128, or (I8_SIGNED: AVX2) stay signed, offset 0
# (_signed: the kinds whose codes the dots take as signed).
_LEG = {Q4_0: (18, -1, -1, 2, "nib", 8), Q4_1: (20, 2, -1, 4, "nib", 0),
        Q5_0: (22, -1, 2, 6, "nib5", 16), Q5_1: (24, 2, 4, 8, "nib5", 0),
        Q8_0: (34, -1, -1, 2, "i8", 0 if I8_SIGNED else 128), MXFP4: (17, -1, -1, 1, "mx", 12)}
LEG_KINDS = tuple(_LEG)


def _signed(k):
    return _LEG[k][4] == "i8" and I8_SIGNED
_MX_TABLE = [v + 12 for v in (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)]


def _nibbles(builder, q16):
    lo = builder.and_(q16, ir.Constant(_v16i8, [15] * 16))
    hi = builder.lshr(q16, ir.Constant(_v16i8, [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, 32), list(range(32))))


def _mx_lookup(builder, idx):
    """v32i8 of MXFP4 codes (0..15) -> their unsigned values (_MX_TABLE), vpshufb."""
    fn = _fn(builder, "llvm.x86.avx2.pshuf.b", _v32i8, [_v32i8, _v32i8])
    return builder.call(fn, [ir.Constant(_v32i8, _MX_TABLE * 2), idx])


def _e8m0_floats(builder, e):
    """<N x i8> E8M0 bytes -> <N x float>, dequant.e8m0_half's bits: 0x200000 << e for
    e < 2, else (e - 1) << 23."""
    n = e.type.count
    vi = ir.VectorType(_i32, n)
    e = builder.zext(e, vi)
    sub = builder.shl(ir.Constant(vi, [0x00200000] * n), e)
    nrm = builder.shl(builder.sub(e, ir.Constant(vi, [1] * n)), ir.Constant(vi, [23] * n))
    low = builder.icmp_unsigned("<", e, ir.Constant(vi, [2] * n))
    return builder.bitcast(builder.select(low, sub, nrm), ir.VectorType(_f32, n))


def _scale_bytes(builder, w, b0, t, n, BB):
    """<n x i8>: byte 0 (MXFP4's E8M0) of blocks b0..b0+t-1 of the row at w, 0 beyond."""
    v = ir.Constant(ir.VectorType(_i8, n), None)
    for j in range(t):
        p = builder.gep(w, [builder.mul(builder.add(b0, _c(j)), _c(BB))])
        v = builder.insert_element(v, builder.load(p), _c(j, _i32))
    return v


# ---------------------------------------------------------------- legacy rows

@njit(inline="always")
def _leg_all(kind, w, xq, xd, xsum, xs, out, res, n, K, m0, m1):
    """Rows r < n (flat activations) against W rows m0..m1-1, up to LEG_ROWS_MAX
    rows a decode of the W row; more rows normally run the row-group kernel
    (_grp_any) instead."""
    nb = K // 32
    if n == 1:      # decode: its own loop (through the general one: Q4_0 9728x896 0.33-0.36 ms against 0.26-0.33)
        for m in range(m0, m1):
            leg_rows(kind, 1, w[m], nb, xq, xd, xsum, xs, 0, K, res)
            out[0, m] = res[0]
        return
    for m in range(m0, m1):
        r = 0
        while r < n:
            t = min(n - r, LEG_ROWS_MAX)
            if t == 1:
                leg_rows(kind, 1, w[m], nb, xq, xd, xsum, xs, r, K, res)
            else:
                leg_rows(kind, 2, w[m], nb, xq, xd, xsum, xs, r, K, res)
            for i in range(t):
                out[r + i, m] = res[i]
            r += t


@njit(cache=True, nogil=True)
def rows_q4_0(w, xq, xd, xsum, xs, out, res, n, K, m0, m1):
    _leg_all(0, w, xq, xd, xsum, xs, out, res, n, K, m0, m1)


@njit(cache=True, nogil=True)
def rows_q4_1(w, xq, xd, xsum, xs, out, res, n, K, m0, m1):
    _leg_all(1, w, xq, xd, xsum, xs, out, res, n, K, m0, m1)


@njit(cache=True, nogil=True)
def rows_q5_0(w, xq, xd, xsum, xs, out, res, n, K, m0, m1):
    _leg_all(2, w, xq, xd, xsum, xs, out, res, n, K, m0, m1)


@njit(cache=True, nogil=True)
def rows_q5_1(w, xq, xd, xsum, xs, out, res, n, K, m0, m1):
    _leg_all(3, w, xq, xd, xsum, xs, out, res, n, K, m0, m1)


@njit(cache=True, nogil=True)
def rows_q8_0(w, xq, xd, xsum, xs, out, res, n, K, m0, m1):
    _leg_all(4, w, xq, xd, xsum, xs, out, res, n, K, m0, m1)


@njit(cache=True, nogil=True)
def rows_mxfp4(w, xq, xd, xsum, xs, out, res, n, K, m0, m1):
    _leg_all(6, w, xq, xd, xsum, xs, out, res, n, K, m0, m1)


# ---------------------------------------------------------------- K-quants

@njit(inline="always")
def _kq_all(kind, w, xq, xd, xb, out, res, n, K, m0, m1):
    """W rows m0..m1-1 against all n activation rows, up to 8 rows per decode
    of a W row (vnni_kq.kq_rows)."""
    nsb = K // 256
    if n == 1:       # decode: the loop over W rows inside the kernel
        kq_span1(kind, w, m0, m1, nsb, xq, xd, xb, K, out)
        return
    for m in range(m0, m1):
        src = w[m]
        r = 0
        while r + 8 <= n:
            kq_rows(kind, 8, src, nsb, xq, xd, xb, r, K, res)
            for i in range(8):
                out[r + i, m] = res[i]
            r += 8
        # the rest (1-7 rows: a speculative verify of k <= 6 drafts) in one pass
        t = n - r
        if t == 7:
            kq_rows(kind, 7, src, nsb, xq, xd, xb, r, K, res)
        elif t == 6:
            kq_rows(kind, 6, src, nsb, xq, xd, xb, r, K, res)
        elif t == 5:
            kq_rows(kind, 5, src, nsb, xq, xd, xb, r, K, res)
        elif t == 4:
            kq_rows(kind, 4, src, nsb, xq, xd, xb, r, K, res)
        elif t == 3:
            kq_rows(kind, 3, src, nsb, xq, xd, xb, r, K, res)
        elif t == 2:
            kq_rows(kind, 2, src, nsb, xq, xd, xb, r, K, res)
        elif t == 1:
            kq_rows(kind, 1, src, nsb, xq, xd, xb, r, K, res)
        for i in range(t):
            out[r + i, m] = res[i]


@njit(cache=True, nogil=True)
def rows_q4_k(w, xq4, xd, xbf, unused, out, res, n, K, m0, m1):
    """xq4, xd, xbf: flat outputs of act_quant.quantize_q8_256_i8 (the codes in
    Q4_K's order, xbf the step times the code sum per 32); `unused` keeps the
    legacy kernels' argument types."""
    _kq_all(0, w, xq4, xd, xbf, out, res, n, K, m0, m1)


@njit(cache=True, nogil=True)
def rows_q6_k(w, xq, xd, xb16, unused, out, res, n, K, m0, m1):
    """As rows_q4_k with xb16, the code sums per 16."""
    _kq_all(1, w, xq, xd, xb16, out, res, n, K, m0, m1)


@njit(inline="always")
def _rows_any(kind, w, xq, xd, xs1, xs2, out, res, n, K, m0, m1):
    """kind: 0-4 and 6 the 32-element formats (xs1 = xsum int32, xs2 = xs f32), 5 Q4_0 on
    vnni_quad's kernel (the same arrays, the codes in its order), 10
    Q4_K (xs1 = step x code sum per 32, f32) and 11 Q6_K (xs1 = code sums per
    16, int32); xs2 unused."""
    if kind == 0:
        rows_q4_0(w, xq, xd, xs1, xs2, out, res, n, K, m0, m1)
    elif kind == 1:
        rows_q4_1(w, xq, xd, xs1, xs2, out, res, n, K, m0, m1)
    elif kind == 2:
        rows_q5_0(w, xq, xd, xs1, xs2, out, res, n, K, m0, m1)
    elif kind == 3:
        rows_q5_1(w, xq, xd, xs1, xs2, out, res, n, K, m0, m1)
    elif kind == 4:
        rows_q8_0(w, xq, xd, xs1, xs2, out, res, n, K, m0, m1)
    elif kind == 6:
        rows_mxfp4(w, xq, xd, xs1, xs2, out, res, n, K, m0, m1)
    elif kind == QUAD:
        quad_rows(w, xq, xd, xs1, out, res, n, K, m0, m1)
    elif kind == 10:
        rows_q4_k(w, xq, xd, xs1, xs2, out, res, n, K, m0, m1)
    else:
        rows_q6_k(w, xq, xd, xs1, xs2, out, res, n, K, m0, m1)


@njit(cache=True, nogil=True)
def rows_any(kind, w, xq, xd, xs1, xs2, out, res, n, K, m0, m1):
    _rows_any(kind, w, xq, xd, xs1, xs2, out, res, n, K, m0, m1)


@njit(parallel=True, cache=True, nogil=True)
def par_any(kind, w, xq, xd, xs1, xs2, out, res, n, K, nch):
    """nch chunks of W rows in parallel; res f32 [nch, 4] per-chunk scratch."""
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        _rows_any(kind, w, xq, xd, xs1, xs2, out, res[c], n, K, c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def multi_any(kind, ws, xq, xd, xs1, xs2, outs, res, n, K, cw, cm0, cm1):
    """Several W (a tuple, same type and K) in one parallel region: chunk c is
    rows cm0[c]..cm1[c]-1 of ws[cw[c]]."""
    for c in prange(cw.size):
        _rows_any(kind, ws[cw[c]], xq, xd, xs1, xs2, outs[cw[c]], res[c], n, K, cm0[c], cm1[c])


@njit(parallel=True, cache=True, nogil=True)
def multi_kq(kinds, ws, xq, xq4, xd, xbf, xb16, outs, res, n, K, cw, cm0, cm1):
    """As multi_any for a mixture of Q4_K (kind 10) and Q6_K (kind 11) weights
    (Q4_K_M files mix them in q/k/v): one parallel region, each chunk with its
    own weight's kernel, on one activation quantization."""
    for c in prange(cw.size):
        i = cw[c]
        if kinds[i] == 10:
            rows_q4_k(ws[i], xq4, xd, xbf, xd, outs[i], res[c], n, K, cm0[c], cm1[c])
        else:
            rows_q6_k(ws[i], xq, xd, xb16, xd, outs[i], res[c], n, K, cm0[c], cm1[c])


@njit(cache=True, nogil=True)
def matvec_leg(kind, x, w, xq, xd, xsum, xs, out, res, fresh):
    """One serial call for a 32-element format: quantize x (when fresh) into
    the four activation buffers, then all W rows.  (One Numba dispatch instead
    of two: the per-call cost is a visible part of a small model's token.)"""
    n, K = x.shape
    if fresh:
        if kind == QUAD:    # vnni_quad's code order
            quantize_q8_32_quad(x, xq, xd, xsum, xs)
        else:
            quantize_q8_32_i8(x, xq, xd, xsum, xs)
    _rows_any(kind, w, xq, xd, xsum, xs, out, res, n, K, 0, w.shape[0])


@njit(cache=True, nogil=True)
def matvec_k(kind, x, w, xq, xq4, xd, xb, xb16, xbf, out, res, fresh):
    """As matvec_leg for Q4_K (kind 10) / Q6_K (kind 11)."""
    n, K = x.shape
    if fresh:
        quantize_q8_256_i8(x, xq, xq4, xd, xb, xb16, xbf)
    if kind == 10:
        _rows_any(kind, w, xq4, xd, xbf, xd, out, res, n, K, 0, w.shape[0])
    else:
        _rows_any(kind, w, xq, xd, xb16, xd, out, res, n, K, 0, w.shape[0])


# ---------------------------------------------------------------- row groups
#
# Several activation rows (2..16: speculative verification, batched decode)
# against one W row, the rows laid out in the 16 int32 lanes of a zmm
# register: a group of R = 4, 8 or 16 rows gives each row G = 16 / R lanes.
# act_quant.group_q8 interleaves the int8 codes so that one 64-byte load holds
# G dwords (4G codes) of each of the R rows; the W codes of those G dwords are
# broadcast R times, and one vpdpbusd does 4G multiply-adds for every row.
# Per-row values (scales, code sums) are "lane arrays": 16 lanes per block,
# row r's value in lane r*G, zeros elsewhere.  Lanes never mix, so every
# lane-wise float operation on lane r*G is exactly the scalar operation the
# one-row kernels do for row r (batch invariance across kernels), and rows
# beyond n (zero codes) only produce unused lanes.

GROUP_R = (4, 8, 16)


def _grp_r(n):
    """Rows per group for the last group of n rows (groups of 16 before it)."""
    t = n - 16 * ((n - 1) // 16)
    return 4 if t <= 4 else 8 if t <= 8 else 16


def _bcast_w(builder, u, c, G):
    """u: 32 code bytes (v32i8); -> v64i8 holding dwords c*G..c*G+G-1 of u in
    every row's G lanes."""
    u32 = builder.bitcast(u, _v8i32)
    return builder.bitcast(builder.shuffle_vector(u32, u32, ir.Constant(
        ir.VectorType(_i32, 16), [c * G + l % G for l in range(16)])), _v64i8)


def _lane_reduce(builder, v, G):
    """Sum each row's G lanes into its first lane (integer, exact)."""
    s = 1
    while s < G:
        v = builder.add(v, _shuf(builder, v, [l ^ s for l in range(16)]))
        s *= 2
    return v


def _splat16(builder, v):
    return _splat(builder, v, ir.VectorType(v.type, 16))




@njit(inline="always")
def _grp_any(kind, w, xg, xdg, xa, xb, out, res, n, K, m0, m1):
    """Row-group kernels (n >= 2) of the 32-element formats, kinds 0-4 and 6 (xa =
    xsumg, xb = xsg).  K-quants take any n through _rows_any (vnni_kq)."""
    if kind == 0:
        _leg_grp_rows(0, w, xg, xdg, xa, xb, out, res, n, K, m0, m1)
    elif kind == 1:
        _leg_grp_rows(1, w, xg, xdg, xa, xb, out, res, n, K, m0, m1)
    elif kind == 2:
        _leg_grp_rows(2, w, xg, xdg, xa, xb, out, res, n, K, m0, m1)
    elif kind == 3:
        _leg_grp_rows(3, w, xg, xdg, xa, xb, out, res, n, K, m0, m1)
    elif kind == 6:
        _leg_grp_rows(6, w, xg, xdg, xa, xb, out, res, n, K, m0, m1)
    else:
        _leg_grp_rows(4, w, xg, xdg, xa, xb, out, res, n, K, m0, m1)


@njit(cache=True, nogil=True)
def grp_rows(kind, w, xg, xdg, xa, xb, out, res, n, K, m0, m1):
    _grp_any(kind, w, xg, xdg, xa, xb, out, res, n, K, m0, m1)


@njit(parallel=True, cache=True, nogil=True)
def grp_par(kind, w, xg, xdg, xa, xb, out, res, n, K, nch):
    """As par_any for the row-group kernels; res f32 [nch, 16]."""
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        _grp_any(kind, w, xg, xdg, xa, xb, out, res[c], n, K, c * per, min(M, (c + 1) * per))


@njit(parallel=True, cache=True, nogil=True)
def grp_multi(kind, ws, xg, xdg, xa, xb, outs, res, n, K, cw, cm0, cm1):
    for c in prange(cw.size):
        _grp_any(kind, ws[cw[c]], xg, xdg, xa, xb, outs[cw[c]], res[c], n, K, cm0[c], cm1[c])


# ------------------------------------------------ 32-element formats, per block
#
# The float operations per (x row r, W row m), the same in the one-row kernel
# (leg_rows) and the row-group kernel (leg_grp): per block b the integer dot
# I_b = sum(u * q) - OFF * xsum_b is exact; with j = b mod 8,
#   a_j = fma(float(I_b), dw_b * dx_b, a_j)      (a_j = 0 at first)
#   a_j = fma(mw_b, xs_b, a_j)                    (formats with a min)
# and the result is ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).


def _codes32(builder, w, wo, k):
    """32 unsigned code bytes of the legacy block of kind k at byte offset wo."""
    BB, MOFF, QHOFF, QSOFF, CODE, OFF = _LEG[k]
    if CODE == "i8":
        q = _load_vec(builder, w, builder.add(wo, _c(QSOFF)), _v32i8)
        return builder.xor(q, ir.Constant(_v32i8, [0x80] * 32)) if OFF else q
    u = _nibbles(builder, _load_vec(builder, w, builder.add(wo, _c(QSOFF)), _v16i8))
    if CODE == "mx":
        return _mx_lookup(builder, u)
    if CODE == "nib5":
        qp = builder.bitcast(builder.gep(w, [builder.add(wo, _c(QHOFF))]), _i32.as_pointer())
        bits = builder.bitcast(builder.load(qp, align=1), ir.VectorType(_i1, 32))
        u = builder.or_(u, builder.select(bits, ir.Constant(_v32i8, [16] * 32), ir.Constant(_v32i8, None)))
    return u


def _lanes(builder, p, base, t, elt):
    """<8 x elt>: p[base + j] in lanes j < t, 0 elsewhere (nothing read past them).
    p is read as elt, as vec8 reads it (the kernels are typed with one array
    type for all kinds: Q4_K's float sums share the slot of the int32 ones)."""
    v = ir.Constant(ir.VectorType(elt, 8), None)
    p = builder.bitcast(p, elt.as_pointer())
    for j in range(t):
        v = builder.insert_element(v, builder.load(builder.gep(p, [builder.add(base, _c(j))])), _c(j, _i32))
    return v


def _widen16(builder, v16):
    """v16i8 -> v32i8, the high 16 bytes zero."""
    return builder.shuffle_vector(v16, ir.Constant(_v16i8, None), ir.Constant(ir.VectorType(_i32, 32), list(range(32))))


def _pair_codes(builder, w, b, k, lone=False):
    """Unsigned codes of legacy blocks b, b+1 of kind k (W row at w) as two v32i8:
    lo = codes 0-15 of b | codes 0-15 of b+1, hi = codes 16-31 of both (lone:
    block b alone, the upper 16 bytes zero).  For the nibble formats these are
    the low and the high nibbles of the two blocks' qs, so no byte ever moves
    between 128-bit halves (the natural order took an insert per block)."""
    BB, MOFF, QHOFF, QSOFF, CODE, OFF = _LEG[k]
    oa = builder.mul(b, _c(BB))
    ob = builder.add(oa, _c(BB))
    idx32 = ir.Constant(ir.VectorType(_i32, 32), list(range(32)))
    if CODE == "i8":
        qa = _load_vec(builder, w, builder.add(oa, _c(QSOFF)), _v32i8)
        qb = ir.Constant(_v32i8, None) if lone else _load_vec(builder, w, builder.add(ob, _c(QSOFF)), _v32i8)
        lo = builder.shuffle_vector(qa, qb, ir.Constant(ir.VectorType(_i32, 32), list(range(16)) + list(range(32, 48))))
        hi = builder.shuffle_vector(qa, qb, ir.Constant(ir.VectorType(_i32, 32), list(range(16, 32)) + list(range(48, 64))))
        if not OFF:
            return lo, hi
        flip = ir.Constant(_v32i8, [0x80] * 16 + [0x80 if not lone else 0] * 16)
        return builder.xor(lo, flip), builder.xor(hi, flip)
    qa = _load_vec(builder, w, builder.add(oa, _c(QSOFF)), _v16i8)
    qb = ir.Constant(_v16i8, None) if lone else _load_vec(builder, w, builder.add(ob, _c(QSOFF)), _v16i8)
    v = builder.shuffle_vector(qa, qb, idx32)
    lo = builder.and_(v, ir.Constant(_v32i8, [15] * 32))
    hi = builder.lshr(v, ir.Constant(_v32i8, [4] * 32))
    if CODE == "mx":        # (a lone block's zero bytes look up 12: its x codes there are 0)
        return _mx_lookup(builder, lo), _mx_lookup(builder, hi)
    if CODE == "nib5":
        def qh(o):
            p = builder.bitcast(builder.gep(w, [builder.add(o, _c(QHOFF))]), _i32.as_pointer())
            return builder.load(p, align=1)
        ha = qh(oa)
        hb = ir.Constant(_i32, 0) if lone else qh(ob)
        # fifth bits: elements 0-15 of both blocks, then 16-31 of both
        mlo = builder.or_(builder.and_(ha, ir.Constant(_i32, 0xFFFF)), builder.shl(hb, ir.Constant(_i32, 16)))
        mhi = builder.or_(builder.lshr(ha, ir.Constant(_i32, 16)), builder.and_(hb, ir.Constant(_i32, 0xFFFF0000)))
        # + 16 under the bit mask: one merge-masked vpaddb a vector
        sixteen = ir.Constant(_v32i8, [16] * 32)
        lo = builder.select(builder.bitcast(mlo, ir.VectorType(_i1, 32)), builder.add(lo, sixteen), lo)
        hi = builder.select(builder.bitcast(mhi, ir.VectorType(_i1, 32)), builder.add(hi, sixteen), hi)
    return lo, hi


def _pair_reduce(builder, ps):
    """4 x v8i32 pair sums (4 lanes a block: blocks 2i, 2i+1 in ps[i]) -> v8i32 whose
    lane j is block j's sum (exact)."""
    ev = ir.Constant(ir.VectorType(_i32, 8), [0, 2, 8, 10, 4, 6, 12, 14])
    od = ir.Constant(ir.VectorType(_i32, 8), [1, 3, 9, 11, 5, 7, 13, 15])

    def m(a, b):
        return builder.add(builder.shuffle_vector(a, b, ev), builder.shuffle_vector(a, b, od))
    # within 128-bit halves only (one-uop shuffles): the sums come out in block
    # order 0 2 4 6 1 3 5 7, put back by one cross-half permute
    h = m(m(ps[0], ps[1]), m(ps[2], ps[3]))
    return builder.shuffle_vector(h, h, ir.Constant(ir.VectorType(_i32, 8), [0, 4, 1, 5, 2, 6, 3, 7]))


@intrinsic
def leg_rows(typingctx, kind, R, src, nb, xq, xd, xsum, xs, r0, K, res):
    """res[i] = row r0+i of x . the W row src, i < R (1..LEG_ROWS_MAX), 32-element
    format `kind`, with the flat activations of act_quant.quantize_q8_32_i8 (pair
    order).  Eight blocks at a time, as four pairs: their integer dots reduced into
    one vector per row (lane j: block 8q+j), then one vector of float operations a
    row.  The W codes and scales are decoded once for all R rows; each row's
    operations are exactly those of R = 1, so every R gives a row the same bits."""
    if not (_literal(kind) and _literal(R)):
        return None
    k = kind.literal_value
    nr = R.literal_value
    assert 1 <= nr <= LEG_ROWS_MAX
    BB, MOFF, QHOFF, QSOFF, CODE, OFF = _LEG[k]
    sig = types.void(kind, R, src, nb, xq, xd, xsum, xs, r0, K, res)

    def codegen(context, builder, signature, args):
        ta = signature.args
        _, _, srcv, nbv, xqv, xdv, xsumv, xsv, r0v, Kv, resv = args
        w = _data(context, builder, ta[2], srcv)
        xqp = _data(context, builder, ta[4], xqv)
        xdp = _data(context, builder, ta[5], xdv)
        xsump = _data(context, builder, ta[6], xsumv)
        xsp = _data(context, builder, ta[7], xsv)
        resp = _data(context, builder, ta[10], resv)
        nbv, r0v, Kv = [builder.sext(v, _i64) if v.type != _i64 else v for v in (nbv, r0v, Kv)]
        rows = [builder.add(r0v, _c(i)) for i in range(nr)]
        xrows = [builder.mul(r, Kv) for r in rows]
        brows = [builder.mul(r, nbv) for r in rows]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_v8f32, None)) for _ in range(nr)]

        def pair(b, lone=False):
            """Per row, int32 lane sums of blocks b, b+1 (lanes 0-3: b, 4-7: b+1;
            lone: block b alone in lanes 0-3): low-half codes against the x pair's
            first 32 bytes, high-half codes against its second (act_quant's pair
            order), one accumulator for both.  The codes are decoded once."""
            lo, hi = _pair_codes(builder, w, b, k, lone)
            out = []
            for xrow in xrows:
                xo = builder.add(xrow, builder.mul(b, _c(32)))
                if lone:
                    xl = _widen16(builder, _load_vec(builder, xqp, xo, _v16i8))
                    xh = _widen16(builder, _load_vec(builder, xqp, builder.add(xo, _c(16)), _v16i8))
                else:
                    xl = _load_vec(builder, xqp, xo, _v32i8)
                    xh = _load_vec(builder, xqp, builder.add(xo, _c(32)), _v32i8)
                out.append(_vpdpbusd(builder, _vpdpbusd(builder, ir.Constant(_v8i32, None), lo, xl, _signed(k)), hi, xh,
                                     _signed(k)))
            return out

        def block_sums(b0, t):
            """Per row, v8i32: lane j the exact integer dot of block b0 + j, j < t (0 beyond)."""
            ps = [pair(builder.add(b0, _c(2 * i))) for i in range(t // 2)]
            if t % 2:
                ps.append(pair(builder.add(b0, _c(t - 1)), lone=True))
            ps += [[ir.Constant(_v8i32, None)] * nr] * (4 - len(ps))
            return [_pair_reduce(builder, [p[i] for p in ps]) for i in range(nr)]

        def halves(b0, off, t=8):
            """The f16 field at `off` of blocks b0..b0+t-1 as floats, 0.0 in lanes >= t
            (nothing read past them)."""
            h = ir.Constant(ir.VectorType(_i16, 8), None)
            for j in range(t):
                p = builder.bitcast(builder.gep(w, [builder.add(builder.mul(builder.add(b0, _c(j)), _c(BB)),
                                                                _c(off))]), _i16.as_pointer())
                h = builder.insert_element(h, builder.load(p, align=1), _c(j, _i32))
            return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), _v8f32)

        def fields8(b0, offs):
            """The f16 fields at byte offsets `offs` of blocks b0..b0+7, each as 8
            floats: the 8 blocks' bytes read as 64-byte windows (the last one
            ending at the 8th block's end) and the fields picked by word
            permutes; inserting them one load at a time cost 8 shuffles a field."""
            span = 8 * BB
            starts = list(range(0, span - 64, 64)) + [span - 64]
            base = builder.mul(b0, _c(BB))
            v32i16 = ir.VectorType(_i16, 32)
            wins = [builder.bitcast(_load_vec(builder, w, builder.add(base, _c(s0)), _v64i8), v32i16) for s0 in starts]
            want = [(j * BB + off) // 2 for off in offs for j in range(8)]       # word positions
            src = [max(i for i, s0 in enumerate(starts) if s0 <= 2 * p) for p in want]
            res = None
            for wi in sorted(set(src)):
                lanes = [(p - starts[wi] // 2) if s_ == wi else None for p, s_ in zip(want, src)]
                if res is None:
                    idx = [l if l is not None else 0 for l in lanes] + [0] * (32 - len(lanes))
                    res = builder.shuffle_vector(wins[wi], wins[wi], ir.Constant(ir.VectorType(_i32, 32), idx))
                else:
                    idx = [32 + l if l is not None else i for i, l in enumerate(lanes)] + list(range(len(lanes), 32))
                    res = builder.shuffle_vector(res, wins[wi], ir.Constant(ir.VectorType(_i32, 32), idx))
            out = []
            for f in range(len(offs)):
                h = builder.shuffle_vector(res, res, ir.Constant(ir.VectorType(_i32, 8), list(range(8 * f, 8 * f + 8))))
                out.append(builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), _v8f32))
            return out

        def vec8(p, b, t):
            return builder.load(builder.bitcast(builder.gep(p, [b]), ir.VectorType(t, 8).as_pointer()), align=4)

        nq = builder.sdiv(nbv, _c(8))
        with cgutils.for_range(builder, nq) as loop:
            b0 = builder.mul(loop.index, _c(8))
            _prefetch_blocks(builder, w, b0, 8, BB)
            isums = block_sums(b0, 8)
            # two fields (Q4_1, Q5_1) share the permutes' loads: 8% faster; one field
            # alone (Q4_0, Q5_0, Q8_0) measured the same or slower than inserting
            if CODE == "mx":
                hs = [_e8m0_floats(builder, _scale_bytes(builder, w, b0, 8, 8, BB))]
            else:
                hs = fields8(b0, [0, MOFF]) if MOFF >= 0 else [halves(b0, 0)]
            for isum, brow, acc in zip(isums, brows, accs):
                bi = builder.add(brow, b0)
                if OFF:
                    isum = builder.sub(isum, builder.mul(vec8(xsump, bi, _i32), ir.Constant(_v8i32, [OFF] * 8)))
                s = builder.fmul(hs[0], vec8(xdp, bi, _f32))
                a = _fma_t(builder, builder.sitofp(isum, _v8f32), s, builder.load(acc))
                if MOFF >= 0:
                    a = _fma_t(builder, hs[1], vec8(xsp, bi, _f32), a)
                builder.store(a, acc)
        b0 = builder.mul(nq, _c(8))
        rem = builder.sub(nbv, b0)
        for t in range(1, 8):
            # the last t blocks as one vector step, lanes >= t left as they were
            # (block after block through one accumulator lane, a serial chain, made
            # a row of 28 blocks cost 1.48 ns a block against 1.08 for long rows)
            with builder.if_then(builder.icmp_signed("==", rem, _c(t))):
                _prefetch_blocks(builder, w, b0, t, BB)
                isums = block_sums(b0, t)
                if CODE == "mx":
                    d = _e8m0_floats(builder, _scale_bytes(builder, w, b0, t, 8, BB))
                else:
                    d = halves(b0, 0, t)
                m = halves(b0, MOFF, t) if MOFF >= 0 else None
                keep = ir.Constant(ir.VectorType(_i1, 8), [int(j < t) for j in range(8)])
                for isum, brow, acc in zip(isums, brows, accs):
                    bi = builder.add(brow, b0)
                    if OFF:
                        isum = builder.sub(isum, builder.mul(_lanes(builder, xsump, bi, t, _i32),
                                                             ir.Constant(_v8i32, [OFF] * 8)))
                    sc = builder.fmul(d, _lanes(builder, xdp, bi, t, _f32))
                    old = builder.load(acc)
                    a = _fma_t(builder, builder.sitofp(isum, _v8f32), sc, old)
                    if MOFF >= 0:
                        a = _fma_t(builder, m, _lanes(builder, xsp, bi, t, _f32), a)
                    builder.store(builder.select(keep, a, old), acc)
        for i, acc in enumerate(accs):
            av = builder.load(acc)
            builder.store(_tree8(builder, [builder.extract_element(av, _c(j, _i32)) for j in range(8)]),
                          builder.gep(resp, [_c(i)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def leg_grp(typingctx, kind, R, src, nb, xg, xdg, xsumg, xsg, res):
    """res[r] = row r of a row group . the W row src, r < R, 32-element
    format `kind`.  xg int8 [K*R] interleaved codes (act_quant.group_q8_32);
    lane arrays [nb*16]: xdg f32 steps, xsumg int32 code sums, xsg f32 xd*xsum."""
    if not (_literal(kind) and _literal(R)):
        return None
    k = kind.literal_value
    nr = R.literal_value
    G = 16 // nr
    BB, MOFF, QHOFF, QSOFF, CODE, OFF = _LEG[k]
    sig = types.void(kind, R, src, nb, xg, xdg, xsumg, xsg, res)

    def codegen(context, builder, signature, args):
        ta = signature.args
        _, _, srcv, nbv, xgv, xdgv, xsumgv, xsgv, resv = args
        w = _data(context, builder, ta[2], srcv)
        xp = _data(context, builder, ta[4], xgv)
        xdp = _data(context, builder, ta[5], xdgv)
        xsump = _data(context, builder, ta[6], xsumgv)
        xsp = _data(context, builder, ta[7], xsgv)
        resp = _data(context, builder, ta[8], resv)
        nbv = builder.sext(nbv, _i64) if nbv.type != _i64 else nbv
        nst = 8 // G                                  # steps of G blocks per 8 blocks
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_v16f32, None)) for _ in range(nst)]
        nch = 8 // G                                  # 64-byte chunks per block

        def lane16(p, v, t):
            return builder.load(builder.bitcast(builder.gep(p, [builder.mul(v, _c(16))]),
                                                ir.VectorType(t, 16).as_pointer()), align=4)

        def halves(b, off, nvalid):
            """f16 field at `off` of blocks b..b+G-1 (0 past nvalid) in lanes l % G
            (MXFP4: its E8M0 scales, off 0)."""
            if CODE == "mx":
                f = _e8m0_floats(builder, _scale_bytes(builder, w, b, nvalid, G, BB))
                return builder.shuffle_vector(f, f, ir.Constant(ir.VectorType(_i32, 16), [l % G for l in range(16)]))
            h = ir.Constant(ir.VectorType(_i16, G), None)
            for t in range(nvalid):
                p = builder.bitcast(builder.gep(w, [builder.add(builder.mul(builder.add(b, _c(t)), _c(BB)),
                                                                _c(off))]), _i16.as_pointer())
                h = builder.insert_element(h, builder.load(p, align=1), _c(t, _i32))
            f = builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), G)), ir.VectorType(_f32, G))
            return builder.shuffle_vector(f, f, ir.Constant(ir.VectorType(_i32, 16), [l % G for l in range(16)]))

        def step(b, si, nvalid):
            """Blocks b..b+nvalid-1 (nvalid <= G, b a multiple of G) into accs[si]."""
            ps = []
            for t in range(G):
                p = ir.Constant(_v16i32, None)
                if t < nvalid:
                    bt = builder.add(b, _c(t))
                    u = _codes32(builder, w, builder.mul(bt, _c(BB)), k)
                    xo = builder.mul(bt, _c(32 * nr))
                    for c in range(nch):
                        p = _vpdpbusd512(builder, p, _bcast_w(builder, u, c, G),
                                         _load_vec(builder, xp, builder.add(xo, _c(64 * c)), _v64i8), _signed(k))
                ps.append(p)
            # transpose-reduce: lane r*G + t <- block b + t of row r (exact)
            sp = G // 2
            while sp >= 1:
                h = len(ps) // 2
                lo = [l if (l % G) % (2 * sp) < sp else 16 + l - sp for l in range(16)]
                hi = [l + sp if (l % G) % (2 * sp) < sp else 16 + l for l in range(16)]
                ps = [builder.add(builder.shuffle_vector(ps[i], ps[i + h], ir.Constant(ir.VectorType(_i32, 16), lo)),
                                  builder.shuffle_vector(ps[i], ps[i + h], ir.Constant(ir.VectorType(_i32, 16), hi)))
                      for i in range(h)]
                sp //= 2
            isum = ps[0]
            v = builder.sdiv(b, _c(G))
            if OFF:
                isum = builder.sub(isum, builder.mul(lane16(xsump, v, _i32), ir.Constant(_v16i32, [OFF] * 16)))
            sc = builder.fmul(halves(b, 0, nvalid), lane16(xdp, v, _f32))
            old = builder.load(accs[si])
            a = _fma_t(builder, builder.sitofp(isum, _v16f32), sc, old)
            if MOFF >= 0:
                a = _fma_t(builder, halves(b, MOFF, nvalid), lane16(xsp, v, _f32), a)
            if nvalid < G:
                a = builder.select(ir.Constant(ir.VectorType(_i1, 16), [int(l % G < nvalid) for l in range(16)]),
                                   a, old)
            builder.store(a, accs[si])

        nq = builder.sdiv(nbv, _c(8))
        with cgutils.for_range(builder, nq) as loop:
            b0 = builder.mul(loop.index, _c(8))
            _prefetch_blocks(builder, w, b0, 8, BB)
            for si in range(nst):
                step(builder.add(b0, _c(si * G)), si, G)
        b0 = builder.mul(nq, _c(8))
        rem = builder.sub(nbv, b0)
        for t in range(1, 8):                          # rem == t: steps of the last t blocks
            with builder.if_then(builder.icmp_signed("==", rem, _c(t))):
                _prefetch_blocks(builder, w, b0, t, BB)
                for si in range((t + G - 1) // G):
                    step(builder.add(b0, _c(si * G)), si, min(G, t - si * G))
        av = [builder.load(a) for a in accs]
        for r in range(nr):
            aj = [builder.extract_element(av[j // G], _c(r * G + j % G, _i32)) for j in range(8)]
            builder.store(_tree8(builder, aj), builder.gep(resp, [_c(r)]))
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _leg_grp_rows(kind, w, xg, xdg, xsumg, xsg, out, res, n, K, m0, m1):
    nb = K // 32
    ng = (n + 15) // 16
    for gi in range(ng):
        R = 16 if gi < ng - 1 else _grp_r_nb(n)
        xgv = xg[gi * 16 * K:(gi + 1) * 16 * K]
        xdv = xdg[gi * nb * 16:(gi + 1) * nb * 16]
        xsv = xsumg[gi * nb * 16:(gi + 1) * nb * 16]
        xfv = xsg[gi * nb * 16:(gi + 1) * nb * 16]
        nr = min(16, n - 16 * gi)
        for m in range(m0, m1):
            if R == 4:
                leg_grp(kind, 4, w[m], nb, xgv, xdv, xsv, xfv, res)
            elif R == 8:
                leg_grp(kind, 8, w[m], nb, xgv, xdv, xsv, xfv, res)
            else:
                leg_grp(kind, 16, w[m], nb, xgv, xdv, xsv, xfv, res)
            for r in range(nr):
                out[16 * gi + r, m] = res[r]


@njit(cache=True, nogil=True)
def matvec_grp_leg(kind, x, w, xq, xd, xsum, xs, xg, xdg, xsumg, xsg, out, res, fresh):
    """As matvec_grp_k for the 32-element formats."""
    n, K = x.shape
    if fresh:
        quantize_q8_32_i8(x, xq, xd, xsum, xs)
        group_q8_32(n, K, xq, xd, xsum, xs, xg, xdg, xsumg, xsg)
    _grp_any(kind, w, xg, xdg, xsumg, xsg, out, res, n, K, 0, w.shape[0])


