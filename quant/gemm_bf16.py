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
per pair of K, two loads of W, eight broadcasts of x, sixteen vdpbf16ps.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .dequant import deq_row
from .vnni import _c, _data, _fn, _i16, _i32, _i64, _splat, _v16f32, _v16i32, cpu_has

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
        fstride = builder.extract_value(fa.strides, 0)          # bytes per row of f
        fstride = builder.udiv(fstride, _c(4))
        wpp = _data(context, builder, ta[1], wpv)
        p0v, npv = [builder.sext(v, _i64) if v.type != _i64 else v for v in (p0v, npv)]
        v16i16 = ir.VectorType(_i16, 16)
        with cgutils.for_range(builder, builder.udiv(npv, _c(16))) as loop:
            q0 = builder.mul(loop.index, _c(16))                 # first pair of this group
            for jb in (0, 16):
                packed = []
                for r in range(16):
                    base = builder.add(builder.mul(_c(jb + r), fstride), builder.mul(q0, _c(2)))
                    halves = []
                    for h in range(2):
                        ptr = builder.bitcast(builder.gep(fp, [builder.add(base, _c(16 * h))]), _v16f32.as_pointer())
                        halves.append(builder.trunc(_round_bf16(builder, builder.load(ptr, align=4)), v16i16))
                    both = builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_i32, 32), list(range(32))))
                    packed.append(builder.bitcast(both, _v16i32))   # lane q: pair q of row jb + r
                for q, col in enumerate(_transpose16(builder, packed)):
                    off = builder.add(builder.mul(builder.add(builder.add(p0v, q0), _c(q)), _c(TILE)), _c(jb))
                    builder.store(col, builder.bitcast(builder.gep(wpp, [off]), _v16i32.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _bf16_bits(v):
    """float32 -> bfloat16 bits, round to nearest even (finite values)."""
    u = np.uint32(np.float32(v).view(np.uint32))
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(parallel=True, cache=True)
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


@njit(parallel=True, cache=True)
def gemm_bf16_tiles(qt, wdata, xb, n, out, fch, wpk, ct):
    """out[:n] = x @ dequant(W).T in bf16: tiles of 32 W rows handed out to the
    pool (chunk size 1, set by the caller); each worker dequantizes its tile a
    column chunk at a time into fch[thread] (32 x chunk_cols(K) floats: stays in
    L1), packs it into wpk[thread] and runs the 8 x 32 kernel down all x rows."""
    M = wdata.shape[0]
    kp = xb.shape[1]
    K = 2 * kp
    ch = fch.shape[2]
    cb = wdata.shape[1] * ch // K          # bytes of a row's chunk
    ntiles = (M + TILE - 1) // TILE
    for ti in prange(ntiles):
        tid = numba.get_thread_id()
        f = fch[tid]
        wp = wpk[tid]
        c = ct[tid]
        m0 = ti * TILE
        t = min(M, m0 + TILE) - m0
        for j in range(t, TILE):
            f[j, :] = 0
        for k0 in range(0, K, ch):
            b0 = k0 // ch * cb
            for j in range(t):
                deq_row(qt, wdata[m0 + j, b0:b0 + cb], f[j], 32)
            pack_tile(f, wp, k0 // 2, ch // 2)
        for i0 in range(0, n, ROWS):
            bf16_block(xb, i0, wp, kp, c)
            for i in range(min(ROWS, n - i0)):
                for j in range(t):
                    out[i0 + i, m0 + j] = c[i, j]
