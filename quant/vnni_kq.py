"""K-quant (Q4_K, Q6_K) VNNI kernel: one W row against R activation rows.

Each 256-weight super-block of the W row is decoded once into four 64-byte
vectors of unsigned codes, plus its sub-block scales as int16 lane pairs.
Q6_K's codes come out in natural weight order.  Q4_K's come from two 64-byte
loads of its nibbles, each split by one AND and one GF(2) affine transform
(vgf2p8affineqb: the high nibble shifted down) and interleaved by qwords
(vpunpck[lh]qdq), so that both vectors of a load hold the same sub-block in the
same int32 lanes; the activation rows come in that order too (act_quant's xq4,
Q4_K_ORDER, written once per activation row).  Then, per activation row:

    Q6_K: four vpdpbusd give int32 lane sums that never mix two sub-blocks
          (4 products a lane); they are packed pairwise to int16 (vpackssdw) and
          two vpdpwssd multiply them by their sub-block scales into one vector;
    Q4_K: two chains of two vpdpbusd (8 products a lane, one sub-block each),
          one vpackssdw and one vpdpwssd.  A verify step of several rows is
          bound by these per-row multiplies; the chains cut them from 6 to 5 a
          super-block and a pack besides, for two qword shuffles a load shared
          by all rows (in cache, one thread: 4-8 rows -10 to -14%, one row +0-4%;
          Qwen2.5-Coder-1.5B's 5-row step -6.5%, its 1-row step unchanged).

No horizontal reduction per super-block, only one float FMA per row.  The lanes
are reduced once, at the end of the row.

Per (x row, W row) the float operations are the same whatever R is, so every
row count gives bit-identical results for a row (batch invariance: speculative
verification must reproduce plain decoding exactly).  Integer parts are exact:
|lane sum| <= 8 * 15 * 127 (Q4_K) or 4 * 63 * 127 (Q6_K) fits the int16 that
vpdpwssd reads.

    Q4_K:  acc += float(sum_j sc_j * dot_j) * (d * dx)
           macc += (dmin * mn_j) * xbf_j                      (8 lanes; xbf_j = dx * xsum32_j,
                                                               act_quant's, once per activation row)
           y = hsum(acc) - hsum(macc)
    Q6_K:  acc += float(sum_j sc_j * dot_j - 32 * sc_j * xsum16_j) * (d * dx)
           y = hsum(acc)

The weight stream is prefetched in software a fixed distance ahead (_PREFETCH):
with several activation rows the arithmetic per byte grows and the hardware
prefetcher alone stopped overlapping it with the loads.

Q4_K's load order: with a shift and a mask for the high nibbles it was
tried twice before (no gain streaming from DRAM); with vgf2p8affineqb the
in-cache kernel takes 5.5 instead of 6.5 ns a super-block on one Zen4 core.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ir import (HAVE_GFNI, _c, _gf_bits, _data, _fma_t, _fn, _hsumf, _i8, _i16, _i32, _i64, _literal,
                 _load_half, _load_vec, _shuf, _splat, _v8f32, _v16f32, _v16i32, _v32i8, _v64i8,
                 _vpdpbusd512, packssdw512, prefetch, prefetch_span, vpdpwssd)

Q4_K, Q6_K = 0, 1       # the kernel's kinds (literal arguments)

_v32i16 = ir.VectorType(_i16, 32)
_v16i16 = ir.VectorType(_i16, 16)
_v8i16 = ir.VectorType(_i16, 8)
_v16i8 = ir.VectorType(_i8, 16)

# Software prefetch of the weight stream: (bytes ahead, llvm locality).  With
# several rows a super-block takes longer to compute than to load, and without
# it the loads stop overlapping the arithmetic: Qwen2.5-1.5B's Q6_K ffn_down
# (8960 wide) streamed from DRAM at 2 rows took 1.8x its 1-row time, with this
# 1.2x (4 rows: 2.8x -> 1.8x).  Q6_K's long rows want the next row in L2 (8 KB
# ahead); Q4_K gains a little from 2 KB ahead into L1 and loses with the Q6_K
# setting.  One row gains too: the whole 1.5B decode step 4-8% (interleaved
# runs), where the hardware prefetcher alone leaves gaps.
_PREFETCH = {Q4_K: (2048, 3), Q6_K: (8192, 2)}


# most activation rows one call handles (2 float accumulators a row in zmm registers)
R_MAX = 8




def _twice(builder, v32):
    """32 bytes -> 64 bytes: the same 32 twice."""
    return builder.shuffle_vector(v32, v32, ir.Constant(ir.VectorType(_i32, 64), list(range(64))))


def _shr_halves(builder, v64, lo_shift, hi_shift, mask):
    """Bytes of the low 32 shifted right by lo_shift, of the high 32 by hi_shift,
    then & mask (word shifts: the mask drops what crossed from the next byte)."""
    w = builder.bitcast(v64, _v32i16)
    w = builder.lshr(w, ir.Constant(_v32i16, [lo_shift] * 16 + [hi_shift] * 16))
    return builder.and_(builder.bitcast(w, _v64i8), ir.Constant(_v64i8, [mask] * 64))


def _high_nibbles(builder, v64):
    """Each byte's high nibble as a byte: one GF(2) affine transform where the CPU
    has GFNI, else a word shift and a mask."""
    if HAVE_GFNI:
        return _gf_bits(builder, v64, [{b: b + 4 for b in range(4)}] * 8)
    w = builder.lshr(builder.bitcast(v64, _v32i16), ir.Constant(_v32i16, [4] * 32))
    return builder.and_(builder.bitcast(w, _v64i8), ir.Constant(_v64i8, [15] * 64))


def _pairs(builder, v16):
    """v16 int16 -> 16 int32 lanes (value, 0): a vpdpwssd operand that multiplies
    one signed int16 per lane."""
    return builder.zext(v16, _v16i32)


def _q4k_scales_mins(builder, q):
    """Q4_K's 12 packed bytes (q: 16 bytes from the block's byte 4) -> 16 bytes:
    the 8 six-bit scales, then the 8 six-bit mins.
        j < 4:  sc = q[j] & 63,                 mn = q[j+4] & 63
        j >= 4: sc = q[j+4] & 15 | q[j-4] >> 6 << 4,  mn = q[j+4] >> 4 | q[j] >> 6 << 4"""
    low = _shuf8(builder, q, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
    low = builder.bitcast(builder.lshr(builder.bitcast(low, _v8i16),
                                       ir.Constant(_v8i16, [0] * 6 + [4] * 2)), _v16i8)
    low = builder.and_(low, ir.Constant(_v16i8, [63] * 4 + [15] * 4 + [63] * 4 + [15] * 4))
    top = _shuf8(builder, q, [0] * 4 + [0, 1, 2, 3] + [0] * 4 + [4, 5, 6, 7])
    top = builder.bitcast(builder.lshr(builder.bitcast(top, _v8i16), ir.Constant(_v8i16, [2] * 8)), _v16i8)
    top = builder.and_(top, ir.Constant(_v16i8, ([0] * 4 + [0x30] * 4) * 2))
    return builder.or_(low, top)


def _shuf8(builder, v, idx):
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, len(idx)), idx))


def _accumulators(builder, k, nr):
    acc = [cgutils.alloca_once(builder, _v16f32) for _ in range(nr)]
    macc = [cgutils.alloca_once(builder, _v8f32) for _ in range(nr)] if k == Q4_K else []
    return acc, macc


def _emit_rows(builder, k, nr, w, nsbv, xqp, xdp, xbp, r0v, Kv, acc, macc):
    """IR for activation rows r0..r0+nr-1 against one W row at w: returns the nr
    results (float).  nsbv, r0v, Kv: i64."""
    bb = 144 if k == Q4_K else 210
    per = 8 if k == Q4_K else 16               # xb entries per super-block
    rows = [builder.add(r0v, _c(i)) for i in range(nr)]
    xrow = [builder.mul(r, Kv) for r in rows]
    drow = [builder.mul(r, nsbv) for r in rows]
    brow = [builder.mul(r, builder.mul(nsbv, _c(per))) for r in rows]
    for a in acc:
        builder.store(ir.Constant(_v16f32, None), a)
    for a in macc:
        builder.store(ir.Constant(_v8f32, None), a)
    zero = ir.Constant(_v16i32, None)
    with cgutils.for_range(builder, nsbv) as loop:
        sb = loop.index
        o = builder.mul(sb, _c(bb))
        prefetch_span(builder, w, o, bb, *_PREFETCH[k])
        codes, subs = [], []                   # 4 x 64 codes, the sub-block of each int32 lane
        if k == Q4_K:
            d = _load_half(builder, w, o)
            dmin = _load_half(builder, w, builder.add(o, _c(2)))
            scm = _q4k_scales_mins(builder, _load_vec(builder, w, builder.add(o, _c(4)), _v16i8))
            sm = builder.zext(scm, _v16i32)               # lanes 0-7 scales, 8-15 mins
            # dmin * min per sub-block, once for all rows (exact: 11 x 6 bits)
            mnf = builder.fmul(builder.sitofp(_shuf(builder, sm, list(range(8, 16))), _v8f32),
                               _splat(builder, dmin, _v8f32))
            for g in range(2):
                # 64 bytes: low nibbles are sub-blocks 4g (128-bit lanes 0-1) and
                # 4g+2 (lanes 2-3), high ones 4g+1 and 4g+3.  Interleaved by qwords
                # (vpunpck[lh]qdq) into two vectors that hold the same sub-block in
                # the same dwords (dword 4L + t: sub-block 4g + 2(L >= 2) + (t >= 2)),
                # so one accumulator takes both vpdpbusd of a row (the activation
                # rows come in this order: xq4)
                q = _load_vec(builder, w, builder.add(o, _c(16 + 64 * g)), _v64i8)
                v8i64 = ir.VectorType(_i64, 8)
                lo = builder.bitcast(builder.and_(q, ir.Constant(_v64i8, [15] * 64)), v8i64)
                hi = builder.bitcast(_high_nibbles(builder, q), v8i64)
                for odd in (0, 1):
                    idx = [2 * L + odd + 8 * p for L in range(4) for p in range(2)]
                    codes.append(builder.bitcast(builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, 8), idx)),
                                                 _v64i8))
            sv = sm
        else:
            d = _load_half(builder, w, builder.add(o, _c(208)))
            s8 = _load_vec(builder, w, builder.add(o, _c(192)), _v16i8)
            s16 = builder.sext(s8, _v16i16)
            ns = _pairs(builder, builder.mul(s16, ir.Constant(_v16i16, [-32] * 16)))
            for h in range(2):
                # 64 codes in natural order: l | l+32 (part 0), l+64 | l+96 (part 1), l < 32
                ql = _load_vec(builder, w, builder.add(o, _c(64 * h)), _v64i8)
                qh = _twice(builder, _load_vec(builder, w, builder.add(o, _c(128 + 32 * h)), _v32i8))
                for part in range(2):
                    if HAVE_GFNI:
                        # qh's two bits for these codes moved to bits 4-5 in one
                        # affine transform (a matrix per 8 bytes: the two halves differ)
                        lo, hi = 4 * part, 4 * part + 2
                        hb = _gf_bits(builder, qh, [{4: lo, 5: lo + 1}] * 4 + [{4: hi, 5: hi + 1}] * 4)
                        low4 = (builder.and_(ql, ir.Constant(_v64i8, [15] * 64)) if part == 0
                                else _high_nibbles(builder, ql))
                    else:
                        low4 = _shr_halves(builder, ql, 4 * part, 4 * part, 15)
                        hb = _shr_halves(builder, qh, 4 * part, 4 * part + 2, 3)
                        hb = builder.bitcast(builder.shl(builder.bitcast(hb, _v32i16),
                                                         ir.Constant(_v32i16, [4] * 32)), _v64i8)
                    codes.append(builder.or_(low4, hb))
                    j0 = 8 * h + 4 * part             # first sub-block of 16 in these 64 codes
                    subs.append([j0 + l // 4 for l in range(16)])
            sv = builder.zext(s16, _v16i32)
        # The dot vectors of codes 2c and 2c+1 are packed into one of int16
        # (vpackssdw, exact: |lane| < 2^15), lane pairs from one sub-block
        # each, and scaled by one vpdpwssd with (s, s) pairs.  Q4_K: codes 2c and
        # 2c+1 go into one dot vector (8 products a lane, |lane| <= 8 * 15 * 127),
        # so one pack and one vpdpwssd a row: packed lane 4L + t is sub-block
        # 4(t >= 2) + 2(L >= 2) + t % 2.
        scales = []
        if k == Q4_K:
            groups = [[4 * (t >= 2) + 2 * (L >= 2) + t % 2 for L in range(4) for t in range(4)]]
        else:
            groups = []
            for c in range(2):
                a, b = subs[2 * c], subs[2 * c + 1]
                groups.append([(a if t < 2 else b)[4 * L + 2 * (t % 2)] for L in range(4) for t in range(4)])
        for order in groups:
            s32 = _shuf(builder, sv, order)
            scales.append(builder.or_(builder.and_(s32, ir.Constant(_v16i32, [0xFFFF] * 16)),
                                      builder.shl(s32, ir.Constant(_v16i32, [16] * 16))))
        for i in range(nr):
            base = builder.add(xrow[i], builder.mul(sb, _c(256)))
            xv = [_load_vec(builder, xqp, builder.add(base, _c(64 * g)), _v64i8) for g in range(4)]
            if k == Q4_K:
                dots = [_vpdpbusd512(builder, _vpdpbusd512(builder, zero, codes[2 * c], xv[2 * c]), codes[2 * c + 1],
                                     xv[2 * c + 1]) for c in range(2)]
                isum = vpdpwssd(builder, zero, packssdw512(builder, *dots), scales[0])
            else:
                isum = zero
                for c in range(2):
                    dots = [_vpdpbusd512(builder, zero, codes[g], xv[g]) for g in (2 * c, 2 * c + 1)]
                    isum = vpdpwssd(builder, isum, packssdw512(builder, *dots), scales[c])
            xbo = builder.add(brow[i], builder.mul(sb, _c(per)))
            dx = builder.load(builder.gep(xdp, [builder.add(drow[i], sb)]))
            if k == Q4_K:
                xs = builder.load(builder.bitcast(builder.gep(xbp, [xbo]), _v8f32.as_pointer()), align=4)
                builder.store(_fma_t(builder, mnf, xs, builder.load(macc[i])), macc[i])
            else:
                xs = builder.load(builder.bitcast(builder.gep(xbp, [xbo]), _v16i32.as_pointer()), align=4)
                isum = vpdpwssd(builder, isum, xs, ns)
            step = _splat(builder, builder.fmul(d, dx), _v16f32)
            builder.store(_fma_t(builder, builder.sitofp(isum, _v16f32), step, builder.load(acc[i])), acc[i])
    ys = []
    for i in range(nr):
        y = _hsumf(builder, builder.load(acc[i]))
        if k == Q4_K:
            y = builder.fsub(y, _hsumf(builder, builder.load(macc[i])))
        ys.append(y)
    return ys


@intrinsic
def kq_rows(typingctx, kind, R, src, nsb, xq, xd, xb, r0, K, res):
    """res[i] = activation row r0+i . the W row src, i < R (1..R_MAX), Q4_K / Q6_K.

    xq int8 [n*K] flat codes (Q4_K: in its load order, act_quant's xq4), xd f32 [n*K/256] steps, xb: Q4_K the
    f32 steps x code sums per 32 ([n*K/32], act_quant's xbf), Q6_K the int32 code sums per 16 ([n*K/16]):
    act_quant.quantize_q8_256_i8."""
    if not (_literal(kind) and _literal(R)):
        return None
    k = kind.literal_value
    nr = R.literal_value
    assert k in (Q4_K, Q6_K) and 1 <= nr <= R_MAX
    sig = types.void(kind, R, src, nsb, xq, xd, xb, r0, K, res)

    def codegen(context, builder, signature, args):
        ta = signature.args
        _, _, srcv, nsbv, xqv, xdv, xbv, r0v, Kv, resv = args
        w = _data(context, builder, ta[2], srcv)
        xqp = _data(context, builder, ta[4], xqv)
        xdp = _data(context, builder, ta[5], xdv)
        xbp = _data(context, builder, ta[6], xbv)
        resp = _data(context, builder, ta[9], resv)
        nsbv, r0v, Kv = [builder.sext(v, _i64) if v.type != _i64 else v for v in (nsbv, r0v, Kv)]
        acc, macc = _accumulators(builder, k, nr)
        for i, y in enumerate(_emit_rows(builder, k, nr, w, nsbv, xqp, xdp, xbp, r0v, Kv, acc, macc)):
            builder.store(y, builder.gep(resp, [_c(i)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def kq_span1(typingctx, kind, w2, m0, m1, nsb, xq, xd, xb, K, out):
    """out[0, m] = activation row 0 . W row m for m0 <= m < m1 (decode): the loop
    over W rows inside one kernel, the same per-row IR as kq_rows (R = 1)."""
    if not _literal(kind):
        return None
    k = kind.literal_value
    assert k in (Q4_K, Q6_K)
    sig = types.void(kind, w2, m0, m1, nsb, xq, xd, xb, K, out)

    def codegen(context, builder, signature, args):
        ta = signature.args
        _, wv, m0v, m1v, nsbv, xqv, xdv, xbv, Kv, outv = args
        wa = context.make_array(ta[1])(context, builder, wv)
        w0 = wa.data
        wstride = builder.extract_value(wa.strides, 0)
        xqp = _data(context, builder, ta[5], xqv)
        xdp = _data(context, builder, ta[6], xdv)
        xbp = _data(context, builder, ta[7], xbv)
        outp = _data(context, builder, ta[9], outv)
        m0v, m1v, nsbv, Kv = [builder.sext(v, _i64) if v.type != _i64 else v for v in (m0v, m1v, nsbv, Kv)]
        acc, macc = _accumulators(builder, k, 1)
        # a chunk's first bytes: the in-loop prefetch only runs `dist` ahead of the
        # super-block in use (decode step 0.2-0.9% faster, 4 interleaved pairs)
        dist, loc = _PREFETCH[k]
        first = builder.gep(w0, [builder.mul(m0v, wstride)])
        with cgutils.for_range(builder, _c(dist // 64)) as pl:
            prefetch(builder, builder.gep(first, [builder.mul(pl.index, _c(64))]), loc)
        with cgutils.for_range(builder, builder.sub(m1v, m0v)) as loop:
            m = builder.add(m0v, loop.index)
            w = builder.gep(w0, [builder.mul(m, wstride)])
            y, = _emit_rows(builder, k, 1, w, nsbv, xqp, xdp, xbp, _c(0), Kv, acc, macc)
            builder.store(y, builder.gep(outp, [m]))
        return context.get_dummy_value()

    return sig, codegen
