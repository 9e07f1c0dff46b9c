"""Prompt-processing matmul on Intel AMX tiles (AMX-BF16 tdpbf16ps), where the CPU has it.

Sapphire Rapids and later Xeons have eight 1 KB tile registers and a matrix unit
that multiplies a 16 x 32 bf16 tile by a 32 x 16 one into a 16 x 16 fp32 tile
in one instruction (8192 multiply-adds, one every 16 cycles: 8x AVX512_BF16's
vdpbf16ps rate).  The operands are exactly what gemm_bf16 already prepares:

* A (16 activation rows x 32 elements): 16 rows of xb, the activations as bf16
  pairs, loaded with the row stride of xb;
* B (16 pairs of K x 16 W rows): 16 rows of a packed W tile wp[p, j] = pair
  (w[j, 2p], w[j, 2p+1]), which is AMX's "VNNI" layout for B as it stands.

So the W tile is decoded and packed as for vdpbf16ps (gemm_bf16._prep_tile) and
only the inner kernel differs: 32 activation rows x 32 W rows a pass, four fp32
accumulator tiles, two A and two B tiles loaded per 32 elements of K.

Measured on a 2-core Emerald Rapids VM: a product takes 90-120 cycles in this
loop against 17 with no loads between products (the four 1 KB tile loads, not the
unit, set the pace; loading each tile just before its first product measured the
same in one process), and decoding the W tile is now most of a matmul: Q4_K
8960x1536 at 128 rows 10.5 ms against 31.8 with vdpbf16ps, of which ~4.7 ms
is the decode (the time at 32 rows).

The products and sums are not bit-identical to the vdpbf16ps kernel's (the unit
adds a pair's two products and the accumulator in its own order, denormals
flushed): like the rest of prompt processing, this path only has to stay within
the bf16 error bound; one-token decode and speculative verification never take it.

Linux hands out the tile state only on request: arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA), once per process (HAVE_AMX is False if it refuses).
LLAMBA_AMX=0 turns the path off.
"""
from __future__ import annotations

import ctypes

import numba
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .gemm_bf16 import TILE, _prep_tile
from .ir import _c, _data, _fn, _i8, _i64, cpu_has

ROWS = 32           # activation rows a pass (two A tiles)
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _request_tiles() -> bool:
    """Ask Linux for the AMX tile state (without it the first tile load kills the process)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except Exception:
        return False


# the CPU (and the LLVM Numba compiles with) has the tiles, LLAMBA_AMX is not 0, and Linux grants them
HAVE_AMX = cpu_has("LLAMBA_AMX", "avx512bf16", "amx-tile", "amx-bf16") and _request_tiles()

# tile registers: C (accumulators) 0-3, A 4-5, B 6-7
_C, _A, _B = (0, 1, 2, 3), (4, 5), (6, 7)


def _imm(t):
    return ir.Constant(_i8, t)


def _tile_config(builder):
    """A 64-byte tile configuration: palette 1, all eight tiles 16 rows x 64 bytes."""
    cfg = bytearray(64)
    cfg[0] = 1                                  # palette_id
    for t in range(8):
        cfg[16 + 2 * t] = 64                    # bytes a row (u16, little-endian)
        cfg[48 + t] = 16                        # rows
    arr = ir.ArrayType(_i8, 64)
    p = builder.alloca(arr)
    builder.store(ir.Constant(arr, list(cfg)), p)
    return builder.bitcast(p, _i8.as_pointer())


@intrinsic
def amx_block(typingctx, xb, i0, wp, kp, ct):
    """ct[i, j] = sum_p x pair (i0+i, p) . w pair (p, j) for i < 32, j < 32, fp32.

    xb uint32 [rows, kp] (rows >= i0 + 32), wp uint32 [kp, 32], ct f32 [32, 32];
    kp a multiple of 16 (K of 32)."""
    sig = types.void(xb, i0, wp, kp, ct)

    def codegen(context, builder, signature, args):
        ta = signature.args
        xbv, i0v, wpv, kpv, ctv = args
        i8p = _i8.as_pointer()
        xp = builder.bitcast(_data(context, builder, ta[0], xbv), i8p)
        wpp = builder.bitcast(_data(context, builder, ta[2], wpv), i8p)
        cp = builder.bitcast(_data(context, builder, ta[4], ctv), i8p)
        i0v, kpv = [builder.sext(v, _i64) if v.type != _i64 else v for v in (i0v, kpv)]
        void = ir.VoidType()
        ldcfg = _fn(builder, "llvm.x86.ldtilecfg", void, [i8p])
        load = _fn(builder, "llvm.x86.tileloadd64", void, [_i8, i8p, _i64])
        store = _fn(builder, "llvm.x86.tilestored64", void, [_i8, i8p, _i64])
        zero = _fn(builder, "llvm.x86.tilezero", void, [_i8])
        dp = _fn(builder, "llvm.x86.tdpbf16ps", void, [_i8, _i8, _i8])
        release = _fn(builder, "llvm.x86.tilerelease", void, [])
        builder.call(ldcfg, [_tile_config(builder)])
        for t in _C:
            builder.call(zero, [_imm(t)])
        xstride = builder.mul(kpv, _c(4))
        xrow = [builder.mul(builder.add(i0v, _c(16 * h)), xstride) for h in range(2)]
        wstride = _c(4 * TILE)
        nsteps = builder.udiv(kpv, _c(16))
        with cgutils.for_range(builder, nsteps) as loop:
            p0 = builder.mul(loop.index, _c(16))
            for h in range(2):
                builder.call(load, [_imm(_A[h]), builder.gep(xp, [builder.add(xrow[h], builder.mul(p0, _c(4)))]),
                                    xstride])
                builder.call(load, [_imm(_B[h]), builder.gep(wpp, [builder.add(builder.mul(p0, wstride),
                                                                               _c(64 * h))]), wstride])
            for a in range(2):
                for b in range(2):
                    builder.call(dp, [_imm(_C[2 * a + b]), _imm(_A[a]), _imm(_B[b])])
        for a in range(2):
            for b in range(2):
                # ct rows 16a.., columns 16b..: 128 bytes a row
                builder.call(store, [_imm(_C[2 * a + b]), builder.gep(cp, [_c(16 * a * 128 + 64 * b)]), _c(128)])
        builder.call(release, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, cache=True, nogil=True)
def gemm_amx_tiles(qt, wdata, xb, n, out, fch, wpk, ct, pk):
    """As gemm_bf16.gemm_bf16_tiles, with the AMX kernel: xb rows padded to a
    multiple of 32, ct f32 [threads, 32, 32]."""
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
            amx_block(xb, i0, wp, kp, c)
            for i in range(min(ROWS, n - i0)):
                for j in range(t):
                    out[i0 + i, m0 + j] = c[i, j]
