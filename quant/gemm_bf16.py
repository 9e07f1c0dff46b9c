"""Prompt-processing matmul in bfloat16 (AVX512_BF16 vdpbf16ps), where the CPU has it.

The float32 path (gemm_tiles: dequantize a tile, sgemm) runs at the FMA units'
peak, 32 flops a cycle a core; vdpbf16ps does two bf16 products per fp32 lane,
twice that.  Activations and dequantized weights are rounded to bfloat16 (8
significant bits, relative error <= 2^-9 per element, no shared block scale
that an outlier could blow up, unlike 8-bit integer activations); the
products and sums stay float32.

Layout: x as bf16 pairs (x[i, 2p], x[i, 2p+1]) in one uint32; a tile of 32 W
rows dequantized and packed as wp[p, j] = (w[j, 2p], w[j, 2p+1]).  The kernel
keeps an 8 x 32 block of outputs in 16 zmm accumulators over the whole K:
per pair of K, two loads of W, eight broadcasts of x, sixteen vdpbf16ps
(~95% of the bf16 peak on one Zen4 core).

Preparing a tile is the rest of the cost: Q4_K / Q6_K super-blocks are decoded
straight into bf16 pairs in IR (deq_pack_k), other types are dequantized a
column chunk at a time by the scalar decoders and rounded in IR (pack_tile);
either way 16 x 16 blocks of pairs are transposed in registers into the
kernel's layout.  The pairs are exactly _bf16_bits of dequant.deq_row's floats.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .dequant import deq_row
from .ir import _c, _data, _fn, _i16, _i32, _i64, _load_half, _load_vec, _splat, _v16f32, _v16i32, cpu_has

TILE = 32        # W rows per packed tile (two zmm of fp32 lanes)
ROWS = 8         # x rows per kernel call


HAVE_BF16 = cpu_has("LLAMBA_BF16_PREFILL", "avx512bf16")


class _BFloat(ir.types.Type):
    """LLVM's bfloat (llvmlite has no builder type for it)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_v32bf16 = ir.VectorType(_BFloat(), 32)


def _dpbf16(builder, acc, a, b):
    fn = _fn(builder, "llvm.x86.avx512bf16.dpbf16ps.512", _v16f32, [_v16f32, _v32bf16, _v32bf16])
    return builder.call(fn, [acc, builder.bitcast(a, _v32bf16), builder.bitcast(b, _v32bf16)])


@intrinsic
def bf16_block(typingctx, xb, i0, wp, kp, ct):
    """ct[i, j] = sum_p x pair (i0+i, p) . w pair (p, j), i < 8, j < 32, in fp32.

    xb uint32 [rows, kp] (rows >= i0 + 8), wp uint32 [kp, 32], ct f32 [8, 32]."""
    sig = types.void(xb, i0, wp, kp, ct)

    def codegen(context, builder, signature, args):
        ta = signature.args
        xbv, i0v, wpv, kpv, ctv = args
        xp = _data(context, builder, ta[0], xbv)
        wpp = _data(context, builder, ta[2], wpv)
        cp = _data(context, builder, ta[4], ctv)
        i0v, kpv = [builder.sext(v, _i64) if v.type != _i64 else v for v in (i0v, kpv)]
        rows = [builder.mul(builder.add(i0v, _c(i)), kpv) for i in range(ROWS)]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_v16f32, None)) for _ in range(2)]
                for _ in range(ROWS)]
        with cgutils.for_range(builder, kpv) as loop:
            p = loop.index
            wo = builder.mul(p, _c(TILE))
            b = [builder.load(builder.bitcast(builder.gep(wpp, [builder.add(wo, _c(16 * h))]),
                                              _v16i32.as_pointer()), align=4) for h in range(2)]
            for i in range(ROWS):
                a = _splat(builder, builder.load(builder.gep(xp, [builder.add(rows[i], p)])), _v16i32)
                for h in range(2):
                    builder.store(_dpbf16(builder, builder.load(accs[i][h]), a, b[h]), accs[i][h])
        for i in range(ROWS):
            for h in range(2):
                ptr = builder.bitcast(builder.gep(cp, [_c(i * TILE + 16 * h)]), _v16f32.as_pointer())
                builder.store(builder.load(accs[i][h]), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _transpose16(builder, rows):
    """16 vectors of 16 x i32 -> their transpose: four butterfly stages, each
    swapping bit d of the row index with bit d of the lane index (two-input
    shuffles: LLVM emits vpermt2d / vpunpck / vshufi32x4)."""
    rows = list(rows)
    for d in (1, 2, 4, 8):
        new = list(rows)
        for i in range(16):
            if i & d:
                continue
            j = i | d
            # row i keeps its lanes c with c & d == 0 and takes row j's c ^ d
            new[i] = builder.shuffle_vector(rows[i], rows[j], ir.Constant(
                ir.VectorType(_i32, 16), [c if not c & d else 16 + (c ^ d) for c in range(16)]))
            new[j] = builder.shuffle_vector(rows[i], rows[j], ir.Constant(
                ir.VectorType(_i32, 16), [16 + c if c & d else c ^ d for c in range(16)]))
        rows = new
    return rows


def _round_bf16(builder, f):
    """16 floats -> their bfloat16 bits (round to nearest even) in i32 lanes:
    _bf16_bits' arithmetic, on vectors."""
    u = builder.bitcast(f, _v16i32)
    one = ir.Constant(_v16i32, [1] * 16)
    s16 = ir.Constant(_v16i32, [16] * 16)
    odd = builder.and_(builder.lshr(u, s16), one)
    return builder.lshr(builder.add(builder.add(u, ir.Constant(_v16i32, [0x7FFF] * 16)), odd), s16)


def _pair16(builder, lo, hi):
    """Two vectors of 16 floats (elements 2q.. of a row) -> 16 bf16 pairs as i32."""
    v16i16 = ir.VectorType(_i16, 16)
    a, b = (builder.trunc(_round_bf16(builder, v), v16i16) for v in (lo, hi))
    both = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_i32, 32), list(range(32))))
    return builder.bitcast(both, _v16i32)


def _transpose_store(builder, row_pairs, wpp, p0v, npv):
    """wp[p0 + q, j] = row_pairs(j, q0)[q - q0] for q < npairs, j < 32, where
    row_pairs(j, q0) emits the 16 pairs q0..q0+15 of tile row j (an i32 vector)."""
    with cgutils.for_range(builder, builder.udiv(npv, _c(16))) as loop:
        q0 = builder.mul(loop.index, _c(16))
        for jb in (0, 16):
            cols = _transpose16(builder, [row_pairs(jb + r, q0) for r in range(16)])
            for q, col in enumerate(cols):
                off = builder.add(builder.mul(builder.add(builder.add(p0v, q0), _c(q)), _c(TILE)), _c(jb))
                builder.store(col, builder.bitcast(builder.gep(wpp, [off]), _v16i32.as_pointer()), align=4)


def _i64s(builder, *vs):
    return [builder.sext(v, _i64) if v.type != _i64 else v for v in vs]


@intrinsic
def pack_tile(typingctx, f, wp, p0, npairs):
    """wp[p0 + q, j] = bf16 pair (f[j, 2q], f[j, 2q+1]) for q < npairs, j < 32:
    32 dequantized W rows (f float32 [32, >= 2 npairs], C order) into the kernel's
    tile layout, 16 x 16 pairs at a time (npairs % 16 == 0).  Bit for bit
    _bf16_bits' packing; the scalar transposing loop it replaces cost as much
    as dequantizing (~8% of a prompt's matmul time)."""
    sig = types.void(f, wp, p0, npairs)

    def codegen(context, builder, signature, args):
        ta = signature.args
        fv, wpv, p0v, npv = args
        fa = context.make_array(ta[0])(context, builder, fv)
        fp = fa.data
        fstride = builder.udiv(builder.extract_value(fa.strides, 0), _c(4))    # floats per row of f
        p0v, npv = _i64s(builder, p0v, npv)

        def row_pairs(j, q0):
            base = builder.add(builder.mul(_c(j), fstride), builder.mul(q0, _c(2)))
            lo, hi = (builder.load(builder.bitcast(builder.gep(fp, [builder.add(base, _c(16 * h))]),
                                                   _v16f32.as_pointer()), align=4) for h in range(2))
            return _pair16(builder, lo, hi)

        _transpose_store(builder, row_pairs, _data(context, builder, ta[1], wpv), p0v, npv)
        return context.get_dummy_value()

    return sig, codegen


# ---- K-quant super-blocks decoded straight to bf16 pairs ---------------------------------

Q4_K, Q6_K = 12, 14          # GGML type ids


def _vload(builder, base, off, n):
    return _load_vec(builder, base, off, ir.VectorType(ir.IntType(8), n))


def _lane(builder, v, i):
    return builder.extract_element(v, ir.Constant(_i32, i))


def _codes16(builder, b16, sub=0):
    """16 bytes -> 16 floats of (byte - sub)."""
    v = builder.zext(b16, _v16i32)
    if sub:
        v = builder.sub(v, ir.Constant(_v16i32, [sub] * 16))
    return builder.sitofp(v, _v16f32)


def _bytes16(builder, v32, h):
    return builder.shuffle_vector(v32, v32, ir.Constant(ir.VectorType(_i32, 16), list(range(16 * h, 16 * h + 16))))


def _emit_sb_q4_k(builder, w):
    """A Q4_K super-block at w (i8*) -> 16 vectors of 16 floats, elements in order:
    deq_row_q4_k's arithmetic (d * sc, dmin * m, then d1 * q - dm1, unfused)."""
    v32i8 = ir.VectorType(ir.IntType(8), 32)
    d, dmin = _load_half(builder, w, _c(0)), _load_half(builder, w, _c(2))
    sc = [builder.load(builder.gep(w, [_c(4 + i)])) for i in range(12)]     # the packed 6-bit pairs
    i8 = ir.IntType(8)

    def scale_min(j):
        if j < 4:
            return builder.and_(sc[j], ir.Constant(i8, 63)), builder.and_(sc[j + 4], ir.Constant(i8, 63))
        s = builder.or_(builder.and_(sc[j + 4], ir.Constant(i8, 15)),
                        builder.shl(builder.lshr(sc[j - 4], ir.Constant(i8, 6)), ir.Constant(i8, 4)))
        m = builder.or_(builder.lshr(sc[j + 4], ir.Constant(i8, 4)),
                        builder.shl(builder.lshr(sc[j], ir.Constant(i8, 6)), ir.Constant(i8, 4)))
        return s, m

    out = []
    for g in range(4):
        q = _vload(builder, w, _c(16 + 32 * g), 32)
        for h in range(2):
            s, m = scale_min(2 * g + h)
            d1 = builder.fmul(d, builder.uitofp(s, ir.FloatType()))
            dm1 = builder.fmul(dmin, builder.uitofp(m, ir.FloatType()))
            c = (builder.and_(q, ir.Constant(v32i8, [15] * 32)) if h == 0
                 else builder.lshr(q, ir.Constant(v32i8, [4] * 32)))
            for k in range(2):
                y = builder.fmul(_splat(builder, d1, _v16f32), _codes16(builder, _bytes16(builder, c, k)))
                out.append(builder.fsub(y, _splat(builder, dm1, _v16f32)))
    return out


def _emit_sb_q6_k(builder, w):
    """A Q6_K super-block at w -> 16 vectors of 16 floats in order (deq_row_q6_k's
    arithmetic: (d * scale) * (code - 32))."""
    v32i8 = ir.VectorType(ir.IntType(8), 32)
    d = _load_half(builder, w, _c(208))
    scales = _vload(builder, w, _c(192), 16)
    out = [None] * 16
    for half in range(2):
        ql0 = _vload(builder, w, _c(64 * half), 32)
        ql1 = _vload(builder, w, _c(64 * half + 32), 32)
        qh = _vload(builder, w, _c(128 + 32 * half), 32)
        for Q in range(4):
            ql = ql0 if Q % 2 == 0 else ql1
            low = (builder.and_(ql, ir.Constant(v32i8, [15] * 32)) if Q < 2
                   else builder.lshr(ql, ir.Constant(v32i8, [4] * 32)))
            hb = builder.and_(builder.lshr(qh, ir.Constant(v32i8, [2 * Q] * 32)), ir.Constant(v32i8, [3] * 32))
            code = builder.or_(low, builder.shl(hb, ir.Constant(v32i8, [4] * 32)))
            for k in range(2):
                s = builder.sitofp(_lane(builder, scales, 8 * half + k + 2 * Q), ir.FloatType())
                step = _splat(builder, builder.fmul(d, s), _v16f32)
                out[8 * half + 2 * Q + k] = builder.fmul(step, _codes16(builder, _bytes16(builder, code, k), 32))
    return out


_SB = {Q4_K: (144, _emit_sb_q4_k), Q6_K: (210, _emit_sb_q6_k)}


@intrinsic
def deq_pack_k(typingctx, kind, w2, m0, t, sb, P):
    """P[j, q] = bf16 pair q of super-block sb of W row m0 + j, j < t, q < 128
    (kind: Q4_K or Q6_K, a literal; w2 the type's uint8 rows; P uint32 [32, 128]).
    The floats are deq_row's bit for bit, so the tile equals pack_tile's."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    k = kind.literal_value
    bb, emit = _SB[k]
    sig = types.void(kind, w2, m0, t, sb, P)

    def codegen(context, builder, signature, args):
        ta = signature.args
        _, wv, m0v, tv, sbv, pv = args
        wa = context.make_array(ta[1])(context, builder, wv)
        wstride = builder.extract_value(wa.strides, 0)
        pp = _data(context, builder, ta[5], pv)
        m0v, tv, sbv = _i64s(builder, m0v, tv, sbv)
        with cgutils.for_range(builder, tv) as loop:
            j = loop.index
            row = builder.gep(wa.data, [builder.add(builder.mul(builder.add(m0v, j), wstride),
                                                    builder.mul(sbv, _c(bb)))])
            ys = emit(builder, row)
            for i in range(8):
                ptr = builder.gep(pp, [builder.add(builder.mul(j, _c(128)), _c(16 * i))])
                builder.store(_pair16(builder, ys[2 * i], ys[2 * i + 1]), builder.bitcast(ptr, _v16i32.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def trans_tile(typingctx, P, wp, p0):
    """wp[p0 + q, j] = P[j, q] for q < 128, j < 32 (P uint32 [32, 128])."""
    sig = types.void(P, wp, p0)

    def codegen(context, builder, signature, args):
        ta = signature.args
        pv, wpv, p0v = args
        pp = _data(context, builder, ta[0], pv)
        p0v, = _i64s(builder, p0v)

        def row_pairs(j, q0):
            ptr = builder.gep(pp, [builder.add(_c(128 * j), q0)])
            return builder.load(builder.bitcast(ptr, _v16i32.as_pointer()), align=4)

        _transpose_store(builder, row_pairs, _data(context, builder, ta[1], wpv), p0v, _c(128))
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _bf16_bits(v):
    """float32 -> bfloat16 bits, round to nearest even (finite values)."""
    u = np.uint32(np.float32(v).view(np.uint32))
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(parallel=True, cache=True, nogil=True)
def pack_x(x, xb):
    """x f32 [n, K] -> xb uint32 [n8, K/2] bf16 pairs; rows n..n8-1 zero."""
    n, K = x.shape
    for i in prange(xb.shape[0]):
        if i < n:
            for p in range(K // 2):
                xb[i, p] = _bf16_bits(x[i, 2 * p]) | (_bf16_bits(x[i, 2 * p + 1]) << np.uint32(16))
        else:
            for p in range(K // 2):
                xb[i, p] = 0


def chunk_cols(K: int) -> int:
    """Columns dequantized per step of a tile: 256 (a K-quant super-block) or
    the largest of 128, 64, 32 dividing K (legacy 32-blocks, e.g. K = 576)."""
    for c in (256, 128, 64):
        if K % c == 0:
            return c
    return 32


@njit(inline="always")
def _prep_tile(qt, wdata, m0, t, f, wp, P):
    """W rows m0..m0+t-1 (t <= TILE, the rest zero) decoded and packed as bf16
    pairs into wp [K/2, TILE]: Q4_K / Q6_K a super-block at a time straight into
    pairs (P, 32 x 128: stays in L1), other types a column chunk at a time
    dequantized into f (32 x chunk_cols(K) floats) and packed."""
    K = 2 * wp.shape[0]
    if qt == 12 or qt == 14:
        for j in range(t, TILE):
            P[j, :] = 0
        for sb in range(K // 256):
            if qt == 12:
                deq_pack_k(12, wdata, m0, t, sb, P)
            else:
                deq_pack_k(14, wdata, m0, t, sb, P)
            trans_tile(P, wp, sb * 128)
    else:
        ch = f.shape[1]
        cb = wdata.shape[1] * ch // K          # bytes of a row's chunk
        for j in range(t, TILE):
            f[j, :] = 0
        for k0 in range(0, K, ch):
            b0 = k0 // ch * cb
            for j in range(t):
                deq_row(qt, wdata[m0 + j, b0:b0 + cb], f[j], 32)
            pack_tile(f, wp, k0 // 2, ch // 2)


@njit(parallel=True, cache=True, nogil=True)
def gemm_bf16_tiles(qt, wdata, xb, n, out, fch, wpk, ct, pk):
    """out[:n] = x @ dequant(W).T in bf16: tiles of 32 W rows handed out to the
    pool (chunk size 1, set by the caller); each worker packs its tile into
    wpk[thread] (_prep_tile, with fch[thread] and pk[thread]) and runs the
    8 x 32 kernel down all x rows."""
    M = wdata.shape[0]
    kp = xb.shape[1]
    ntiles = (M + TILE - 1) // TILE
    for ti in prange(ntiles):
        tid = numba.get_thread_id()
        wp = wpk[tid]
        c = ct[tid]
        m0 = ti * TILE
        t = min(M, m0 + TILE) - m0
        _prep_tile(qt, wdata, m0, t, fch[tid], wp, pk[tid])
        for i0 in range(0, n, ROWS):
            bf16_block(xb, i0, wp, kp, c)
            for i in range(min(ROWS, n - i0)):
                for j in range(t):
                    out[i0 + i, m0 + j] = c[i, j]
