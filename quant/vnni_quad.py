"""Q4_0 one- and two-row VNNI kernel on 512-bit vectors, bit-identical to vnni.leg_rows.

vnni.leg_rows works on 256-bit halves, two blocks a step, and gathers each
block's f16 scale with a load and an insert of its own; for Q4_0 (the default
draft format) that made decoding compute-bound: 1.6 ns a block on one core of
the 2-vCPU Xeon, so a draft's matrices streamed at 13-14 GB/s against 22 for
a plain read.  Here four consecutive blocks (72 bytes) are one step:

* their 4 x 16 bytes of nibbles come from two loads by one two-source permute
  (vpermt2w; the four qs fields sit at even offsets) and split into two 64-byte
  code vectors, lo = codes 0-15 of each block, hi = codes 16-31;
* per activation row, two vpdpbusd give 16 int32 lanes, lanes 4b..4b+3
  holding block b's partial sums;
* two steps (eight blocks) are folded into one vector of eight exact block
  sums (two lane-interleaving shuffles and adds, one permute), and from there
  the float operations are leg_rows' own: sum - 8 x code sum, times (W scale x
  row step), FMA into eight lanes (lane j: block 8q + j), a fixed tree at the
  end of the row.  The eight scales come from the two steps' first loads by one
  word permute.

So a row's result is the same bits as leg_rows' and as the row-group kernel's
(vnni.leg_grp, 3 or more rows): the choice between them stays free per row
count (batch invariance).  The activation codes come in "quad order"
(act_quant.quantize_q8_32_quad: per four blocks, their codes 0-15, then their
codes 16-31); steps and code sums are quantize_q8_32_i8's.  Rows must be whole
steps (K a multiple of 128); other matrices keep leg_rows.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .ir import (HAVE_VNNI, _c, _data, _f32, _fma_t, _i1, _i16, _i32, _i64, _literal, _load_vec, _tree8, _v8f32,
                 _v8i32, _v16i32, _v64i8, _vpdpbusd512, cpu_has, prefetch_span)

# the gather is one permute only with AVX512-VBMI's companions (Ice Lake, Zen4 and later);
# LLAMBA_QUANT_QUAD=0 keeps leg_rows
HAVE_QUAD = HAVE_VNNI and cpu_has("LLAMBA_QUANT_QUAD", "avx512vnni", "avx512vbmi")
KIND = 5                 # its kind in vnni.rows_any's dispatch (after the 32-element formats' 0-4)
QUAD_K = 128             # elements a step: K must be a multiple
QUAD_R = 2               # activation rows (vnni.LEG_ROWS_MAX: more take the row groups)
_BB = 18                 # Q4_0 block bytes
_OFF = 8                 # Q4_0's code offset
_PREFETCH = (4096, 2)    # as vnni._LEG_PREFETCH: bytes ahead, locality

# byte i of the gathered nibbles: byte j of block b's qs, i = 16 b + j
_GATHER = [18 * (i // 16) + 2 + i % 16 for i in range(64)]


def _shuf2(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_i32, len(idx)), idx))


@intrinsic
def q40_rows(typingctx, R, src, nb, xq, xd, xsum, r0, K, res):
    """res[i] = activation row r0+i . the Q4_0 W row src (nb blocks, a multiple of 4),
    i < R (1..QUAD_R); xq in quad order, xd and xsum as quantize_q8_32_i8's."""
    if not _literal(R):
        return None
    nr = R.literal_value
    assert 1 <= nr <= QUAD_R
    sig = types.void(R, src, nb, xq, xd, xsum, r0, K, res)

    def codegen(context, builder, signature, args):
        ta = signature.args
        _, srcv, nbv, xqv, xdv, xsumv, r0v, Kv, resv = args
        w = _data(context, builder, ta[1], srcv)
        xqp = _data(context, builder, ta[3], xqv)
        xdp = _data(context, builder, ta[4], xdv)
        xsp = builder.bitcast(_data(context, builder, ta[5], xsumv), _i32.as_pointer())
        resp = _data(context, builder, ta[8], resv)
        nbv, r0v, Kv = [builder.sext(v, _i64) if v.type != _i64 else v for v in (nbv, r0v, Kv)]
        rows = [builder.add(r0v, _c(i)) for i in range(nr)]
        xrows = [builder.mul(r, Kv) for r in rows]
        brows = [builder.mul(r, nbv) for r in rows]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_v8f32, None)) for _ in range(nr)]
        v32i16 = ir.VectorType(_i16, 32)
        v8i64 = ir.VectorType(_i64, 8)
        low4 = ir.Constant(_v64i8, [15] * 64)
        four = ir.Constant(_v64i8, [4] * 64)
        gather = ir.Constant(ir.VectorType(_i32, 64), _GATHER)
        zero16 = ir.Constant(_v16i32, None)

        def decode(b0):
            """Blocks b0..b0+3: (lo, hi) code vectors and the step's first 64 bytes as words."""
            base = builder.mul(b0, _c(_BB))
            prefetch_span(builder, w, base, 4 * _BB, *_PREFETCH)
            a = _load_vec(builder, w, base, _v64i8)
            # bytes 64-71 alone (a full 64-byte load could run past the mapping)
            tail = builder.load(builder.bitcast(builder.gep(w, [builder.add(base, _c(64))]), _i64.as_pointer()),
                                align=1)
            b = builder.bitcast(builder.insert_element(ir.Constant(v8i64, None), tail, _c(0, _i32)), _v64i8)
            q = builder.shuffle_vector(a, b, gather)
            return builder.and_(q, low4), builder.lshr(q, four), builder.bitcast(a, v32i16)

        def lanes(lo, hi, xo):
            x0 = _load_vec(builder, xqp, xo, _v64i8)
            x1 = _load_vec(builder, xqp, builder.add(xo, _c(64)), _v64i8)
            return _vpdpbusd512(builder, _vpdpbusd512(builder, zero16, lo, x0), hi, x1)

        def block_sums(sa, sb):
            """Two steps' lanes (block q of each in 128-bit lane q) -> v8i32 of the eight exact
            block sums in block order."""
            ilo = [j for q in range(4) for j in (4 * q, 16 + 4 * q, 4 * q + 1, 17 + 4 * q)]
            ihi = [j for q in range(4) for j in (4 * q + 2, 18 + 4 * q, 4 * q + 3, 19 + 4 * q)]
            u = builder.add(_shuf2(builder, sa, sb, ilo), _shuf2(builder, sa, sb, ihi))
            u = builder.add(u, _shuf2(builder, u, u, [j ^ 2 for j in range(16)]))
            return _shuf2(builder, u, u, [0, 4, 8, 12, 1, 5, 9, 13])

        def vec8(p, bi, t):
            return builder.load(builder.bitcast(builder.gep(p, [bi]), ir.VectorType(t, 8).as_pointer()), align=4)

        def scale_step(b0, dw, isums, keep=None):
            for isum, brow, acc in zip(isums, brows, accs):
                bi = builder.add(brow, b0)
                if keep is None:
                    xs8, xd8 = vec8(xsp, bi, _i32), vec8(xdp, bi, _f32)
                else:       # the last four blocks: lanes 4-7 read nothing, as leg_rows' _lanes
                    xs8 = _shuf2(builder, builder.load(builder.bitcast(builder.gep(xsp, [bi]),
                                                                      ir.VectorType(_i32, 4).as_pointer()), align=4),
                                ir.Constant(ir.VectorType(_i32, 4), None), list(range(8)))
                    xd8 = _shuf2(builder, builder.load(builder.bitcast(builder.gep(xdp, [bi]),
                                                                      ir.VectorType(_f32, 4).as_pointer()), align=4),
                                ir.Constant(ir.VectorType(_f32, 4), None), list(range(8)))
                isum = builder.sub(isum, builder.mul(xs8, ir.Constant(_v8i32, [_OFF] * 8)))
                s = builder.fmul(dw, xd8)
                old = builder.load(acc)
                a = _fma_t(builder, builder.sitofp(isum, _v8f32), s, old)
                builder.store(a if keep is None else builder.select(keep, a, old), acc)

        def halves8(words, idx):
            h = _shuf2(builder, *words, idx)
            return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), _v8f32)

        nq = builder.sdiv(nbv, _c(8))
        with cgutils.for_range(builder, nq) as loop:
            b0 = builder.mul(loop.index, _c(8))
            lo_a, hi_a, wa = decode(b0)
            lo_b, hi_b, wb = decode(builder.add(b0, _c(4)))
            dw = halves8((wa, wb), [0, 9, 18, 27, 32, 41, 50, 59])
            isums = []
            for xrow in xrows:
                xo = builder.add(xrow, builder.mul(b0, _c(32)))
                isums.append(block_sums(lanes(lo_a, hi_a, xo), lanes(lo_b, hi_b, builder.add(xo, _c(128)))))
            scale_step(b0, dw, isums)
        b0 = builder.mul(nq, _c(8))
        with builder.if_then(builder.icmp_signed("!=", b0, nbv)):       # four blocks left
            lo_a, hi_a, wa = decode(b0)
            dw = halves8((wa, ir.Constant(v32i16, None)), [0, 9, 18, 27, 32, 32, 32, 32])
            isums = [block_sums(lanes(lo_a, hi_a, builder.add(xrow, builder.mul(b0, _c(32)))), zero16)
                     for xrow in xrows]
            scale_step(b0, dw, isums, keep=ir.Constant(ir.VectorType(_i1, 8), [1] * 4 + [0] * 4))
        for i, acc in enumerate(accs):
            av = builder.load(acc)
            builder.store(_tree8(builder, [builder.extract_element(av, _c(j, _i32)) for j in range(8)]),
                          builder.gep(resp, [_c(i)]))
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def quad_rows(w, xq, xd, xsum, out, res, n, K, m0, m1):
    """W rows m0..m1-1 (Q4_0, K a multiple of QUAD_K) against n <= QUAD_R activation rows."""
    nb = K // 32
    if n == 1:
        for m in range(m0, m1):
            q40_rows(1, w[m], nb, xq, xd, xsum, 0, K, res)
            out[0, m] = res[0]
    else:
        for m in range(m0, m1):
            q40_rows(2, w[m], nb, xq, xd, xsum, 0, K, res)
            out[0, m] = res[0]
            out[1, m] = res[1]
