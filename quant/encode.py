"""float32 -> GGML block encoders, bit-compatible with llama.cpp's reference
quantizers (quantize_row_q8_0_ref, quantize_row_q4_0_ref, quantize_row_q5_0_ref,
quantize_row_q4_K_ref / quantize_row_q5_K_ref with make_qkx2_quants, quantize_row_q6_K_ref with
make_qx_quants, quantize_row_mxfp4_ref), so files written with them load in llama.cpp and
match what its own converter would write.

Bit-compatibility rests on doing the same float32 operations in the same
order, without fast-math (no reassociation, no FMA contraction):
* every literal is a float32, because in Numba float32 op float64 -> float64;
* `nearest_int` is ggml's magic-number rounding (round half to even),
  `roundf` rounds half away from zero, `(int8_t)` casts truncate;
* f32 -> f16 is round-to-nearest-even (LLVM fptrunc), like GGML_FP32_TO_FP16.
Rows are independent, so the kernels run in parallel over rows.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .dequant import _KV_MXFP4, _h, e8m0_half, scale_min_k4, scale_q3_k
from .half import f32_to_f16
from .types import QK, QK_K, GGMLType, row_nbytes, type_name

F32 = np.float32
_MAGIC = F32(12582912.0)   # 1.5 * 2**23: adding it rounds a float32 to an integer, ties to even


@njit(inline="always")
def _nearest_int(v):
    return np.int32(F32(v + _MAGIC) - _MAGIC)


@njit(inline="always")
def _roundf(v):
    # half away from zero; float64 holds |v| + 0.5 exactly for any float32 v
    a = math.floor(abs(np.float64(v)) + 0.5)
    return -a if v < 0 else a


@njit(inline="always")
def _put_f16(dst, o, v):
    h = f32_to_f16(F32(v))
    dst[o] = np.uint8(h & np.uint16(0xFF))
    dst[o + 1] = np.uint8(h >> np.uint16(8))


@njit(parallel=True, cache=True, nogil=True)
def encode_q8_0(x, out):
    M, K = x.shape
    for r in prange(M):
        src = x[r]
        dst = out[r]
        for b in range(K // QK):
            amax = F32(0.0)
            for j in range(QK):
                amax = max(amax, abs(src[b * QK + j]))
            d = amax / F32(127.0)
            idv = F32(1.0) / d if d != F32(0.0) else F32(0.0)
            o = b * 34
            _put_f16(dst, o, d)
            for j in range(QK):
                dst[o + 2 + j] = np.uint8(np.int64(_roundf(src[b * QK + j] * idv)) & 0xFF)


@njit(inline="always")
def _signed_absmax(src, o, n=QK):
    """The value of largest magnitude in src[o:o+n], sign kept (the first one on
    ties), as ggml's quantize_row_q4_0 / q5_0 and make_qx_quants / make_q3_quants take it."""
    amax = F32(0.0)
    vmax = F32(0.0)
    for j in range(n):
        v = src[o + j]
        if amax < abs(v):
            amax = abs(v)
            vmax = v
    return vmax


@njit(inline="always")
def _block_scale(src, xo, dst, o, qmin):
    """Q4_0 / Q5_0's block head: d = (signed absmax) / qmin (-8 or -16) stored as f16 at
    dst[o]; returns 1 / d (0 where d is 0)."""
    d = _signed_absmax(src, xo) / qmin
    _put_f16(dst, o, d)
    return F32(1.0) / d if d != F32(0.0) else F32(0.0)


@njit(parallel=True, cache=True, nogil=True)
def encode_q4_0(x, out):
    M, K = x.shape
    for r in prange(M):
        src = x[r]
        dst = out[r]
        for b in range(K // QK):
            o = b * 18
            idv = _block_scale(src, b * QK, dst, o, F32(-8.0))
            for j in range(16):
                x0 = src[b * QK + j] * idv
                x1 = src[b * QK + 16 + j] * idv
                q0 = min(15, np.int32(F32(x0 + F32(8.5))))   # (int8_t) cast truncates
                q1 = min(15, np.int32(F32(x1 + F32(8.5))))
                dst[o + 2 + j] = np.uint8(q0 | (q1 << 4))


@njit(cache=True, nogil=True)
def _make_qkx2_quants(x, xo, weights, L, lo, Laux, nmax, rmin, nstep):
    """make_qkx2_quants(32, nmax, x+xo, weights, L+lo, &min, Laux, rmin, 0.1, nstep, false)
    (Q4_K: 15, -1, 20; Q5_K: 31, -0.5, 15).  Returns (scale, the_min)."""
    n = 32
    rdelta = F32(0.1)
    vmin = x[xo]
    vmax = x[xo]
    sum_w = weights[0]
    sum_x = sum_w * x[xo]
    for i in range(1, n):
        v = x[xo + i]
        if v < vmin:
            vmin = v
        if v > vmax:
            vmax = v
        w = weights[i]
        sum_w += w
        sum_x += w * v
    if vmin > F32(0.0):
        vmin = F32(0.0)
    if vmax == vmin:
        for i in range(n):
            L[lo + i] = 0
        return F32(0.0), -vmin
    iscale = F32(nmax) / (vmax - vmin)
    scale = F32(1.0) / iscale
    best_error = F32(0.0)
    for i in range(n):
        l = _nearest_int(iscale * (x[xo + i] - vmin))
        l = max(0, min(nmax, l))
        L[lo + i] = l
        diff = scale * F32(l) + vmin - x[xo + i]
        diff = diff * diff
        best_error += weights[i] * diff
    for s in range(nstep + 1):
        iscale = (rmin + rdelta * F32(s) + F32(nmax)) / (vmax - vmin)
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            l = _nearest_int(iscale * (x[xo + i] - vmin))
            l = max(0, min(nmax, l))
            Laux[i] = l
            w = weights[i]
            fl = F32(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[xo + i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > F32(0.0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > F32(0.0):
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = F32(0.0)
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[xo + i]
                diff = diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[lo + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                vmin = this_min
    return scale, -vmin


@njit(cache=True, nogil=True)
def _qk_k_row(src, dst, nmax, rmin, nstep, bsize):
    """One row of Q4_K (nmax 15) or Q5_K (nmax 31): same sub-block fit and
    6-bit scale packing; Q5_K also keeps each code's 5th bit in 32 bytes of qh."""
    qs = 16 if nmax == 15 else 48
    # per-row temporaries (an encoder, not a hot loop)
    L = np.empty(QK_K, np.int32)
    Laux = np.empty(32, np.int32)
    weights = np.empty(32, np.float32)
    scales = np.empty(8, np.float32)
    mins = np.empty(8, np.float32)
    for b in range(src.shape[0] // QK_K):
        xo = b * QK_K
        o = b * bsize
        max_scale = F32(0.0)
        max_min = F32(0.0)
        for j in range(8):
            sum_x2 = F32(0.0)
            for l in range(32):
                v = src[xo + 32 * j + l]
                sum_x2 += v * v
            av_x = F32(math.sqrt(sum_x2 / F32(32.0)))
            for l in range(32):
                weights[l] = av_x + abs(src[xo + 32 * j + l])
            sc, mn = _make_qkx2_quants(src, xo + 32 * j, weights, L, 32 * j, Laux, nmax, rmin, nstep)
            scales[j] = sc
            mins[j] = mn
            if sc > max_scale:
                max_scale = sc
            if mn > max_min:
                max_min = mn
        inv_scale = F32(63.0) / max_scale if max_scale > F32(0.0) else F32(0.0)
        inv_min = F32(63.0) / max_min if max_min > F32(0.0) else F32(0.0)
        for j in range(8):
            ls = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)   # uint8_t then MIN
            lm = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
            if j < 4:
                dst[o + 4 + j] = ls
                dst[o + 4 + j + 4] = lm
            else:
                dst[o + 4 + j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
                dst[o + 4 + j - 4] |= (ls >> 4) << 6
                dst[o + 4 + j] |= (lm >> 4) << 6
        _put_f16(dst, o, max_scale / F32(63.0))
        _put_f16(dst, o + 2, max_min / F32(63.0))
        dd = _h(dst, o)
        dmin = _h(dst, o + 2)
        for j in range(8):
            sc, m = scale_min_k4(j, dst, o + 4)
            d = dd * F32(sc)
            if d == F32(0.0):
                continue   # keeps make_qkx2_quants' L, as the reference does
            dm = dmin * F32(m)
            for ii in range(32):
                l = _nearest_int((src[xo + 32 * j + ii] + dm) / d)
                L[32 * j + ii] = max(0, min(nmax, l))
        for g in range(4):
            for l in range(32):
                l1 = L[64 * g + l]
                l2 = L[64 * g + l + 32]
                if nmax == 31:
                    hb = 0
                    if l1 > 15:
                        l1 -= 16
                        hb |= 1
                    if l2 > 15:
                        l2 -= 16
                        hb |= 2
                    if g == 0:
                        dst[o + 16 + l] = 0
                    dst[o + 16 + l] |= hb << (2 * g)
                dst[o + qs + 32 * g + l] = np.uint8(l1 | (l2 << 4))


@njit(parallel=True, cache=True, nogil=True)
def encode_q4_k(x, out):
    for r in prange(x.shape[0]):
        _qk_k_row(x[r], out[r], 15, F32(-1.0), 20, 144)


@njit(parallel=True, cache=True, nogil=True)
def encode_q5_k(x, out):
    for r in prange(x.shape[0]):
        _qk_k_row(x[r], out[r], 31, F32(-0.5), 15, 176)


@njit(parallel=True, cache=True, nogil=True)
def encode_q5_0(x, out):
    M, K = x.shape
    for r in prange(M):
        src = x[r]
        dst = out[r]
        for b in range(K // QK):
            o = b * 22
            idv = _block_scale(src, b * QK, dst, o, F32(-16.0))
            qh = np.uint32(0)
            for j in range(16):
                x0 = src[b * QK + j] * idv
                x1 = src[b * QK + 16 + j] * idv
                q0 = min(31, np.int32(F32(x0 + F32(16.5))))   # (int8_t) cast truncates
                q1 = min(31, np.int32(F32(x1 + F32(16.5))))
                dst[o + 6 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
                qh |= np.uint32((q0 >> 4) & 1) << np.uint32(j)
                qh |= np.uint32((q1 >> 4) & 1) << np.uint32(j + 16)
            for k in range(4):   # little-endian u32
                dst[o + 2 + k] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))


_GROUP_MAX_EPS = F32(1e-15)


@njit(inline="always")
def _qx_sums(x, xo, n, nmax, iscale, L, lo, lofs, store):
    """One candidate grid of make_qx_quants / make_q3_quants (weights x^2): codes
    l = clamp(nearest(iscale * x), -nmax, nmax - 1), stored as l + lofs in L[lo:lo+n]
    where store; returns (sum w x l, sum w l^2) in the reference's order."""
    sumlx = F32(0.0)
    suml2 = F32(0.0)
    for i in range(n):
        v = x[xo + i]
        l = _nearest_int(iscale * v)
        l = max(-nmax, min(nmax - 1, l))
        if store:
            L[lo + i] = l + lofs
        w = v * v
        sumlx += w * v * F32(l)
        suml2 += w * F32(l) * F32(l)
    return sumlx, suml2


@njit(cache=True, nogil=True)
def _make_qx_quants_16_32(x, xo, L, lo):
    """make_qx_quants(16, 32, x+xo, L+lo, rmse_type=1, qw=NULL): weights x^2,
    scale searched over 19 candidate grids.  L holds l + 32 in [0, 63]."""
    n = 16
    nmax = 32
    vmax = _signed_absmax(x, xo, n)
    if abs(vmax) < _GROUP_MAX_EPS:
        for i in range(n):
            L[lo + i] = 0
        return F32(0.0)
    iscale = F32(-nmax) / vmax
    sumlx, suml2 = _qx_sums(x, xo, n, nmax, iscale, L, lo, nmax, True)
    scale = sumlx / suml2 if suml2 != F32(0.0) else F32(0.0)
    best = scale * sumlx
    for s in range(-9, 10):
        if s == 0:
            continue
        iscale = -(F32(nmax) + F32(0.1) * F32(s)) / vmax
        sumlx, suml2 = _qx_sums(x, xo, n, nmax, iscale, L, lo, nmax, False)
        if suml2 > F32(0.0) and sumlx * sumlx > best * suml2:
            for i in range(n):
                l = _nearest_int(iscale * x[xo + i])
                L[lo + i] = nmax + max(-nmax, min(nmax - 1, l))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(parallel=True, cache=True, nogil=True)
def encode_q6_k(x, out):
    M, K = x.shape
    nb = K // QK_K
    for r in prange(M):
        L = np.empty(QK_K, np.int32)
        scales = np.empty(16, np.float32)
        src = x[r]
        dst = out[r]
        for b in range(nb):
            xo = b * QK_K
            o = b * 210
            max_scale = F32(0.0)
            max_abs_scale = F32(0.0)
            for ib in range(16):
                sc = _make_qx_quants_16_32(src, xo + 16 * ib, L, 16 * ib)
                scales[ib] = sc
                if abs(sc) > max_abs_scale:
                    max_abs_scale = abs(sc)
                    max_scale = sc
            if max_abs_scale < _GROUP_MAX_EPS:
                for k in range(210):
                    dst[o + k] = 0
                continue
            iscale = F32(-128.0) / max_scale
            _put_f16(dst, o + 208, F32(1.0) / iscale)
            dd = _h(dst, o + 208)
            for ib in range(16):
                q = min(127, _nearest_int(iscale * scales[ib]))
                dst[o + 192 + ib] = np.uint8(q & 0xFF)   # int8_t
                d = dd * F32(q if q < 128 else q - 256)
                if d == F32(0.0):
                    continue   # keeps make_qx_quants' L, as the reference does
                for ii in range(16):
                    l = _nearest_int(src[xo + 16 * ib + ii] / d)
                    L[16 * ib + ii] = max(-32, min(31, l)) + 32
            for h in range(2):
                j = 128 * h
                for l in range(32):
                    q1 = L[j + l] & 0xF
                    q2 = L[j + l + 32] & 0xF
                    q3 = L[j + l + 64] & 0xF
                    q4 = L[j + l + 96] & 0xF
                    dst[o + 64 * h + l] = np.uint8(q1 | (q3 << 4))
                    dst[o + 64 * h + l + 32] = np.uint8(q2 | (q4 << 4))
                    dst[o + 128 + 32 * h + l] = np.uint8((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2)
                                                         | ((L[j + l + 64] >> 4) << 4)
                                                         | ((L[j + l + 96] >> 4) << 6))


@njit(cache=True, nogil=True)
def _make_q3_quants_16(x, xo, L, lo):
    """make_q3_quants(16, 4, x+xo, L+lo, do_rmse=true): weights x^2, codes moved one
    at a time while the weighted fit improves (5 passes at most).  L holds l + 4."""
    n = 16
    nmax = 4
    vmax = _signed_absmax(x, xo, n)
    if abs(vmax) < _GROUP_MAX_EPS:
        for i in range(n):
            L[lo + i] = 0
        return F32(0.0)
    iscale = F32(-nmax) / vmax
    sumlx, suml2 = _qx_sums(x, xo, n, nmax, iscale, L, lo, 0, True)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            v = x[xo + i]
            w = v * v
            fl = F32(L[lo + i])
            slx = sumlx - w * v * fl
            if slx > F32(0.0):
                sl2 = suml2 - w * fl * fl
                new_l = max(-nmax, min(nmax - 1, _nearest_int(v * sl2 / slx)))
                if new_l != L[lo + i]:
                    slx += w * v * F32(new_l)
                    sl2 += w * F32(new_l) * F32(new_l)
                    if sl2 > F32(0.0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[lo + i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[lo + i] += nmax
    return sumlx / suml2 if suml2 > F32(0.0) else F32(0.0)


@njit(parallel=True, cache=True, nogil=True)
def encode_q3_k(x, out):
    """quantize_row_q3_K_ref: 16 sub-blocks of 16, codes -4..3 (low 2 bits in qs, the
    third in hmask), scales to 6 bits against the super-block's largest."""
    M, K = x.shape
    nb = K // QK_K
    for r in prange(M):
        L = np.empty(QK_K, np.int32)
        scales = np.empty(16, np.float32)
        src = x[r]
        dst = out[r]
        for b in range(nb):
            xo = b * QK_K
            o = b * 110
            for k in range(110):
                dst[o + k] = 0
            max_scale = F32(0.0)
            amax = F32(0.0)
            for j in range(16):
                sc = _make_q3_quants_16(src, xo + 16 * j, L, 16 * j)
                scales[j] = sc
                if abs(sc) > amax:
                    amax = abs(sc)
                    max_scale = sc
            if max_scale != F32(0.0):
                iscale = F32(-32.0) / max_scale
                for j in range(16):
                    l = np.int32(np.int8(_nearest_int(iscale * scales[j])))   # (int8_t)
                    l = max(-32, min(31, l)) + 32
                    if j < 8:
                        dst[o + 96 + j] = np.uint8(l & 0xF)
                    else:
                        dst[o + 96 + j - 8] |= np.uint8((l & 0xF) << 4)
                    dst[o + 96 + 8 + j % 4] |= np.uint8((l >> 4) << (2 * (j // 4)))
                _put_f16(dst, o + 108, F32(1.0) / iscale)
            else:
                _put_f16(dst, o + 108, F32(0.0))
            dd = _h(dst, o + 108)
            for j in range(16):
                d = dd * F32(scale_q3_k(j, dst, o + 96))
                if d == F32(0.0):
                    continue
                for ii in range(16):
                    l = _nearest_int(src[xo + 16 * j + ii] / d)
                    L[16 * j + ii] = max(-4, min(3, l)) + 4
            for j in range(QK_K):     # the third bit of element j: bit j // 32 of hmask[j % 32]
                if L[j] > 3:
                    dst[o + (j % 32)] |= np.uint8(1 << (j // 32))
                    L[j] -= 4
            for h in range(2):
                for l in range(32):
                    j = 128 * h + l
                    dst[o + 32 + 32 * h + l] = np.uint8(L[j] | (L[j + 32] << 2) | (L[j + 64] << 4) | (L[j + 96] << 6))


@njit(inline="always")
def _best_mxfp4(v, d):
    """ggml's best_index_mxfp4: the first code whose value (kvalue * d) is nearest v."""
    best = 0
    err = abs(F32(_KV_MXFP4[0]) * d - v)
    for i in range(1, 16):
        e = abs(F32(_KV_MXFP4[i]) * d - v)
        if e < err:
            best = i
            err = e
    return best


@njit(parallel=True, cache=True, nogil=True)
def encode_mxfp4(x, out):
    """quantize_row_mxfp4_ref: the block's exponent floor(log2f(amax)) - 2 + 127 (so its
    largest value lands on the codes 4..6 x 2^e of the top), each value the nearest code.
    (A block under 2^-125, where ggml's uint8 cast of a negative number is undefined,
    gets exponent 0.)"""
    M, K = x.shape
    for r in prange(M):
        src = x[r]
        dst = out[r]
        for b in range(K // QK):
            amax = F32(0.0)
            for j in range(QK):
                amax = max(amax, abs(src[b * QK + j]))
            e = 0
            if amax > F32(0.0):
                e = max(0, np.int32(math.floor(math.log2(amax))) - 2 + 127)
            d = e8m0_half(np.uint8(e))
            o = b * 17
            dst[o] = np.uint8(e)
            for j in range(QK // 2):
                dst[o + 1 + j] = np.uint8(_best_mxfp4(src[b * QK + j], d) | (_best_mxfp4(src[b * QK + 16 + j], d) << 4))


def mxfp4_from_packed(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 weights stored the OCP / Hugging Face way (gpt-oss's `*_blocks` and `*_scales`,
    compressed-tensors' mxfp4-pack-quantized) as GGML blocks, moving bits only (llama.cpp's
    repack_mxfp4_blocks): packed uint8 [rows, cols / 2] (or [rows, cols / 32, 16]) with
    element 2i in the low nibble of byte i and 2i+1 in the high one; scales uint8
    [rows, cols / 32], E8M0 exponents.  Returns uint8 [rows, cols / 32 * 17]: per 32
    values the scale byte, then 16 bytes holding element j (low nibble) and j + 16 (high).
    The codes and the byte need no change: E2M1 x 2^(e-127) is ggml's doubled value x
    2^(e-128)."""
    p = np.ascontiguousarray(packed, np.uint8)
    sc = np.ascontiguousarray(scales, np.uint8)
    rows = sc.shape[0]
    nb = sc.reshape(rows, -1).shape[1]
    p = p.reshape(rows, -1)
    if p.shape[1] != nb * 16:
        raise ValueError(f"MXFP4: {p.shape[1]} packed bytes a row do not match {nb} scales (16 bytes each)")
    p = p.reshape(rows, nb, 16)
    vals = np.stack((p & 15, p >> 4), axis=-1).reshape(rows, nb, 32)      # elements in order
    out = np.empty((rows, nb, 17), np.uint8)
    out[:, :, 0] = sc.reshape(rows, nb)
    out[:, :, 1:] = vals[:, :, :16] | (vals[:, :, 16:] << 4)
    return out.reshape(rows, nb * 17)


def _bf16_bytes(x):
    # ggml_compute_fp32_to_bf16: quiet NaNs, otherwise round to nearest even
    u = x.view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    r = np.where(nan, (u >> 16) | 64, r)
    return r.astype(np.uint16).view(np.uint8)


ENCODERS = {GGMLType.Q8_0: encode_q8_0, GGMLType.Q4_0: encode_q4_0, GGMLType.Q5_0: encode_q5_0,
            GGMLType.Q3_K: encode_q3_k, GGMLType.Q4_K: encode_q4_k, GGMLType.Q5_K: encode_q5_k,
            GGMLType.Q6_K: encode_q6_k, GGMLType.MXFP4: encode_mxfp4}


def quantize(x: np.ndarray, qtype) -> np.ndarray:
    """float32 [M, K] (or [K]) -> uint8 [M, row_nbytes] in GGML layout of qtype.

    Encoders exist for Q8_0, Q4_0, Q5_0, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4 (llama.cpp-reference-exact) and the
    float types F32, F16, BF16."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2:
        raise ValueError(f"quantize: x must be 1-D or 2-D, got shape {x.shape}")
    x = np.ascontiguousarray(x)
    try:
        t = GGMLType(int(qtype))
    except ValueError:
        t = None
    M, K = x.shape
    if t == GGMLType.F32:
        return x.view(np.uint8).reshape(M, K * 4).copy()
    if t == GGMLType.F16:
        return x.astype(np.float16).view(np.uint8).reshape(M, K * 2)
    if t == GGMLType.BF16:
        return _bf16_bytes(x).reshape(M, K * 2)
    enc = ENCODERS.get(t)
    if enc is None:
        raise ValueError(f"quantize: no encoder for GGML type {type_name(qtype)} "
                         f"(have F32, F16, BF16, {', '.join(e.name for e in ENCODERS)})")
    out = np.zeros((M, row_nbytes(t, K, "quantize input")), np.uint8)
    if M:
        enc(x, out)
    return out
