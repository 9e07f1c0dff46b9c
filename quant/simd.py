"""Explicit short-vector building blocks for the matmul kernels (Numba intrinsics).

Written with generic LLVM vector IR (no x86-specific intrinsics), so they
compile on any CPU; on x86 with AVX-512/AVX2 LLVM lowers them to what
llama.cpp's hand-written kernels use: `madd_acc` becomes vpmaddwd +
vcvtdq2ps + vfmadd, the unpackers become a handful of vpand/vpsrlw/vpmovzxbw.

Why not plain Numba loops: a 32-element block is too short.  With a literal
trip count LLVM fully unrolls the loop and the SLP vectorizer then gives up
(scalar imul per element); with a runtime trip count the loop vectorizer picks
a 64-element main loop and the block runs in the 8-wide remainder loop.
Measured on the per-block dot: loop 7 G elem/s, these 11 G elem/s.

Arrays are addressed as (array, element offset); nothing is bounds-checked,
the callers' loops guarantee the ranges.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_i8 = ir.IntType(8)
_i16 = ir.IntType(16)
_i32 = ir.IntType(32)
_f32 = ir.FloatType()


def _vec_ptr(context, builder, arrty, arr, idx, elt, n):
    """Pointer to n elements of type elt starting at arr[idx], as <n x elt>*."""
    data = context.make_array(arrty)(context, builder, arr).data
    p = builder.gep(data, [idx])
    return builder.bitcast(p, ir.VectorType(elt, n).as_pointer())


def _splat(builder, v, n):
    vt = ir.VectorType(v.type, n)
    one = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_i32, n), [0] * n))


def _idx_vec(lst):
    return ir.Constant(ir.VectorType(_i32, len(lst)), lst)


@intrinsic
def madd_acc(typingctx, acc, ao, a, ia, b, ib, scale):
    """acc[ao:ao+16] += scale * (a[ia+2k]*b[ib+2k] + a[ia+2k+1]*b[ib+2k+1]), k < 16.

    a, b: int16 arrays (32 elements used); acc: float32 array.  The pairwise
    int32 sums are exact (|a*b| < 2**15 for our codes)."""
    sig = types.void(acc, types.intp, a, types.intp, b, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        accv, aov, av, iav, bv, ibv, sc = args
        ta = signature.args
        x = builder.load(_vec_ptr(context, builder, ta[2], av, iav, _i16, 32), align=2)
        y = builder.load(_vec_ptr(context, builder, ta[4], bv, ibv, _i16, 32), align=2)
        v32 = ir.VectorType(_i32, 32)
        p = builder.mul(builder.sext(x, v32), builder.sext(y, v32))
        ev = builder.shuffle_vector(p, p, _idx_vec([2 * k for k in range(16)]))
        od = builder.shuffle_vector(p, p, _idx_vec([2 * k + 1 for k in range(16)]))
        s = builder.sitofp(builder.add(ev, od), ir.VectorType(_f32, 16))
        pacc = _vec_ptr(context, builder, ta[0], accv, aov, _f32, 16)
        cur = builder.load(pacc, align=4)
        # 'contract' lets LLVM fuse to one vfmadd; the result is still the same
        # for every call, which is all batch invariance needs
        new = builder.fadd(cur, builder.fmul(s, _splat(builder, sc, 16), flags=('contract',)),
                           flags=('contract',))
        builder.store(new, pacc, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def unpack_nibbles(typingctx, src, so, dst, do, bias):
    """16 bytes src[so:so+16] -> 32 int16 at dst[do:]: low nibbles first, then
    high nibbles (GGML's order for Q4_0/Q4_1/Q4_K), each minus bias."""
    sig = types.void(src, types.intp, dst, types.intp, types.int16)

    def codegen(context, builder, signature, args):
        sv, sov, dv, dov, bv = args
        ta = signature.args
        q = builder.load(_vec_ptr(context, builder, ta[0], sv, sov, _i8, 16), align=1)
        v16 = ir.VectorType(_i8, 16)
        lo = builder.and_(q, ir.Constant(v16, [15] * 16))
        hi = builder.lshr(q, ir.Constant(v16, [4] * 16))
        both = builder.shuffle_vector(lo, hi, _idx_vec(list(range(32))))
        w = builder.sub(builder.zext(both, ir.VectorType(_i16, 32)), _splat(builder, bv, 32))
        builder.store(w, _vec_ptr(context, builder, ta[2], dv, dov, _i16, 32), align=2)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def unpack_nibbles_5(typingctx, src, so, qh, dst, do, bias):
    """As unpack_nibbles, plus bit j of the uint32 qh as the 5th bit of element j
    (Q5_0/Q5_1)."""
    sig = types.void(src, types.intp, types.uint32, dst, types.intp, types.int16)

    def codegen(context, builder, signature, args):
        sv, sov, qhv, dv, dov, bv = args
        ta = signature.args
        q = builder.load(_vec_ptr(context, builder, ta[0], sv, sov, _i8, 16), align=1)
        v16 = ir.VectorType(_i8, 16)
        lo = builder.and_(q, ir.Constant(v16, [15] * 16))
        hi = builder.lshr(q, ir.Constant(v16, [4] * 16))
        both = builder.zext(builder.shuffle_vector(lo, hi, _idx_vec(list(range(32)))),
                            ir.VectorType(_i16, 32))
        v32 = ir.VectorType(_i32, 32)
        bits = builder.and_(builder.lshr(_splat(builder, qhv, 32), ir.Constant(v32, list(range(32)))),
                            ir.Constant(v32, [1] * 32))
        bits = builder.shl(builder.trunc(bits, ir.VectorType(_i16, 32)),
                           ir.Constant(ir.VectorType(_i16, 32), [4] * 32))
        w = builder.sub(builder.or_(both, bits), _splat(builder, bv, 32))
        builder.store(w, _vec_ptr(context, builder, ta[3], dv, dov, _i16, 32), align=2)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def widen_i8(typingctx, src, so, dst, do):
    """32 signed bytes src[so:so+32] (uint8 array holding int8) -> int16 dst[do:do+32]."""
    sig = types.void(src, types.intp, dst, types.intp)

    def codegen(context, builder, signature, args):
        sv, sov, dv, dov = args
        ta = signature.args
        q = builder.load(_vec_ptr(context, builder, ta[0], sv, sov, _i8, 32), align=1)
        w = builder.sext(q, ir.VectorType(_i16, 32))
        builder.store(w, _vec_ptr(context, builder, ta[2], dv, dov, _i16, 32), align=2)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def hsum32(typingctx, acc):
    """acc[0] + ... + acc[31] of a float32 array, in one fixed tree order."""
    sig = types.float32(acc)

    def codegen(context, builder, signature, args):
        p = _vec_ptr(context, builder, signature.args[0], args[0], ir.Constant(ir.IntType(64), 0),
                     _f32, 32)
        v = builder.load(p, align=4)
        # explicit halving tree (not llvm.vector.reduce.fadd, whose order is target-chosen)
        n = 32
        while n > 1:
            h = n // 2
            a = builder.shuffle_vector(v, v, _idx_vec(list(range(h))))
            b = builder.shuffle_vector(v, v, _idx_vec(list(range(h, n))))
            v = builder.fadd(a, b)
            n = h
        return builder.extract_element(v, ir.Constant(_i32, 0))

    return sig, codegen
