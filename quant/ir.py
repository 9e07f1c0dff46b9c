"""LLVM IR building blocks for the CPU kernels (quant/vnni.py, vnni_kq.py, act_quant.py,
gemm_bf16.py): vector types, constants, loads, x86 intrinsics (VNNI, GFNI, FMA,
prefetch), fixed-order reductions, and the CPU-feature checks that decide
whether those kernels run.  Nothing here is a kernel; the kernels import it.
"""
from __future__ import annotations

import os

from llvmlite import ir
from numba import types


# The kernels declare LLVM's x86 intrinsics with the operand types of recent
# LLVM (vpdpwssd on <32 x i16>, vdpbf16ps on <32 x bfloat>); older LLVMs declared
# them on i32 vectors and would reject the IR.  Tested with LLVM 22 (llvmlite 0.50).
MIN_LLVM = (20,)


def llvm_ok() -> bool:
    try:
        from llvmlite import binding
        return tuple(binding.llvm_version_info) >= MIN_LLVM
    except Exception:
        return False


def cpu_has(env: str, *features: str, base: tuple[str, ...] = ("avx512f", "avx512bw", "avx512vl")) -> bool:
    """Whether this CPU, and the LLVM Numba compiles with, can run kernels that
    need `base` (AVX-512 F, BW, VL unless told) plus `features`; the environment
    variable env=0 turns them off."""
    if os.environ.get(env, "1") == "0" or not llvm_ok():
        return False
    try:
        from llvmlite import binding
        f = binding.get_host_cpu_features()
        return all(f.get(k, False) for k in base + features)
    except Exception:
        return False


HAVE_VNNI = cpu_has("LLAMBA_QUANT_VNNI", "avx512vnni")


# The u8 x s8 kernels (vnni.py, vnni_kq.py) also run on AVX2-only CPUs (Haswell and later,
# AMD Zen 1-3: many of the machines local models run on), with vpdpbusd spelled as
# llama.cpp spells it there: vpmaddubsw (adjacent u8 x s8 products summed to int16,
# saturating) then vpmaddwd by ones.  The same integers, hence the same bits, as long as
# a pair's sum fits int16: weight codes up to 127 against |x| <= 127 (act_quant), which every kind
# keeps (Q6_K's codes reach 63, MXFP4's 24) but Q8_0, whose codes xor 0x80 reach 255.
# So on AVX2 Q8_0's codes stay signed (I8_SIGNED) and their dots take llama.cpp's sign
# trick (_dpbssd_avx2), with no 128 * sum(x) to take back out: the same integer sums.
# INT8_DOT: the kernels run here.
INT8_DOT = HAVE_VNNI or cpu_has("LLAMBA_QUANT_AVX2", base=("avx2", "fma"))
I8_SIGNED = not HAVE_VNNI
# GFNI (Ice Lake, Zen4 and later; not Cascade Lake) unpacks Q4_K's high nibbles in one instruction
HAVE_GFNI = HAVE_VNNI and cpu_has("LLAMBA_QUANT_GFNI", "gfni")
_i1 = ir.IntType(1)
_i8 = ir.IntType(8)
_i16 = ir.IntType(16)
_i32 = ir.IntType(32)
_i64 = ir.IntType(64)
_f32 = ir.FloatType()
_v32i8 = ir.VectorType(_i8, 32)
_v16i8 = ir.VectorType(_i8, 16)
_v8i32 = ir.VectorType(_i32, 8)
_v8f32 = ir.VectorType(_f32, 8)
_v64i8 = ir.VectorType(_i8, 64)
_v16i32 = ir.VectorType(_i32, 16)
_v16f32 = ir.VectorType(_f32, 16)


def _fn(builder, name, ret, args):
    mod = builder.module
    try:
        return mod.get_global(name)
    except KeyError:
        return ir.Function(mod, ir.FunctionType(ret, args), name)


def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val).data


def _load_vec(builder, base_i8, off, vt):
    p = builder.gep(base_i8, [off])
    return builder.load(builder.bitcast(p, vt.as_pointer()), align=1)


def _load_half(builder, base_i8, off):
    p = builder.bitcast(builder.gep(base_i8, [off]), ir.IntType(16).as_pointer())
    h = builder.load(p, align=1)
    return builder.fpext(builder.bitcast(h, ir.HalfType()), _f32)


def prefetch(builder, ptr, locality):
    """llvm.prefetch for reading (locality 3: into L1 ... 1: far)."""
    i8p = _i8.as_pointer()
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8p, _i32, _i32, _i32])
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(_i32, 0), ir.Constant(_i32, locality),
                      ir.Constant(_i32, 1)])


def prefetch_span(builder, p, off, nbytes, dist, locality):
    """Prefetch every 64-byte line of the nbytes at p + off, dist bytes ahead (a weight
    stream read a span a loop iteration: consecutive spans cover every line)."""
    for j in range(0, nbytes, 64):
        prefetch(builder, builder.gep(p, [builder.add(off, _c(dist + j))]), locality)


def _splat(builder, v, vt):
    one = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_i32, vt.count), [0] * vt.count))


def _c(v, t=_i64):
    return ir.Constant(t, v)


def _vpdpbusd(builder, acc, u8, s8, signed=False):
    """acc + per int32 lane the sum of its 4 u8 x s8 products (8 lanes).  signed (AVX2
    only, see I8_SIGNED): the first operand's bytes are signed too."""
    if not HAVE_VNNI:
        return (_dpbssd_avx2 if signed else _maddubs_avx2)(builder, acc, u8, s8)
    assert not signed
    fn = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", _v8i32, [_v8i32, _v8i32, _v8i32])
    return builder.call(fn, [acc, builder.bitcast(u8, _v8i32), builder.bitcast(s8, _v8i32)])


_v16i16 = ir.VectorType(_i16, 16)


def _maddubs_avx2(builder, acc, u8, s8):
    """vpdpbusd (256 bits) on AVX2: vpmaddubsw, vpmaddwd by ones, vpaddd (see INT8_DOT)."""
    mub = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [_v32i8, _v32i8])
    p16 = builder.call(mub, [builder.bitcast(u8, _v32i8), builder.bitcast(s8, _v32i8)])
    return _maddwd_avx2(builder, acc, p16, ir.Constant(_v16i16, [1] * 16))


def _dpbssd_avx2(builder, acc, w8, x8):
    """s8 x s8 lane sums on AVX2 by llama.cpp's sign trick: |w| (u8) x sign(x, w).  Exact
    while x8 holds no -128 (act_quant's codes are within +-127): pairs reach 128 * 127 * 2."""
    w8, x8 = builder.bitcast(w8, _v32i8), builder.bitcast(x8, _v32i8)
    absb = _fn(builder, "llvm.abs.v32i8", _v32i8, [_v32i8, _i1])
    sign = _fn(builder, "llvm.x86.avx2.psign.b", _v32i8, [_v32i8, _v32i8])
    return _maddubs_avx2(builder, acc, builder.call(absb, [w8, ir.Constant(_i1, 0)]), builder.call(sign, [x8, w8]))


def _maddwd_avx2(builder, acc, a, b):
    """vpdpwssd (256 bits) on AVX2: vpmaddwd, vpaddd (the same wrapping int32 sums)."""
    mwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, [_v16i16, _v16i16])
    return builder.add(acc, builder.call(mwd, [builder.bitcast(a, _v16i16), builder.bitcast(b, _v16i16)]))


def _halves(builder, v):
    """A 512-bit vector as its two 256-bit halves, as 8 int32 lanes each."""
    v = builder.bitcast(v, _v16i32)
    lo = _shuf(builder, v, list(range(8)))
    hi = _shuf(builder, v, list(range(8, 16)))
    return lo, hi


def _join(builder, lo, hi):
    """Two vectors of one type, lo's lanes then hi's."""
    n = 2 * lo.type.count
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, n), list(range(n))))


def _by_halves(builder, op, acc, a, b):
    """A 512-bit int32-lane op as two 256-bit ones (AVX2 has no zmm registers; every
    lane's result depends on its own lane only)."""
    al, ah = _halves(builder, acc)
    xl, xh = _halves(builder, a)
    yl, yh = _halves(builder, b)
    return _join(builder, op(builder, al, xl, yl), op(builder, ah, xh, yh))


def vpdpwssd(builder, acc, a, b):
    """acc + per int32 lane (a.lo16 * b.lo16 + a.hi16 * b.hi16), 8 or 16 lanes."""
    n = acc.type.count
    if not HAVE_VNNI:
        if n == 8:
            return _maddwd_avx2(builder, acc, a, b)
        return _by_halves(builder, _maddwd_avx2, acc, a, b)
    half = ir.VectorType(_i16, 2 * n)
    # (LLVM 22 declares the word operands as <32 x i16>; an i32 declaration is
    # "auto-upgraded" into wrong code)
    fn = _fn(builder, f"llvm.x86.avx512.vpdpwssd.{32 * n}", acc.type, [acc.type, half, half])
    return builder.call(fn, [acc, builder.bitcast(a, half), builder.bitcast(b, half)])


def packssdw512(builder, a, b):
    """Two 16-lane int32 vectors -> 32 int16, per 128-bit lane: a's 4 dwords, then b's."""
    v32i16 = ir.VectorType(_i16, 32)
    if not HAVE_VNNI:
        fn = _fn(builder, "llvm.x86.avx2.packssdw", _v16i16, [_v8i32, _v8i32])
        al, ah = _halves(builder, a)
        bl, bh = _halves(builder, b)
        return _join(builder, builder.call(fn, [al, bl]), builder.call(fn, [ah, bh]))
    fn = _fn(builder, "llvm.x86.avx512.packssdw.512", v32i16, [_v16i32, _v16i32])
    return builder.call(fn, [a, b])


def _literal(t):
    return isinstance(t, types.IntegerLiteral)


def _vpdpbusd512(builder, acc, u8, s8, signed=False):
    """acc + per int32 lane the sum of its 4 u8 x s8 products (16 lanes); signed as _vpdpbusd's."""
    if not HAVE_VNNI:
        return _by_halves(builder, _dpbssd_avx2 if signed else _maddubs_avx2, acc, u8, s8)
    assert not signed
    fn = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _v16i32, [_v16i32, _v16i32, _v16i32])
    return builder.call(fn, [acc, builder.bitcast(u8, _v16i32), builder.bitcast(s8, _v16i32)])


def _fma_t(builder, a, b, c):
    t = a.type
    name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
    return builder.call(_fn(builder, name, t, [t] * 3), [a, b, c])


def _hsumf(builder, v):
    """Fixed-order halving tree over the float lanes of v."""
    n = v.type.count
    while n > 1:
        h = n // 2
        a = _shuf(builder, v, list(range(h)))
        b = _shuf(builder, v, list(range(h, n)))
        v = builder.fadd(a, b)
        n = h
    return builder.extract_element(v, _c(0, _i32))


def _tree8(builder, a):
    """((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) for 8 same-typed values."""
    t = [builder.fadd(a[j], a[j + 4]) for j in range(4)]
    u = [builder.fadd(t[j], t[j + 2]) for j in range(2)]
    return builder.fadd(u[0], u[1])


def _shuf(builder, v, idx):
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_i32, len(idx)), idx))


def _gf_bits(builder, v64, moves):
    """vgf2p8affineqb: in each byte of the i-th 8 bytes of v64, result bit b = source
    bit moves[i][b], the other bits 0 (result bit b is the parity of the source AND
    byte 7-b of that 8-byte matrix)."""
    qwords = [sum((1 << src) << (8 * (7 - dst)) for dst, src in m.items()) for m in moves]
    fn = _fn(builder, "llvm.x86.vgf2p8affineqb.512", _v64i8, [_v64i8, _v64i8, _i8])
    matrix = builder.bitcast(ir.Constant(ir.VectorType(_i64, 8), qwords), _v64i8)
    return builder.call(fn, [v64, matrix, ir.Constant(_i8, 0)])
