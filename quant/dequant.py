"""Block-by-block dequantization of GGML rows to float32.

The per-type row decoders follow the arithmetic order of gguf-py's
`gguf.quants.dequantize` (and of ggml's dequantize_row_*), operation for
operation and without fast-math, so the results are bit-identical to it.  The
matmul kernels use their own fused decoding; these are for dequantize(),
embedding lookups (dequantize_rows) and the large-batch matmul path.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .half import bits_to_f32, f16_to_f32
from .tensor import QTensor
from .types import KVALUES_MXFP4, GGMLType, QK, QK_K

F32 = np.float32
_KV_MXFP4 = np.array(KVALUES_MXFP4, np.int8)


@njit(inline="always")
def _h(src, o):
    """f16 at byte offset o, as float32."""
    return f16_to_f32(np.uint16(np.uint16(src[o]) | (np.uint16(src[o + 1]) << np.uint16(8))))


@njit(inline="always")
def _u32(src, o):
    return (np.uint32(src[o]) | (np.uint32(src[o + 1]) << np.uint32(8))
            | (np.uint32(src[o + 2]) << np.uint32(16)) | (np.uint32(src[o + 3]) << np.uint32(24)))


@njit(inline="always")
def scale_min_k4(j, src, o):
    """6-bit (scale, min) of sub-block j from the 12 packed bytes at src[o:o+12]."""
    if j < 4:
        return src[o + j] & 63, src[o + j + 4] & 63
    sc = (src[o + j + 4] & 0xF) | ((src[o + j - 4] >> 6) << 4)
    mn = (src[o + j + 4] >> 4) | ((src[o + j] >> 6) << 4)
    return sc, mn


@njit(inline="always")
def e8m0_half(e):
    """MXFP4's block scale byte as ggml's ggml_e8m0_to_fp32_half: 2^(e-128) as float32
    (its bits built directly: subnormal for e < 2, 2^127 for e = 255)."""
    e = np.uint32(e)
    if e < np.uint32(2):
        return bits_to_f32(np.uint32(0x00200000) << e)
    return bits_to_f32((e - np.uint32(1)) << np.uint32(23))


@njit(inline="always")
def _bit5(qh, j):
    """Bit j of Q5_0 / Q5_1's 32-bit qh, as the code's fifth bit (0 or 16)."""
    return np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4


@njit(inline="always")
def _k4_scales(g, src, o, d, dmin):
    """Q4_K / Q5_K: the float scale and min of sub-blocks 2g and 2g+1 of the super-block
    at src[o] (d, dmin: its f16 header): (d0, dm0, d1, dm1)."""
    sc0, m0 = scale_min_k4(2 * g, src, o + 4)
    sc1, m1 = scale_min_k4(2 * g + 1, src, o + 4)
    return d * F32(sc0), dmin * F32(m0), d * F32(sc1), dmin * F32(m1)


# One row decoder a type: the per-element arithmetic differs (Q4_0 subtracts 8 from the
# code, Q4_1 adds a float min, ...) and must stay gguf-py's to the bit, and each short loop
# is vectorized on its own (deq_row's note on trip counts); they share the helpers above.
@njit(cache=True, nogil=True)
def deq_row_q4_0(src, dst, L):
    for b in range(dst.size // QK):
        o = b * 18
        d = _h(src, o)
        for j in range(L // 2):
            q = src[o + 2 + j]
            dst[b * QK + j] = d * F32(np.int32(q & 15) - 8)
            dst[b * QK + j + 16] = d * F32(np.int32(q >> 4) - 8)


@njit(cache=True, nogil=True)
def deq_row_q4_1(src, dst, L):
    for b in range(dst.size // QK):
        o = b * 20
        d = _h(src, o)
        m = _h(src, o + 2)
        for j in range(L // 2):
            q = src[o + 4 + j]
            dst[b * QK + j] = d * F32(q & 15) + m
            dst[b * QK + j + 16] = d * F32(q >> 4) + m


@njit(cache=True, nogil=True)
def deq_row_q5_0(src, dst, L):
    for b in range(dst.size // QK):
        o = b * 22
        d = _h(src, o)
        qh = _u32(src, o + 2)
        for j in range(L // 2):
            q = src[o + 6 + j]
            h0 = _bit5(qh, j)
            h1 = _bit5(qh, j + 16)
            dst[b * QK + j] = d * F32((np.int32(q & 15) | h0) - 16)
            dst[b * QK + j + 16] = d * F32((np.int32(q >> 4) | h1) - 16)


@njit(cache=True, nogil=True)
def deq_row_q5_1(src, dst, L):
    for b in range(dst.size // QK):
        o = b * 24
        d = _h(src, o)
        m = _h(src, o + 2)
        qh = _u32(src, o + 4)
        for j in range(L // 2):
            q = src[o + 8 + j]
            h0 = _bit5(qh, j)
            h1 = _bit5(qh, j + 16)
            dst[b * QK + j] = d * F32(np.int32(q & 15) | h0) + m
            dst[b * QK + j + 16] = d * F32(np.int32(q >> 4) | h1) + m


@njit(cache=True, nogil=True)
def deq_row_q8_0(src, dst, L):
    for b in range(dst.size // QK):
        o = b * 34
        d = _h(src, o)
        for j in range(L):
            dst[b * QK + j] = F32(np.int8(src[o + 2 + j])) * d


@njit(cache=True, nogil=True)
def deq_row_mxfp4(src, dst, L):
    for b in range(dst.size // QK):
        o = b * 17
        d = e8m0_half(src[o])
        for j in range(L // 2):
            q = src[o + 1 + j]
            dst[b * QK + j] = d * F32(_KV_MXFP4[q & 15])
            dst[b * QK + j + 16] = d * F32(_KV_MXFP4[q >> 4])


@njit(cache=True, nogil=True)
def deq_row_q4_k(src, dst, L):
    for b in range(dst.size // QK_K):
        o = b * 144
        d = _h(src, o)
        dmin = _h(src, o + 2)
        for g in range(4):
            d0, dm0, d1, dm1 = _k4_scales(g, src, o, d, dmin)
            base = b * QK_K + g * 64
            for l in range(L):
                q = src[o + 16 + g * 32 + l]
                dst[base + l] = d0 * F32(q & 15) - dm0
                dst[base + 32 + l] = d1 * F32(q >> 4) - dm1


@njit(cache=True, nogil=True)
def deq_row_q5_k(src, dst, L):
    for b in range(dst.size // QK_K):
        o = b * 176
        d = _h(src, o)
        dmin = _h(src, o + 2)
        for g in range(4):
            d0, dm0, d1, dm1 = _k4_scales(g, src, o, d, dmin)
            base = b * QK_K + g * 64
            for l in range(L):
                q = src[o + 48 + g * 32 + l]
                h = src[o + 16 + l]
                q0 = np.int32(q & 15) | (np.int32((h >> (2 * g)) & 1) << 4)
                q1 = np.int32(q >> 4) | (np.int32((h >> (2 * g + 1)) & 1) << 4)
                dst[base + l] = d0 * F32(q0) - dm0
                dst[base + 32 + l] = d1 * F32(q1) - dm1


@njit(cache=True, nogil=True)
def deq_row_q6_k(src, dst, L):
    for b in range(dst.size // QK_K):
        o = b * 210
        d = _h(src, o + 208)
        for half in range(2):
            ql = o + half * 64
            qh = o + 128 + half * 32
            sc = o + 192 + half * 8
            base = b * QK_K + half * 128
            for i in range(2):
                # the four scales of elements 16i..16i+15 of each 32-element quarter
                d1 = d * F32(np.int8(src[sc + i]))
                d2 = d * F32(np.int8(src[sc + i + 2]))
                d3 = d * F32(np.int8(src[sc + i + 4]))
                d4 = d * F32(np.int8(src[sc + i + 6]))
                for t in range(L // 2):
                    l = 16 * i + t
                    a = src[ql + l]
                    c = src[ql + l + 32]
                    h = src[qh + l]
                    q1 = (np.int32(a & 15) | (np.int32(h & 3) << 4)) - 32
                    q2 = (np.int32(c & 15) | (np.int32((h >> 2) & 3) << 4)) - 32
                    q3 = (np.int32(a >> 4) | (np.int32((h >> 4) & 3) << 4)) - 32
                    q4 = (np.int32(c >> 4) | (np.int32((h >> 6) & 3) << 4)) - 32
                    dst[base + l] = d1 * F32(q1)
                    dst[base + l + 32] = d2 * F32(q2)
                    dst[base + l + 64] = d3 * F32(q3)
                    dst[base + l + 96] = d4 * F32(q4)


@njit(inline="always")
def scale_q3_k(j, src, o):
    """Signed 6-bit scale (-32..31) of sub-block j of 16 from the 12 bytes at src[o:o+12]:
    low nibble from byte j % 8 (high nibble for j >= 8), top 2 bits from byte 8 + j % 4."""
    lo = (np.int32(src[o + (j & 7)]) >> (4 * (j >> 3))) & 15
    hi = (np.int32(src[o + 8 + (j & 3)]) >> (2 * (j >> 2))) & 3
    return (lo | (hi << 4)) - 32


@njit(cache=True, nogil=True)
def deq_row_q3_k(src, dst, L):
    for b in range(dst.size // QK_K):
        o = b * 110
        d = _h(src, o + 108)
        for half in range(2):
            for j in range(4):
                # elements 128 half + 32 j + l: bits 2j of qs[32 half + l], bit 4 half + j of hmask[l]
                for s in range(2):
                    dl = d * F32(scale_q3_k(8 * half + 2 * j + s, src, o + 96))
                    base = b * QK_K + 128 * half + 32 * j + 16 * s
                    for t in range(L // 2):
                        l = 16 * s + t
                        q = np.int32((src[o + 32 + 32 * half + l] >> (2 * j)) & 3)
                        h = np.int32((src[o + l] >> (4 * half + j)) & 1)
                        dst[base + t] = dl * F32(q - 4 + 4 * h)


@njit(cache=True, nogil=True)
def deq_row_f16(src, dst, L):
    for i in range(dst.size):
        dst[i] = _h(src, 2 * i)


@njit(cache=True, nogil=True)
def deq_row_bf16(src, dst, L):
    for i in range(dst.size):
        u = (np.uint32(src[2 * i]) | (np.uint32(src[2 * i + 1]) << np.uint32(8))) << np.uint32(16)
        dst[i] = bits_to_f32(u)


@njit(cache=True, nogil=True)
def deq_row_f32(src, dst, L):
    for i in range(dst.size):
        dst[i] = bits_to_f32(_u32(src, 4 * i))


@njit(cache=True, nogil=True)
def deq_row(qt, src, dst, L):
    """Decode one row of type id qt (bytes src) into dst (float32, row length).

    L is always 32; it is passed at run time because with literal trip counts
    LLVM unrolls the short inner loops and then cannot vectorize their stores
    (it cannot prove dst and src do not alias), while the loop vectorizer adds
    a run-time alias check: measured 2-6x faster for Q4_0/Q4_1/Q8_0/Q6_K.
    The arithmetic per element is unchanged, so results stay bit-exact."""
    if qt == 12:
        deq_row_q4_k(src, dst, L)
    elif qt == 14:
        deq_row_q6_k(src, dst, L)
    elif qt == 3:
        deq_row_q4_1(src, dst, L)
    elif qt == 6:
        deq_row_q5_0(src, dst, L)
    elif qt == 8:
        deq_row_q8_0(src, dst, L)
    elif qt == 2:
        deq_row_q4_0(src, dst, L)
    elif qt == 7:
        deq_row_q5_1(src, dst, L)
    elif qt == 13:
        deq_row_q5_k(src, dst, L)
    elif qt == 11:
        deq_row_q3_k(src, dst, L)
    elif qt == 39:
        deq_row_mxfp4(src, dst, L)
    elif qt == 1:
        deq_row_f16(src, dst, L)
    elif qt == 30:
        deq_row_bf16(src, dst, L)
    else:
        deq_row_f32(src, dst, L)


@njit(parallel=True, cache=True, nogil=True)
def deq_rows_kernel(qt, data, rows, out, L):
    """out[i] = decoded row rows[i] of data (L = 32, see deq_row)."""
    for i in prange(rows.size):
        deq_row(qt, data[rows[i]], out[i], L)


@njit(parallel=True, cache=True, nogil=True)
def deq_range_kernel(qt, data, r0, out, L):
    """out[i] = decoded row r0 + i of data (a tile of consecutive rows; L = 32)."""
    for i in prange(out.shape[0]):
        deq_row(qt, data[r0 + i], out[i], L)


_NP_FLOAT = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}


def dequantize(qt: QTensor) -> np.ndarray:
    """The whole tensor as float32 of qt.shape (for tests and odd paths; matmul never does this)."""
    t = qt.qtype
    if t == GGMLType.F32:
        return qt.data.view(np.float32).reshape(qt.shape).copy()
    if t == GGMLType.F16:
        return qt.data.view(np.float16).astype(np.float32).reshape(qt.shape)
    out = np.empty((qt.rows, qt.cols), np.float32)
    if qt.rows:
        deq_range_kernel(int(t), qt.data, 0, out, 32)
    return out.reshape(qt.shape)


def check_rows(qt: QTensor, rows: np.ndarray) -> None:
    """IndexError unless every index of rows (an array) is a row of qt."""
    if rows.size and (rows.min() < 0 or rows.max() >= qt.rows):
        raise IndexError(f"tensor {qt.name!r}: row index out of range [0, {qt.rows})")


def dequantize_rows(qt: QTensor, rows) -> np.ndarray:
    """float32 [len(rows), cols]: only the listed rows are read (embedding lookup)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    check_rows(qt, rows)
    if qt.qtype in (GGMLType.F32, GGMLType.F16):
        return qt.data[rows].view(_NP_FLOAT[qt.qtype]).astype(np.float32)
    out = np.empty((rows.size, qt.cols), np.float32)
    if rows.size:
        deq_rows_kernel(int(qt.qtype), qt.data, rows, out, 32)
    return out
