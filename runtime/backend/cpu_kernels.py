"""Numba kernels for the non-matmul ops of a transformer step on the CPU.

The quantized matmuls live in quant/; these are the small ops between them.
All take preallocated outputs so the token loop allocates nothing.
"""
from __future__ import annotations

import math

import quant  # noqa: F401  (first: it points Numba's cache at quant/kernel_cache.py's folder)
import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from quant.half import bits_to_f32, f16_to_f32, f32_to_f16
from quant.ir import prefetch

_JIT = dict(cache=True, nogil=True, fastmath=True)
# no ZeroDivisionError check (its branch keeps a loop with a division scalar)
_JIT_VEC = dict(_JIT, error_model="numpy")


@nb.njit(**_JIT)
def rmsnorm(x, w, eps, out):
    """out[i] = x[i] / rms(x[i]) * w, row by row (rows may be heads: x is [R, D])."""
    n, d = x.shape
    for i in range(n):
        ss = np.float32(0.0)
        for j in range(d):
            ss += x[i, j] * x[i, j]
        r = np.float32(1.0) / np.sqrt(ss / d + eps)
        for j in range(d):
            out[i, j] = x[i, j] * r * w[j]


@nb.njit(inline="always")
def _rotate(x, t, hh, i, half, c, s, neox):
    """Rotate pair i of x[t, hh] by the angle whose cos/sin are c, s: dims (i, i + half)
    (NeoX) or (2i, 2i + 1) (GPT-J).  One definition for rope and kv_shift's K rows."""
    j0 = i if neox else 2 * i
    j1 = i + half if neox else 2 * i + 1
    a = x[t, hh, j0]
    b = x[t, hh, j1]
    x[t, hh, j0] = a * c - b * s
    x[t, hh, j1] = a * s + b * c


@nb.njit(**_JIT)
def rope(x, positions, inv_freq, neox, pos_scale, mscale):
    """Rotate x [N, H, D] in place by each token's position (first 2*len(inv_freq) dims),
    cos and sin times mscale (YaRN's / LongRoPE's magnitude; 1 leaves the rotation exact)."""
    n, h, d = x.shape
    half = inv_freq.shape[0]
    for t in range(n):
        p = positions[t] / pos_scale
        for i in range(half):
            ang = p * inv_freq[i]
            c = np.float32(math.cos(ang)) * mscale
            s = np.float32(math.sin(ang)) * mscale
            for hh in range(h):
                _rotate(x, t, hh, i, half, c, s, neox)


@nb.njit(inline="always")
def _sigmoid(v):
    """1 / (1 + exp(-v)) through _exp_le0(-|v|) (no overflow, branch-free selects,
    so loops over it vectorize; np.exp was a scalar libm call per element)."""
    e = _exp_le0(-abs(v))
    r = np.float32(1.0) / (np.float32(1.0) + e)
    return r if v >= 0 else e * r


@nb.njit(**_JIT_VEC)
def silu_mul(g, u):
    """g = silu(g) * u (SwiGLU), in place."""
    n, d = g.shape
    for i in range(n):
        gi = g[i]
        ui = u[i]
        for j in range(d):
            v = gi[j]
            gi[j] = v * _sigmoid(v) * ui[j]


@nb.njit(**_JIT_VEC)
def gelu_mul(g, u):
    """g = gelu_tanh(g) * u (GeGLU), in place: 0.5 v (1 + tanh(y)) = v sigmoid(2y),
    y = sqrt(2/pi) (v + 0.044715 v^3)."""
    n, d = g.shape
    c = np.float32(2.0 * math.sqrt(2.0 / math.pi))
    for i in range(n):
        gi = g[i]
        ui = u[i]
        for j in range(d):
            v = gi[j]
            gi[j] = v * _sigmoid(c * (v + np.float32(0.044715) * v * v * v)) * ui[j]


# gpt-oss's experts: SwiGLU with the gate clamped from above and up on both sides, and
# up shifted by one; alpha and limit are fixed by the architecture (llama.cpp's too)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


@nb.njit(**_JIT_VEC)
def swiglu_oai_mul(g, u):
    """g = (clamp(u, -7, 7) + 1) * v * sigmoid(1.702 v), v = min(g, 7), in place."""
    n, d = g.shape
    a = np.float32(SWIGLU_OAI_ALPHA)
    lim = np.float32(SWIGLU_OAI_LIMIT)
    for i in range(n):
        gi = g[i]
        ui = u[i]
        for j in range(d):
            v = min(gi[j], lim)
            w = min(max(ui[j], -lim), lim)
            gi[j] = (w + np.float32(1.0)) * (v * _sigmoid(a * v))


@nb.njit(**_JIT)
def add_inplace(x, y):
    n, d = x.shape
    for i in range(n):
        for j in range(d):
            x[i, j] += y[i, j]


# A matmul's bias rows: one call where NumPy's ufunc costs ~6 us a call on a 896-wide
# row (Qwen2's q, k and v biases: 3 a layer); x + b rounded once, as np.add rounds it.
@nb.njit(**_JIT)
def add_bias(x, b):
    n, d = x.shape
    for i in range(n):
        for j in range(d):
            x[i, j] += b[j]


@nb.njit(**_JIT)
def add_bias3(x0, b0, x1, b1, x2, b2):
    add_bias(x0, b0)
    add_bias(x1, b1)
    add_bias(x2, b2)


# ---- KV cache: write, attention, shift ---------------------------------------------
#
# K/V pools are [n_slots, KVH, D] per layer, slot = block * block_size + offset.
# f16 cache: uint16 f16 bits.  q8_0 cache: int8 values plus one f16 scale per 32
# values ([n_slots, KVH, D // 32] uint16), the GGML Q8_0 layout split in two arrays
# so the int8 rows stay contiguous.  k16v8 cache: K as f16, V as q8_0 (K's outlier
# channels make a q8_0 K cost Qwen2.5 +5.9% perplexity; V quantizes well).  Kernels
# take a flag for each of K (kq) and V (vq) and every pool kind compiles from the
# same source (the branch is per block, not per value).

QK8 = 32
# fastmath without nnan/ninf: attention masks with -inf and must compare against it
_JIT_INF = dict(cache=True, nogil=True, fastmath={"reassoc", "contract", "arcp", "nsz", "afn"})


@nb.njit(inline="always")
def _q8_store(x, pool, scales, s, h):
    d = x.shape[0]
    for b0 in range(0, d, QK8):
        amax = np.float32(0.0)
        for j in range(b0, b0 + QK8):
            a = abs(x[j])
            if a > amax:
                amax = a
        dq = amax / np.float32(127.0)
        inv = np.float32(1.0) / dq if dq > 0 else np.float32(0.0)
        scales[s, h, b0 // QK8] = f32_to_f16(dq)
        for j in range(b0, b0 + QK8):
            v = x[j] * inv      # round half away from zero, as GGML's roundf
            pool[s, h, j] = np.int8(int(v + np.float32(0.5)) if v >= 0 else -int(np.float32(0.5) - v))


@nb.njit(inline="always")
def _exp_le0(x):
    """exp(x) for x <= 0 (0 for x < -87), branch-free so loops over it vectorize:
    2^(x log2 e) = 2^n * 2^f with a degree-6 polynomial for 2^f, f in [0, 1)
    (relative error ~2e-7; libm's scalar expf call was half of decode attention)."""
    t = max(x, np.float32(-87.0)) * np.float32(1.4426950408889634)
    n = np.floor(t)
    f = t - n
    p = np.float32(1.5403530e-4)
    p = p * f + np.float32(1.3333558e-3)
    p = p * f + np.float32(9.6181291e-3)
    p = p * f + np.float32(5.5504109e-2)
    p = p * f + np.float32(2.4022651e-1)
    p = p * f + np.float32(6.9314718e-1)
    p = p * f + np.float32(1.0)
    return p * bits_to_f32(np.uint32((np.int32(n) + 127) << 23))


@nb.njit(inline="always")
def _load_row(pool, scales, quantized, s, h, out, r):
    """out[r, :] = K or V row (slot s, kv head h) as float32."""
    d = out.shape[1]
    if quantized:
        for b0 in range(0, d, QK8):
            dq = f16_to_f32(np.uint16(scales[s, h, b0 // QK8]))
            for j in range(b0, b0 + QK8):
                out[r, j] = np.float32(pool[s, h, j]) * dq
    else:
        for j in range(d):
            out[r, j] = f16_to_f32(np.uint16(pool[s, h, j]))


@nb.njit(**_JIT)
def kv_write(k, v, k_pool, v_pool, k_scale, v_scale, kq, vq, slots):
    """Store the new tokens' K and V (f32 [N, KVH, D]) at their cache slots
    (f16 bits, or q8_0 values + scales where kq / vq)."""
    n, kvh, d = k.shape
    for t in range(n):
        s = slots[t]
        for h in range(kvh):
            if kq:
                _q8_store(k[t, h], k_pool, k_scale, s, h)
            else:
                for j in range(d):
                    k_pool[s, h, j] = f32_to_f16(k[t, h, j])
            if vq:
                _q8_store(v[t, h], v_pool, v_scale, s, h)
            else:
                for j in range(d):
                    v_pool[s, h, j] = f32_to_f16(v[t, h, j])


@nb.njit(inline="always")
def _split_key(p, window, n_splits, block_size):
    """(first key, split length) a token at position p would get alone: rows that
    share both split their context identically."""
    lo = 0
    if window > 0 and p - window + 1 > 0:
        lo = p - window + 1
    if n_splits == 1:
        return lo, 0
    chunk = (p + 1 - lo + n_splits - 1) // n_splits
    return lo, (chunk + block_size - 1) // block_size * block_size


@nb.njit(**_JIT)
def attention_tiles(seq_of_token, positions, max_tile, tile_t0, tile_n, window=0, n_splits=1,
                    block_size=16, exact=False):
    """Cut the step's tokens into query tiles: runs of consecutive positions of
    one sequence, at most max_tile long.  Returns the number of tiles.

    exact: also cut where a token's own key range would split differently (its
    window start, or its context split length under flash-decoding), so every
    row of a tile walks the keys exactly as it would alone -- the output of a
    token in a small step is then bit-identical to stepping it by itself."""
    n = seq_of_token.shape[0]
    nt = 0
    t = 0
    while t < n:
        e = t + 1
        lo_t, ch_t = _split_key(positions[t], window, n_splits, block_size)
        while (e < n and e - t < max_tile and seq_of_token[e] == seq_of_token[t]
               and positions[e] == positions[e - 1] + 1):
            if exact:
                lo_e, ch_e = _split_key(positions[e], window, n_splits, block_size)
                if lo_e != lo_t or ch_e != ch_t:
                    break
            e += 1
        tile_t0[nt] = t
        tile_n[nt] = e - t
        nt += 1
        t = e
    return nt


@nb.njit(**_JIT)
def attention_tiles_into(seq_of_token, positions, max_tile, tile_t0, tile_n, window, n_splits, block_size,
                         exact, tile_count):
    """attention_tiles, the tile count written to tile_count[0]."""
    tile_count[0] = attention_tiles(seq_of_token, positions, max_tile, tile_t0, tile_n, window, n_splits,
                                    block_size, exact)


# ---- 16-float vectors for the attention micro-kernels ----------------------------
#
# Plain Numba loops keep an accumulator row in memory (a load and a store around
# every FMA: LLVM cannot prove the accumulator does not alias the tiles it reads)
# and re-enter a vectorized loop with runtime alias checks for every head dim;
# measured, such score loops ran at 12-40 GFLOP/s.  A value type that lowers to
# LLVM's <16 x float> lets the kernels below hold 16 accumulators in registers
# (4 query rows x 64 keys, or 4 rows x 64 head dims) the way a GEMM micro-kernel
# does.  Generic vector IR: AVX-512 gets one zmm per value, AVX2 two ymm.

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_VW = 16
_V16 = ir.VectorType(_F32, _VW)
_I16V = ir.VectorType(_I32, _VW)


class _F32x16(types.Type):
    def __init__(self):
        super().__init__(name="f32x16")


f32x16 = _F32x16()


@register_model(_F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V16)


def _vptr(context, builder, arrty, arr, idx):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [idx]), _V16.as_pointer())


def _vsplat_ir(builder, x):
    one = builder.insert_element(ir.Constant(_V16, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(_I16V, [0] * _VW))


def _intr(builder, name, ty, nargs):
    """The LLVM intrinsic `name` overloaded on float or <n x float> type ty."""
    suffix = f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * nargs), f"{name}.{suffix}")


def _vcall(builder, name, args):
    return builder.call(_intr(builder, name, _V16, len(args)), args)


def _is_f32_array(a):
    return isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C"


@intrinsic
def prefetch_l2(typingctx, arr, i):
    """Ask for the cache line holding arr.flat[i] into L2 (a C-contiguous array; no
    bounds check: a prefetch never faults)."""
    if not (isinstance(arr, types.Array) and arr.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        prefetch(builder, builder.gep(data, [args[1]]), 2)
        return context.get_dummy_value()
    return types.void(arr, types.intp), codegen


@intrinsic
def vload(typingctx, arr, i):
    """arr.flat[i:i+16] of a C-contiguous float32 array (no bounds check)."""
    if not _is_f32_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_vptr(context, builder, sig.args[0], args[0], args[1]), align=4)
    return f32x16(arr, types.intp), codegen


@intrinsic
def vload_f16(typingctx, arr, i):
    """arr.flat[i:i+16] of a C-contiguous uint16 (f16 bits) array, widened to float32."""
    if not (isinstance(arr, types.Array) and arr.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        if sig.args[0].dtype != types.uint16:
            # typed for the q8_0 pool too (one kernel source for both), never called there
            return ir.Constant(_V16, [0.0] * _VW)
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        vh = ir.VectorType(ir.HalfType(), _VW)
        ptr = builder.bitcast(builder.gep(data, [args[1]]), vh.as_pointer())
        return builder.fpext(builder.load(ptr, align=2), _V16)
    return f32x16(arr, types.intp), codegen


@intrinsic
def vstore(typingctx, arr, i, v):
    """arr.flat[i:i+16] = v."""
    if not _is_f32_array(arr) or v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _vptr(context, builder, sig.args[0], args[0], args[1]), align=4)
        return context.get_dummy_value()
    return types.void(arr, types.intp, f32x16), codegen


@intrinsic
def vsplat(typingctx, x):
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if sig.args[0].bitwidth == 64:
            v = builder.fptrunc(v, _F32)
        return _vsplat_ir(builder, v)
    return f32x16(x), codegen


@intrinsic
def vzero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_V16, [0.0] * _VW)
    return f32x16(), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c, fused."""
    if a != f32x16 or b != f32x16 or c != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _vcall(builder, "llvm.fma", list(args))
    return f32x16(a, b, c), codegen


@intrinsic
def vmax(typingctx, a, b):
    if a != f32x16 or b != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _vcall(builder, "llvm.maxnum", list(args))
    return f32x16(a, b), codegen


@intrinsic
def vadd(typingctx, a, b):
    if a != f32x16 or b != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return f32x16(a, b), codegen


def _hreduce(builder, v, op):
    """Reduce the 16 lanes pairwise (fixed order: halves folded onto halves)."""
    n = _VW
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, n))))
        v = op(lo, hi)
        n = h
    return builder.extract_element(v, ir.Constant(_I32, 0))


@intrinsic
def hsum(typingctx, a):
    if a != f32x16:
        return None

    def codegen(context, builder, sig, args):
        return _hreduce(builder, args[0], builder.fadd)
    return types.float32(a), codegen


@intrinsic
def hmax(typingctx, a):
    if a != f32x16:
        return None

    def codegen(context, builder, sig, args):
        def mx(x, y):
            return builder.call(_intr(builder, "llvm.maxnum", x.type, 2), [x, y])
        return _hreduce(builder, args[0], mx)
    return types.float32(a), codegen


@intrinsic
def vexp_le0(typingctx, a):
    """Lane-wise _exp_le0 (same polynomial)."""
    if a != f32x16:
        return None

    def codegen(context, builder, sig, args):
        def k(x):
            return ir.Constant(_V16, [x] * _VW)
        t = builder.fmul(_vcall(builder, "llvm.maxnum", [args[0], k(-87.0)]), k(1.4426950408889634))
        n = _vcall(builder, "llvm.floor", [t])
        f = builder.fsub(t, n)
        p = k(1.5403530e-4)
        for c in (1.3333558e-3, 9.6181291e-3, 5.5504109e-2, 2.4022651e-1, 6.9314718e-1, 1.0):
            p = _vcall(builder, "llvm.fma", [p, f, k(c)])
        e = builder.shl(builder.add(builder.fptosi(n, _I16V), ir.Constant(_I16V, [127] * _VW)),
                        ir.Constant(_I16V, [23] * _VW))
        return builder.fmul(p, builder.bitcast(e, _V16))
    return f32x16(a), codegen


def _transpose16(builder, rows):
    """16 <16 x float> rows -> 16 columns: 4 butterfly stages of 2-input shuffles."""
    rows = list(rows)
    b = 1
    while b < _VW:
        nxt = list(rows)
        for i in range(_VW):
            if i & b:
                continue
            lo = [l if not l & b else _VW + l - b for l in range(_VW)]
            hi = [l + b if not l & b else _VW + l for l in range(_VW)]
            nxt[i] = builder.shuffle_vector(rows[i], rows[i + b], ir.Constant(_I16V, lo))
            nxt[i + b] = builder.shuffle_vector(rows[i], rows[i + b], ir.Constant(_I16V, hi))
        rows = nxt
        b *= 2
    return rows


@intrinsic
def kt16_f16(typingctx, pool, offs, i0, x0, kt, o, ld):
    """Convert and transpose a 16 x 16 block of f16 K: for i, j < 16,
    kt.flat[o + j*ld + i] = f16(pool.flat[offs[i0 + i] + x0 + j])."""
    if not (isinstance(pool, types.Array) and _is_f32_array(kt)):
        return None
    sig = types.void(pool, offs, types.intp, types.intp, kt, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        if signature.args[0].dtype != types.uint16:
            # typed for the q8_0 pool too (one kernel source for both), never called there
            return context.get_dummy_value()
        pool_v, offs_v, i0_v, x0_v, kt_v, o_v, ld_v = args
        ta = signature.args
        pdata = context.make_array(ta[0])(context, builder, pool_v).data
        odata = context.make_array(ta[1])(context, builder, offs_v).data
        kdata = context.make_array(ta[4])(context, builder, kt_v).data
        vh = ir.VectorType(ir.HalfType(), _VW)
        rows = []
        for i in range(_VW):
            off = builder.load(builder.gep(odata, [builder.add(i0_v, ir.Constant(i0_v.type, i))]))
            off = context.cast(builder, off, ta[1].dtype, types.intp)
            ptr = builder.bitcast(builder.gep(pdata, [builder.add(off, x0_v)]), vh.as_pointer())
            rows.append(builder.fpext(builder.load(ptr, align=2), _V16))
        for j, col in enumerate(_transpose16(builder, rows)):
            idx = builder.add(o_v, builder.mul(ld_v, ir.Constant(ld_v.type, j)))
            builder.store(col, builder.bitcast(builder.gep(kdata, [idx]), _V16.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


# keys per K/V tile of paged_attention (4 vectors: the micro-kernels are written
# for exactly 4 x 16 keys); the tile is converted to f32 once per work item
# (K transposed, [Dp, BK]) and stays in L1/L2 while every query row runs against it
ATTN_BK = 64
# K/V tiles prefetched ahead into L2: at long contexts a decode step's attention
# reads every cached key once from DRAM, and without it the loads did not overlap
# the arithmetic (SmolLM2 at 4096 tokens: 10.0-10.3 -> 8.6-9.0 ms of attention a
# token; 1 tile ahead or into L1 did less)
ATTN_PREFETCH = 2
# query rows per micro-kernel call (4 rows x 4 vectors = 16 accumulators)
_RB = 4
# "no score yet" for the running max: finite, so the kernel can use full fastmath
# (exp(NEG - m) underflows through _exp_le0's clamp, and l = 0 and acc = 0 then)
_NEG = np.float32(-1e30)


@nb.njit(inline="always")
def _prefetch_keys(k_pool, v_pool, table, block_size, kvh, kh, d, p0, p1):
    """Prefetch the f16 K and V rows of kv head kh for cache positions [p0, p1)."""
    p = p0
    while p < p1:
        blk = p // block_size
        off = p - blk * block_size
        run = min(p1 - p, block_size - off)
        base = table[blk] * block_size + off
        for e in range(run):
            ro = ((base + e) * kvh + kh) * d
            for x in range(0, d, 32):       # 64 bytes of f16
                prefetch_l2(k_pool, ro + x)
                prefetch_l2(v_pool, ro + x)
        p += run


@nb.njit(inline="always")
def _load_col(pool, scales, quantized, s, h, d, out, c):
    """out[:d, c] = K row (slot s, kv head h) as float32: the transposed tile."""
    if quantized:
        for b0 in range(0, d, QK8):
            dq = f16_to_f32(np.uint16(scales[s, h, b0 // QK8]))
            for j in range(b0, b0 + QK8):
                out[j, c] = np.float32(pool[s, h, j]) * dq
    else:
        for j in range(d):
            out[j, c] = f16_to_f32(np.uint16(pool[s, h, j]))


@nb.njit(inline="always")
def _load_row_d(pool, scales, quantized, s, h, d, out, r):
    """out[r, :d] = V row (slot s, kv head h) as float32."""
    if quantized:
        for b0 in range(0, d, QK8):
            dq = f16_to_f32(np.uint16(scales[s, h, b0 // QK8]))
            for j in range(b0, b0 + QK8):
                out[r, j] = np.float32(pool[s, h, j]) * dq
    else:
        for j in range(d):
            out[r, j] = f16_to_f32(np.uint16(pool[s, h, j]))


@nb.njit(**_JIT)
def _scores_r(qs, r0, kt, sc, R):
    """sc[i, :] = qs[r0 + i] . kt[:, :] for the R <= 4 rows i (R a compile-time
    literal: no work for rows a GQA group does not have) and all 64 keys of the
    tile: register accumulators, each a sequential FMA chain over the head dim (so
    a row's scores do not depend on which rows share its call)."""
    nb.literally(R)
    dp = qs.shape[1]
    a00 = vzero(); a01 = vzero(); a02 = vzero(); a03 = vzero()
    a10 = vzero(); a11 = vzero(); a12 = vzero(); a13 = vzero()
    a20 = vzero(); a21 = vzero(); a22 = vzero(); a23 = vzero()
    a30 = vzero(); a31 = vzero(); a32 = vzero(); a33 = vzero()
    for x in range(dp):
        o = x * ATTN_BK
        k0 = vload(kt, o)
        k1 = vload(kt, o + 16)
        k2 = vload(kt, o + 32)
        k3 = vload(kt, o + 48)
        b = vsplat(qs[r0, x])
        a00 = vfma(b, k0, a00); a01 = vfma(b, k1, a01); a02 = vfma(b, k2, a02); a03 = vfma(b, k3, a03)
        if R > 1:
            b = vsplat(qs[r0 + 1, x])
            a10 = vfma(b, k0, a10); a11 = vfma(b, k1, a11); a12 = vfma(b, k2, a12); a13 = vfma(b, k3, a13)
        if R > 2:
            b = vsplat(qs[r0 + 2, x])
            a20 = vfma(b, k0, a20); a21 = vfma(b, k1, a21); a22 = vfma(b, k2, a22); a23 = vfma(b, k3, a23)
        if R > 3:
            b = vsplat(qs[r0 + 3, x])
            a30 = vfma(b, k0, a30); a31 = vfma(b, k1, a31); a32 = vfma(b, k2, a32); a33 = vfma(b, k3, a33)
    vstore(sc, 0, a00); vstore(sc, 16, a01); vstore(sc, 32, a02); vstore(sc, 48, a03)
    if R > 1:
        vstore(sc, 64, a10); vstore(sc, 80, a11); vstore(sc, 96, a12); vstore(sc, 112, a13)
    if R > 2:
        vstore(sc, 128, a20); vstore(sc, 144, a21); vstore(sc, 160, a22); vstore(sc, 176, a23)
    if R > 3:
        vstore(sc, 192, a30); vstore(sc, 208, a31); vstore(sc, 224, a32); vstore(sc, 240, a33)


@nb.njit(**_JIT)
def _pv4(sc, vf, acc, r0, cu0, cu1):
    """acc[r0 + i, :] += sum_c sc[i, c] * vf[c, :] for c in [cu0, cu1), 4 rows, the
    head dim 64 at a time in 16 register accumulators, keys in order."""
    dp = acc.shape[1]
    for x0 in range(0, dp, 64):
        o0 = r0 * dp + x0
        a00 = vload(acc, o0); a01 = vload(acc, o0 + 16); a02 = vload(acc, o0 + 32); a03 = vload(acc, o0 + 48)
        o1 = o0 + dp
        a10 = vload(acc, o1); a11 = vload(acc, o1 + 16); a12 = vload(acc, o1 + 32); a13 = vload(acc, o1 + 48)
        o2 = o1 + dp
        a20 = vload(acc, o2); a21 = vload(acc, o2 + 16); a22 = vload(acc, o2 + 32); a23 = vload(acc, o2 + 48)
        o3 = o2 + dp
        a30 = vload(acc, o3); a31 = vload(acc, o3 + 16); a32 = vload(acc, o3 + 32); a33 = vload(acc, o3 + 48)
        for c in range(cu0, cu1):
            o = c * dp + x0
            v0 = vload(vf, o)
            v1 = vload(vf, o + 16)
            v2 = vload(vf, o + 32)
            v3 = vload(vf, o + 48)
            w = vsplat(sc[0, c])
            a00 = vfma(w, v0, a00); a01 = vfma(w, v1, a01); a02 = vfma(w, v2, a02); a03 = vfma(w, v3, a03)
            w = vsplat(sc[1, c])
            a10 = vfma(w, v0, a10); a11 = vfma(w, v1, a11); a12 = vfma(w, v2, a12); a13 = vfma(w, v3, a13)
            w = vsplat(sc[2, c])
            a20 = vfma(w, v0, a20); a21 = vfma(w, v1, a21); a22 = vfma(w, v2, a22); a23 = vfma(w, v3, a23)
            w = vsplat(sc[3, c])
            a30 = vfma(w, v0, a30); a31 = vfma(w, v1, a31); a32 = vfma(w, v2, a32); a33 = vfma(w, v3, a33)
        vstore(acc, o0, a00); vstore(acc, o0 + 16, a01); vstore(acc, o0 + 32, a02); vstore(acc, o0 + 48, a03)
        vstore(acc, o1, a10); vstore(acc, o1 + 16, a11); vstore(acc, o1 + 32, a12); vstore(acc, o1 + 48, a13)
        vstore(acc, o2, a20); vstore(acc, o2 + 16, a21); vstore(acc, o2 + 32, a22); vstore(acc, o2 + 48, a23)
        vstore(acc, o3, a30); vstore(acc, o3 + 16, a31); vstore(acc, o3 + 32, a32); vstore(acc, o3 + 48, a33)


@nb.njit(**_JIT)
def _pv_f16_r(sc, v_pool, voff, acc, r0, cu0, cu1, R):
    """_pv4 for R <= 4 rows (a compile-time literal), reading the V rows straight
    from an f16 pool (row c at v_pool.flat[voff[c]]): no converted V tile to write
    and read back.  Same arithmetic as _pv4 for each row."""
    nb.literally(R)
    dp = acc.shape[1]
    z = vzero()
    for x0 in range(0, dp, 64):
        o0 = r0 * dp + x0
        o1 = o0 + dp
        o2 = o1 + dp
        o3 = o2 + dp
        a00 = vload(acc, o0); a01 = vload(acc, o0 + 16); a02 = vload(acc, o0 + 32); a03 = vload(acc, o0 + 48)
        a10 = z; a11 = z; a12 = z; a13 = z
        a20 = z; a21 = z; a22 = z; a23 = z
        a30 = z; a31 = z; a32 = z; a33 = z
        if R > 1:
            a10 = vload(acc, o1); a11 = vload(acc, o1 + 16); a12 = vload(acc, o1 + 32); a13 = vload(acc, o1 + 48)
        if R > 2:
            a20 = vload(acc, o2); a21 = vload(acc, o2 + 16); a22 = vload(acc, o2 + 32); a23 = vload(acc, o2 + 48)
        if R > 3:
            a30 = vload(acc, o3); a31 = vload(acc, o3 + 16); a32 = vload(acc, o3 + 32); a33 = vload(acc, o3 + 48)
        for c in range(cu0, cu1):
            o = voff[c] + x0
            v0 = vload_f16(v_pool, o)
            v1 = vload_f16(v_pool, o + 16)
            v2 = vload_f16(v_pool, o + 32)
            v3 = vload_f16(v_pool, o + 48)
            w = vsplat(sc[0, c])
            a00 = vfma(w, v0, a00); a01 = vfma(w, v1, a01); a02 = vfma(w, v2, a02); a03 = vfma(w, v3, a03)
            if R > 1:
                w = vsplat(sc[1, c])
                a10 = vfma(w, v0, a10); a11 = vfma(w, v1, a11); a12 = vfma(w, v2, a12); a13 = vfma(w, v3, a13)
            if R > 2:
                w = vsplat(sc[2, c])
                a20 = vfma(w, v0, a20); a21 = vfma(w, v1, a21); a22 = vfma(w, v2, a22); a23 = vfma(w, v3, a23)
            if R > 3:
                w = vsplat(sc[3, c])
                a30 = vfma(w, v0, a30); a31 = vfma(w, v1, a31); a32 = vfma(w, v2, a32); a33 = vfma(w, v3, a33)
        vstore(acc, o0, a00); vstore(acc, o0 + 16, a01); vstore(acc, o0 + 32, a02); vstore(acc, o0 + 48, a03)
        if R > 1:
            vstore(acc, o1, a10); vstore(acc, o1 + 16, a11); vstore(acc, o1 + 32, a12); vstore(acc, o1 + 48, a13)
        if R > 2:
            vstore(acc, o2, a20); vstore(acc, o2 + 16, a21); vstore(acc, o2 + 32, a22); vstore(acc, o2 + 48, a23)
        if R > 3:
            vstore(acc, o3, a30); vstore(acc, o3 + 16, a31); vstore(acc, o3 + 32, a32); vstore(acc, o3 + 48, a33)


@nb.njit(parallel=True, **_JIT)
def paged_attention(q, k_pool, v_pool, k_scale, v_scale, kq, vq, block_size, block_tables,
                    seq_of_token, positions, window, scale, n_splits, tile_t0, tile_n, tile_count,
                    part_m, part_l, part_acc, out, sinks):
    """Causal-tiled attention with an online softmax over a paged KV cache.

    q [N, H, D]; token t of sequence seq_of_token[t] at position positions[t]
    attends to cache positions max(0, pos-window+1)..pos (window 0 = all).

    Tiles: tile_t0 / tile_n [tile_count[0]] from attention_tiles_into (an array, so a
    recorded step's kernel calls stay valid for its next tokens).

    Work items are (query tile, kv head, context split).  An item holds the
    tile's queries of one GQA group as a [tile*G, Dp] matrix (rows padded to a
    multiple of 4, the head dim to a multiple of 64, with zeros) and walks the
    keys ATTN_BK = 64 at a time: each K/V tile is gathered from the cache blocks
    and converted to f32 once per item (K transposed to [Dp, 64], V as [64, Dp]).
    Then, 4 query rows at a time (fewer for the last of a GQA group), `_scores_r` computes the rows' 64 scores in
    register accumulators, each row masks the keys outside its causal window,
    takes the tile max, rescales its running sum / output once if the max grew,
    and exponentiates (vectorized, masked keys exactly 0), and `_pv4` adds
    p @ V into the rows' outputs.  Memory is O(tile*G*Dp + 64*Dp) per item: no
    N x N score matrix.  Decode (tile of one token over a long context) splits
    the context across items, and a second pass merges their partial softmax
    results (flash-decoding); part_m, part_l [N, KVH, n_splits, G] and part_acc
    [N, KVH, n_splits, G, D] hold those partials (unused when n_splits == 1:
    items then write `out` directly).

    A row's arithmetic depends only on its own position and the item's key range
    (the split): scores are per-row FMA chains, masked keys weigh exactly 0 in
    the same fixed-order sums, so a token gives bit-identical output alone or in
    a step of several (speculative verification).

    sinks [H] (gpt-oss; empty: none): a learned logit per query head that joins the
    softmax's denominator and brings no value (_sink_inv), added where a row's sums
    are final: at the item's end (one split) or in the split merge.  Without sinks
    the arithmetic is as it was.
    """
    n, h, d = q.shape
    n_tiles = tile_count[0]
    kvh = k_pool.shape[1]
    g = h // kvh
    per_tile = kvh * n_splits
    dp = (d + 63) // 64 * 64
    fast_k = not kq and d % 16 == 0
    fast_v = not vq and d % 64 == 0      # V read in place, 64 dims per step (else gathered, dequantized)
    has_sink = sinks.shape[0] > 0
    for it in nb.prange(n_tiles * per_tile):
        # zig-zag over tiles so that contiguous chunks of items (one per thread)
        # mix short early tiles with long late ones under causal masking
        k_ = it // per_tile
        ti = k_ // 2 if k_ % 2 == 0 else n_tiles - 1 - k_ // 2
        # kv heads innermost: the threads taking neighbouring items read the
        # neighbouring heads' rows of the same cache slots (one slot holds all
        # kv heads), so each cache line a thread's prefetcher brings is used
        sp = (it // kvh) % n_splits
        kh = it % kvh
        t0 = tile_t0[ti]
        nq = tile_n[ti]
        p0 = positions[t0]
        p_last = p0 + nq - 1
        lo = 0
        if window > 0 and p0 - window + 1 > 0:
            lo = p0 - window + 1
        hi = p_last + 1
        span = hi - lo
        chunk = (span + n_splits - 1) // n_splits
        chunk = (chunk + block_size - 1) // block_size * block_size
        j0 = lo + sp * chunk
        j1 = min(hi, j0 + chunk)
        table = block_tables[seq_of_token[t0]]
        rows = nq * g
        rp = (rows + _RB - 1) // _RB * _RB
        qs = np.zeros((rp, dp), np.float32)
        acc = np.zeros((rp, dp), np.float32)
        m = np.full(rp, _NEG, np.float32)
        l = np.zeros(rp, np.float32)
        # K tile: zeros where the head dim is padded (those rows meet the zero
        # columns of qs and must be finite); otherwise every score from a key
        # column the gather did not write is replaced by the mask before use
        if fast_k and dp == d:
            kt = np.empty((dp, ATTN_BK), np.float32)
        else:
            kt = np.zeros((dp, ATTN_BK), np.float32)
        vf = np.zeros((ATTN_BK if not fast_v else 1, dp), np.float32)   # zeros: unused keys stay finite
        sc = np.empty((_RB, ATTN_BK), np.float32)
        rc0 = np.empty(_RB, np.int64)
        rc1 = np.empty(_RB, np.int64)
        koff = np.empty(ATTN_BK, np.int64)
        for r in range(rows):
            for x in range(d):
                qs[r, x] = q[t0 + r // g, kh * g + r % g, x] * scale
        j = j0
        if not kq:      # (a q8_0 V pool's rows are half as long: its lines get prefetched twice)
            _prefetch_keys(k_pool, v_pool, table, block_size, kvh, kh, d, j0, min(j1, j0 + ATTN_PREFETCH * ATTN_BK))
        while j < j1:
            nk = min(ATTN_BK, j1 - j)
            if not kq:
                pj = j + ATTN_PREFETCH * ATTN_BK
                _prefetch_keys(k_pool, v_pool, table, block_size, kvh, kh, d, pj, min(j1, pj + ATTN_BK))
            c = 0
            while c < nk:           # gather the tile block by block
                pj = j + c
                blk = pj // block_size
                off = pj - blk * block_size
                run = min(nk - c, block_size - off)
                base = table[blk] * block_size + off
                for e in range(run):
                    if fast_k:
                        koff[c + e] = ((base + e) * kvh + kh) * d
                    else:
                        _load_col(k_pool, k_scale, kq, base + e, kh, d, kt, c + e)
                    if not fast_v:
                        _load_row_d(v_pool, v_scale, vq, base + e, kh, d, vf, c + e)
                c += run
            if fast_k:
                # K: 16 keys x 16 dims at a time, converted and transposed in
                # registers (keys past nk repeat the last one: masked anyway)
                for c in range(nk, (nk + 15) // 16 * 16):
                    koff[c] = koff[nk - 1]
                for c16 in range(0, nk, 16):
                    for x0 in range(0, d, 16):
                        kt16_f16(k_pool, koff, c16, x0, kt, x0 * ATTN_BK + c16, ATTN_BK)
            for r0 in range(0, rows, _RB):
                nr = min(_RB, rows - r0)    # no work for padding rows (a GQA group of 3, 6, 7)
                # each row's keys inside its causal window: c in [c0, c1)
                cu0 = ATTN_BK
                cu1 = 0
                for i in range(_RB):
                    r = r0 + i
                    c0 = 0
                    c1 = 0
                    if r < rows:
                        pos = p0 + r // g
                        c1 = min(nk, pos - j + 1)
                        if window > 0:
                            c0 = max(0, pos - window + 1 - j)
                    if c1 < c0:
                        c1 = c0
                    rc0[i] = c0
                    rc1[i] = c1
                    if c1 > c0:
                        cu0 = min(cu0, c0)
                        cu1 = max(cu1, c1)
                if cu1 <= cu0:
                    continue
                if nr == 4:
                    _scores_r(qs, r0, kt, sc, 4)
                elif nr == 3:
                    _scores_r(qs, r0, kt, sc, 3)
                elif nr == 2:
                    _scores_r(qs, r0, kt, sc, 2)
                else:
                    _scores_r(qs, r0, kt, sc, 1)
                for i in range(_RB):
                    r = r0 + i
                    c0 = rc0[i]
                    c1 = rc1[i]
                    o = i * ATTN_BK
                    if c1 <= c0:
                        for c in range(ATTN_BK):
                            sc[i, c] = 0.0
                        continue
                    for c in range(c0):
                        sc[i, c] = _NEG
                    for c in range(c1, ATTN_BK):
                        sc[i, c] = _NEG
                    s0 = vload(sc, o)
                    s1 = vload(sc, o + 16)
                    s2 = vload(sc, o + 32)
                    s3 = vload(sc, o + 48)
                    mb = hmax(vmax(vmax(s0, s1), vmax(s2, s3)))
                    if mb > m[r]:
                        corr = _exp_le0(m[r] - mb)
                        m[r] = mb
                        l[r] *= corr
                        for x in range(dp):
                            acc[r, x] *= corr
                    mv = vsplat(-m[r])
                    e0 = vexp_le0(vadd(s0, mv))
                    e1 = vexp_le0(vadd(s1, mv))
                    e2 = vexp_le0(vadd(s2, mv))
                    e3 = vexp_le0(vadd(s3, mv))
                    vstore(sc, o, e0)
                    vstore(sc, o + 16, e1)
                    vstore(sc, o + 32, e2)
                    vstore(sc, o + 48, e3)
                    for c in range(c0):
                        sc[i, c] = 0.0
                    for c in range(c1, ATTN_BK):
                        sc[i, c] = 0.0
                    l[r] += hsum(vadd(vadd(vload(sc, o), vload(sc, o + 16)),
                                      vadd(vload(sc, o + 32), vload(sc, o + 48))))
                if fast_v:
                    if nr == 4:
                        _pv_f16_r(sc, v_pool, koff, acc, r0, cu0, cu1, 4)
                    elif nr == 3:
                        _pv_f16_r(sc, v_pool, koff, acc, r0, cu0, cu1, 3)
                    elif nr == 2:
                        _pv_f16_r(sc, v_pool, koff, acc, r0, cu0, cu1, 2)
                    else:
                        _pv_f16_r(sc, v_pool, koff, acc, r0, cu0, cu1, 1)
                else:
                    _pv4(sc, vf, acc, r0, cu0, cu1)
            j += nk
        for r in range(rows):
            t = t0 + r // g
            gi = r % g
            if n_splits == 1:
                if has_sink:
                    inv = _sink_inv(l[r], m[r], sinks[kh * g + gi])
                else:
                    inv = np.float32(1.0) / l[r] if l[r] > 0 else np.float32(0.0)
                for x in range(d):
                    out[t, kh * g + gi, x] = acc[r, x] * inv
            else:
                part_m[t, kh, sp, gi] = m[r]
                part_l[t, kh, sp, gi] = l[r]
                for x in range(d):
                    part_acc[t, kh, sp, gi, x] = acc[r, x]
    if n_splits == 1:
        return
    # merge the context splits of each (token, query head); a decode step's
    # merge is a few thousand flops, less than waking the pool again
    if n <= 16:
        for it in range(n * kvh):
            _merge_splits(it, kvh, g, d, n_splits, part_m, part_l, part_acc, out, sinks)
    else:
        for it in nb.prange(n * kvh):
            _merge_splits(it, kvh, g, d, n_splits, part_m, part_l, part_acc, out, sinks)


@nb.njit(inline="always")
def _sink_inv(l, m, sink):
    """What a row's output sums (weighted by exp(score - m), their total l) are
    multiplied by when a sink logit joins the softmax: exp(m - M) / (l exp(m - M) +
    exp(sink - M)), M = max(m, sink) (no overflow whichever is larger)."""
    mm = max(m, sink)
    c = np.float32(math.exp(m - mm))
    return c / (l * c + np.float32(math.exp(sink - mm)))


@nb.njit(inline="always")
def _merge_splits(it, kvh, g, d, n_splits, part_m, part_l, part_acc, out, sinks):
    t = it // kvh
    kh = it % kvh
    for gi in range(g):
        mx = _NEG
        for sp in range(n_splits):
            if part_l[t, kh, sp, gi] > 0.0 and part_m[t, kh, sp, gi] > mx:
                mx = part_m[t, kh, sp, gi]
        tot = np.float32(0.0)
        o = out[t, kh * g + gi]
        for x in range(d):
            o[x] = 0.0
        for sp in range(n_splits):
            if part_l[t, kh, sp, gi] == 0.0:
                continue
            w = np.exp(part_m[t, kh, sp, gi] - mx)
            tot += part_l[t, kh, sp, gi] * w
            for x in range(d):
                o[x] += part_acc[t, kh, sp, gi, x] * w
        if sinks.shape[0] > 0:
            inv = _sink_inv(tot, mx, sinks[kh * g + gi])
        else:
            inv = np.float32(1.0) / tot
        for x in range(d):
            o[x] *= inv


@nb.njit(**_JIT)
def kv_shift(k_pool, v_pool, k_scale, v_scale, kq, vq, src, dst, delta, inv_freq, neox, pos_scale):
    """Move cached K/V from slots src to slots dst (context shift) and re-rotate the
    keys by `delta` positions: RoPE rotations compose, so R(p + delta) = R(delta) R(p).
    A q8_0 K is dequantized, rotated and quantized again; V (not rotated) moves as
    stored, bit for bit.  All sources are read before any destination is written, so
    src and dst may overlap."""
    n = src.shape[0]
    kvh = k_pool.shape[1]
    d = k_pool.shape[2]
    kt = np.empty((n, kvh, d), np.float32)
    vt = np.empty((n, kvh, d), v_pool.dtype)
    vs = np.empty((n,) + v_scale.shape[1:], v_scale.dtype)
    for t in range(n):
        for hh in range(kvh):
            _load_row(k_pool, k_scale, kq, src[t], hh, kt[t], hh)
            for j in range(d):
                vt[t, hh, j] = v_pool[src[t], hh, j]
            if vq:
                for b in range(vs.shape[2]):
                    vs[t, hh, b] = v_scale[src[t], hh, b]
    half = inv_freq.shape[0]
    ang0 = np.float64(delta) / pos_scale
    for i in range(half):
        ang = ang0 * inv_freq[i]
        c = np.float32(math.cos(ang))
        s = np.float32(math.sin(ang))
        for t in range(n):
            for hh in range(kvh):
                _rotate(kt, t, hh, i, half, c, s, neox)
    for t in range(n):
        s = dst[t]
        for hh in range(kvh):
            if kq:
                _q8_store(kt[t, hh], k_pool, k_scale, s, hh)
            else:
                for j in range(d):
                    k_pool[s, hh, j] = f32_to_f16(kt[t, hh, j])
            for j in range(d):
                v_pool[s, hh, j] = vt[t, hh, j]
            if vq:
                for b in range(vs.shape[2]):
                    v_scale[s, hh, b] = vs[t, hh, b]
