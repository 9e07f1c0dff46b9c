"""IEEE half <-> float32 inside Numba kernels.

Numba has no float16 type on the CPU, so f16 data travels as uint16 and these
intrinsics reinterpret the bits as LLVM `half` and convert with one instruction
(vcvtph2ps / vcvtps2ph with F16C) instead of a table lookup or bit fiddling.
"""
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def f16_to_f32(typingctx, bits):
    if not isinstance(bits, types.Integer):
        return None
    def codegen(context, builder, sig, args):
        raw = builder.trunc(args[0], ir.IntType(16)) if bits.bitwidth > 16 else args[0]
        return builder.fpext(builder.bitcast(raw, ir.HalfType()), ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def f32_to_f16(typingctx, x):
    if not isinstance(x, types.Float):
        return None
    def codegen(context, builder, sig, args):
        v = args[0]
        if x.bitwidth == 64:
            v = builder.fptrunc(v, ir.FloatType())
        return builder.bitcast(builder.fptrunc(v, ir.HalfType()), ir.IntType(16))
    return types.uint16(x), codegen


@intrinsic
def bits_to_f32(typingctx, bits):
    """Reinterpret 32 integer bits as float32 (a bf16 is the top half of these bits)."""
    if not isinstance(bits, types.Integer):
        return None
    def codegen(context, builder, sig, args):
        raw = args[0]
        if bits.bitwidth > 32:
            raw = builder.trunc(raw, ir.IntType(32))
        elif bits.bitwidth < 32:
            raw = builder.zext(raw, ir.IntType(32))
        return builder.bitcast(raw, ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def f32_to_bits(typingctx, x):
    """Reinterpret a float32 as its uint32 bits."""
    if not isinstance(x, types.Float) or x.bitwidth != 32:
        return None
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(x), codegen
