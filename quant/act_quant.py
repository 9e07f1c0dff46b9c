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
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .ir import _f32, _fn, _i8, _i32, _v16f32, _v16i8, _v16i32

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


@intrinsic
def q8_block(typingctx, L, src, so, dst, dst4, s16, s32, do, do16, do32):
    """Round src[so:so+L] (float32; L = 32 or 256, a literal) to int8 codes
    dst[do:do+L] with step amax/127, exactly as _quantize_block does (x * (127 /
    amax), rounded half to even); returns the step.  Where not None: dst4[do:do+L]
    the same codes in Q4_K's load order (Q4_K_ORDER, L = 256), s16[do16+j] the
    sum of codes 16j..16j+15, s32[do32+j] of codes 32j..32j+31.

    Plain LLVM vector IR (any CPU), 16 lanes a step: the max of |x| is an
    integer max of the sign-cleared bits (non-negative floats order as their
    bits).  Numba's scalar loops for this took 1-2 ns a value."""
    if not isinstance(L, types.IntegerLiteral):
        return None
    n = L.literal_value
    assert n % 32 == 0
    want4, want16, want32 = (not isinstance(t, types.NoneType) for t in (dst4, s16, s32))
    assert not want4 or n == 256
    sig = types.float32(L, src, so, dst, dst4, s16, s32, do, do16, do32)

    def codegen(context, builder, signature, args):
        ta = signature.args
        _, srcv, sov, dstv, d4v, s16v, s32v, dov, d16v, d32v = args

        def ptr(i, v):
            return context.make_array(ta[i])(context, builder, v).data

        sp, dp = ptr(1, srcv), ptr(3, dstv)
        i64 = ir.IntType(64)
        sov, dov, d16v, d32v = [builder.sext(v, i64) if v.type != i64 else v for v in (sov, dov, d16v, d32v)]

        def at(p, base, k):
            return builder.gep(p, [builder.add(base, ir.Constant(i64, k))])

        vs = [builder.load(builder.bitcast(at(sp, sov, 16 * k), _v16f32.as_pointer()), align=4)
              for k in range(n // 16)]
        smax = _fn(builder, "llvm.smax.v16i32", _v16i32, [_v16i32, _v16i32])
        bits = [builder.and_(builder.bitcast(v, _v16i32), ir.Constant(_v16i32, [0x7FFFFFFF] * 16)) for v in vs]
        while len(bits) > 1:
            bits = [builder.call(smax, [bits[i], bits[i + 1]]) for i in range(0, len(bits), 2)]
        m = builder.call(_fn(builder, "llvm.vector.reduce.smax.v16i32", _i32, [_v16i32]), [bits[0]])
        amax = builder.bitcast(m, _f32)
        nz = builder.fcmp_ordered("!=", amax, ir.Constant(_f32, 0.0))
        idv = builder.select(nz, builder.fdiv(ir.Constant(_f32, 127.0), amax), ir.Constant(_f32, 0.0))
        sv = builder.insert_element(ir.Constant(_v16f32, ir.Undefined), idv, ir.Constant(_i32, 0))
        sv = builder.shuffle_vector(sv, sv, ir.Constant(_v16i32, [0] * 16))
        rint = _fn(builder, "llvm.rint.v16f32", _v16f32, [_v16f32])
        v8i8 = ir.VectorType(_i8, 8)
        radd = _fn(builder, "llvm.vector.reduce.add.v16i32", _i32, [_v16i32])
        sums = []
        for k, v in enumerate(vs):
            c = builder.fptosi(builder.call(rint, [builder.fmul(v, sv)]), _v16i32)
            c8 = builder.trunc(c, _v16i8)
            builder.store(c8, builder.bitcast(at(dp, dov, 16 * k), _v16i8.as_pointer()), align=1)
            if want4:       # Q4_K_ORDER: the 8-code halves of natural piece k (weights 16k..)
                for e in (0, 8):
                    o4 = int(_Q4K_POS[16 * k + e])
                    half = builder.shuffle_vector(c8, c8, ir.Constant(ir.VectorType(_i32, 8), list(range(e, e + 8))))
                    builder.store(half, builder.bitcast(at(ptr(4, d4v), dov, o4), v8i8.as_pointer()), align=1)
            sums.append(builder.call(radd, [c]) if (want16 or want32) else None)
        for k, t in enumerate(sums):
            if want16:
                builder.store(t, at(ptr(5, s16v), d16v, k))
            if want32 and k % 2:
                builder.store(builder.add(sums[k - 1], t), at(ptr(6, s32v), d32v, k // 2))
        return builder.fdiv(amax, ir.Constant(_f32, 127.0))

    return sig, codegen


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
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


@njit(inline="always")
def _q8_32_natural(x, xq, xd, xsum, xs):
    """quantize_q8_32's codes (flat, natural order), steps, code sums and steps x sums."""
    n, K = x.shape
    nb = K // 32
    for r in range(n):
        xr = x[r]
        for b in range(nb):
            d = q8_block(32, xr, b * 32, xq, None, None, xsum, r * K + b * 32, 0, r * nb + b)
            xd[r * nb + b] = d
            xs[r * nb + b] = d * F32(xsum[r * nb + b])


@njit(cache=True, nogil=True)
def quantize_q8_32_i8(x, xq, xd, xsum, xs):
    """For the VNNI kernels: x f32 [n, K] -> xq int8 [n*K] (flat, in pair order:
    pair_pos), and flat [n*K/32] xd steps, xsum int32 code sums, xs = xd * xsum.
    Same codes and steps as quantize_q8_32."""
    n, K = x.shape
    nb = K // 32
    _q8_32_natural(x, xq, xd, xsum, xs)
    for r in range(n):
        # pair order: codes 16-31 of block 2p trade places with codes 0-15 of 2p+1
        for p in range(nb // 2):
            o = r * K + 64 * p
            for i in range(16):
                t = xq[o + 16 + i]
                xq[o + 16 + i] = xq[o + 32 + i]
                xq[o + 32 + i] = t


@njit(cache=True, nogil=True)
def quantize_q8_32_quad(x, xq, xd, xsum, xs):
    """As quantize_q8_32_i8 (same codes, steps and sums), the codes in quad order for
    vnni_quad (K a multiple of 128): per four blocks, codes 0-15 of each, then codes
    16-31 of each."""
    n, K = x.shape
    _q8_32_natural(x, xq, xd, xsum, xs)
    tmp = np.empty(128, np.int8)
    for r in range(n):
        for g in range(K // 128):
            o = r * K + 128 * g
            tmp[:] = xq[o:o + 128]
            for t in range(4):
                for j in range(16):
                    xq[o + 16 * t + j] = tmp[32 * t + j]
                    xq[o + 64 + 16 * t + j] = tmp[32 * t + 16 + j]


@njit(inline="always")
def pair_pos(nb, i):
    """Where code i of a row (natural order) lies in quantize_q8_32_i8's pair
    order: blocks 2p and 2p+1 as [2p: 0-15 | 2p+1: 0-15 | 2p: 16-31 | 2p+1: 16-31]
    (the one-row VNNI kernel dots both blocks' low-nibble codes in one register,
    then both high ones), the last block of an odd count as it is."""
    b = i // 32
    if b >= 2 * (nb // 2):
        return i
    e = i - 32 * b
    return 64 * (b // 2) + 32 * (e // 16) + 16 * (b % 2) + e % 16


def pair_order(K: int) -> np.ndarray:
    """For rows of K codes: the natural index of the code at each position of
    quantize_q8_32_i8's pair order (tests, debugging)."""
    nb = K // 32
    out = np.empty(K, np.int64)
    for i in range(K):
        out[pair_pos.py_func(nb, i)] = i
    return out


# Q4_K_ORDER[i]: the weight (within its 256-block) whose code lies at byte i of
# the code vectors the Q4_K kernel (vnni_kq) makes from two 64-byte loads of
# nibbles (qs byte b: low nibble weight b % 32 + 64 (b // 32), high nibble 32 more):
# for half g of the block two vectors v (qword-interleaved low and high nibbles),
# 128-bit lane L of each: 8 low-nibble codes, then the 8 high-nibble codes above them.
Q4_K_ORDER = np.array([128 * g + 64 * (L // 2) + 16 * (L % 2) + 8 * v + 32 * hi + i
                       for g in range(2) for v in range(2) for L in range(4) for hi in range(2) for i in range(8)],
                      np.int64)
_Q4K_POS = np.argsort(Q4_K_ORDER)           # where each weight's code lies


@njit(cache=True, nogil=True)
def quantize_q8_256_i8(x, xq, xq4, xd, xb, xb16, xbf):
    """For the VNNI kernels, all flat: x f32 [n, K] -> xq int8 [n*K], the same
    codes in Q4_K's load order xq4 int8 [n*K] (Q4_K_ORDER), xd f32 [n*K/256],
    code sums xb int32 [n*K/32] and xb16 int32 [n*K/16], and xbf f32 [n*K/32]
    = xb times its block's step (the x side of Q4_K's mins term)."""
    n, K = x.shape
    nsb = K // 256
    for r in range(n):
        xr = x[r]
        for b in range(nsb):
            o = r * K + b * 256
            d = q8_block(256, xr, b * 256, xq, xq4, xb16, xb, o, o // 16, o // 32)
            xd[r * nsb + b] = d
            for j in range(o // 32, o // 32 + 8):
                xbf[j] = np.float32(xb[j]) * d


@njit(inline="always")
def _grp_r(n):
    t = n - 16 * ((n - 1) // 16)
    return 4 if t <= 4 else 8 if t <= 8 else 16


@njit(inline="always")
def _group_codes(xq, n, K, xg):
    """Flat int8 codes [n*K] (pair order) -> row groups of 16 (the last of R = 4, 8 or 16
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
                    src = c * 4 * G
                    for t in range(4 * G):
                        xg[o + t] = xq[row * K + pair_pos(K // 32, src + t)]
                else:
                    for t in range(4 * G):
                        xg[o + t] = 0


@njit(cache=True, nogil=True)
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
