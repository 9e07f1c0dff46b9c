"""The GGML tensor types: ids as GGUF stores them, and each one's block layout.

Every GGML format stores a row as a run of fixed-size blocks; a block holds
`block_elems` weights in `block_bytes` bytes.  Sizes are known for every GGML
type so that a file can be opened and its unsupported tensors *named*; only the
types in SUPPORTED have kernels.
"""
from __future__ import annotations

from enum import IntEnum

QK = 32        # elements per block of the "legacy" formats (Q4_0 .. Q8_0)
QK_K = 256     # elements per super-block of the K-quants


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q4_2 = 4          # retired in 2023; listed so old files get a named error
    Q4_3 = 5          # retired in 2023
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    Q4_0_4_4 = 31     # retired: llama.cpp repacks Q4_0 at load time since 2024
    Q4_0_4_8 = 32
    Q4_0_8_8 = 33
    TQ1_0 = 34
    TQ2_0 = 35
    IQ4_NL_4_4 = 36   # retired
    IQ4_NL_4_8 = 37
    IQ4_NL_8_8 = 38
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


# (block_elems, block_bytes) for every GGML type, as in ggml.c's type_traits.
BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 18),    # f16 d, 16 B nibbles
    GGMLType.Q4_1: (32, 20),    # f16 d, f16 m, 16 B nibbles
    GGMLType.Q5_0: (32, 22),    # f16 d, 4 B high bits, 16 B nibbles
    GGMLType.Q5_1: (32, 24),    # f16 d, f16 m, 4 B high bits, 16 B nibbles
    GGMLType.Q8_0: (32, 34),    # f16 d, 32 int8
    GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),  # f16 d, f16 dmin, 12 B 6-bit scales/mins, 128 B nibbles
    GGMLType.Q5_K: (256, 176),  # f16 d, f16 dmin, 12 B scales, 32 B high bits, 128 B nibbles
    GGMLType.Q6_K: (256, 210),  # 128 B low nibbles, 64 B high 2 bits, 16 int8 scales, f16 d
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66), GGMLType.IQ2_XS: (256, 74), GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50), GGMLType.IQ4_NL: (32, 18), GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82), GGMLType.IQ4_XS: (256, 136),
    GGMLType.I8: (1, 1), GGMLType.I16: (1, 2), GGMLType.I32: (1, 4), GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8), GGMLType.IQ1_M: (256, 56), GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66), GGMLType.MXFP4: (32, 17), GGMLType.NVFP4: (64, 36),
    GGMLType.Q1_0: (128, 18),
}

# Byte layout of one block of each supported type (little-endian; f16 = IEEE half):
#   Q4_0  f16 d | u8 qs[16]             x[j] = d*((qs[j]&15)-8), x[j+16] = d*((qs[j]>>4)-8)
#   Q4_1  f16 d | f16 m | u8 qs[16]     x[j] = d*(qs[j]&15) + m, x[j+16] = d*(qs[j]>>4) + m
#   Q5_0  f16 d | u32 qh | u8 qs[16]    bit j of qh is the 5th bit of element j; x = d*(q-16)
#   Q5_1  f16 d | f16 m | u32 qh | u8 qs[16]                          x = d*q + m
#   Q8_0  f16 d | i8 qs[32]                                           x = d*q
#   Q4_K  f16 d | f16 dmin | u8 scales[12] | u8 qs[128]: 8 sub-blocks of 32 with 6-bit
#         scale sc and min mn packed in `scales`; 64-element group g is qs[32g:32g+32],
#         low nibbles = sub-block 2g, high = 2g+1.               x = d*sc*q - dmin*mn
#   Q5_K  f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]: as Q4_K, and bit s
#         of qh[l] is the 5th bit of element l of sub-block s
#   Q6_K  u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d: 16 sub-blocks of 16;
#         half h (128 elements) uses ql[64h:64h+64], qh[32h:32h+32]; x = d*sc*(q-32)
#   MXFP4 u8 e | u8 qs[16]              x[j] = E2M1(qs[j]&15) * 2^(e-127), x[j+16] the same of
#         qs[j]>>4: E2M1 code c is (-1)^(c>>3) * {0, .5, 1, 1.5, 2, 3, 4, 6}[c&7], computed as
#         ggml does: KVALUES_MXFP4[c] (the doubled values, int8) times e8m0_half(e) =
#         2^(e-128) as a float32 (subnormal for e < 2; e = 255 is 2^127, not NaN, as in ggml)

SUPPORTED = frozenset({
    GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
    GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4,
})

# MXFP4's E2M1 codes, doubled so they are integers (ggml's kvalues_mxfp4): code c stands
# for KVALUES_MXFP4[c] / 2 times the block's power of two
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

TYPE_INFO = {t: BLOCK_LAYOUT[t] for t in SUPPORTED}


class UnsupportedQuantType(ValueError):
    """A tensor's type has no kernel here (or is not a GGML type at all)."""

    def __init__(self, qtype, tensor: str = "?"):
        try:
            label = GGMLType(int(qtype)).name
        except ValueError:
            label = f"unknown type id {int(qtype)}"
        supported = ", ".join(t.name for t in sorted(SUPPORTED))
        super().__init__(f"tensor '{tensor}' uses quantization type {label}, which Llamba does not "
                         f"support (supported: {supported})")
        self.qtype, self.tensor = qtype, tensor
        self.tensor_name = tensor


def type_name(qtype: int) -> str:
    try:
        return GGMLType(int(qtype)).name
    except ValueError:
        return f"type{int(qtype)}"


def row_nbytes(qtype: int, ncols: int, tensor: str = "?") -> int:
    """Bytes of one row of `ncols` weights; the row length must be whole blocks."""
    try:
        elems, nbytes = BLOCK_LAYOUT[GGMLType(int(qtype))]
    except (ValueError, KeyError):
        raise UnsupportedQuantType(qtype, tensor) from None
    if ncols % elems:
        raise ValueError(f"tensor '{tensor}': row of {ncols} values is not a whole number of "
                         f"{type_name(qtype)} blocks ({elems})")
    return ncols // elems * nbytes


def tensor_nbytes(qtype: int, shape: tuple[int, ...], tensor: str = "?") -> int:
    """Bytes of a whole tensor of numpy-order `shape` (last axis = contiguous row)."""
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows * row_nbytes(qtype, int(shape[-1]), tensor)


def as_supported_type(qtype, tensor: str = "?") -> GGMLType:
    """int / GGMLType / gguf.GGMLQuantizationType -> GGMLType, or UnsupportedQuantType."""
    try:
        t = GGMLType(int(qtype))
    except (ValueError, TypeError):
        raise UnsupportedQuantType(qtype, tensor) from None
    if t not in SUPPORTED:
        raise UnsupportedQuantType(t, tensor)
    return t
