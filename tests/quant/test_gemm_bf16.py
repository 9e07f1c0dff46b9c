"""The bf16 prompt kernel's W tiles (quant/gemm_bf16.py) hold exactly the bfloat16
pairs of the dequantized weights, whichever way a type is packed: K-quants
decoded straight to pairs in IR (deq_pack_k + trans_tile), other types
dequantized a column chunk at a time and packed (pack_tile).  The reference is
`dequantize` (the scalar decoders) rounded to nearest-even bfloat16 in numpy.
The AMX kernel (quant/amx.py) multiplies the same tiles and is held to the same
bound."""
import numba
import numpy as np
import pytest

from quant import GGMLType, QTensor, dequantize
from quant import amx as AMX
from quant import gemm_bf16 as GB
from conftest import random_weight_bytes

pytestmark = pytest.mark.skipif(not GB.HAVE_BF16, reason="this CPU has no AVX512_BF16")


def _bf16(a: np.ndarray) -> np.ndarray:
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)


def _tile_ref(Wd: np.ndarray, m0: int) -> np.ndarray:
    """wp[p, j] = pair p of W row m0 + j (rows past the end: 0)."""
    rows = np.zeros((GB.TILE, Wd.shape[1]), np.float32)
    t = min(GB.TILE, Wd.shape[0] - m0)
    rows[:t] = Wd[m0:m0 + t]
    b = _bf16(rows)
    return (b[:, 0::2] | (b[:, 1::2] << 16)).T.copy()


@numba.njit
def _tile_k(kind, w, m0, t, P, wp, K):
    for j in range(t, 32):
        P[j, :] = 0
    for sb in range(K // 256):
        if kind == 12:
            GB.deq_pack_k(12, w, m0, t, sb, P)
        else:
            GB.deq_pack_k(14, w, m0, t, sb, P)
        GB.trans_tile(P, wp, sb * 128)


@numba.njit
def _tile_f(f, wp, K, ch):
    for k0 in range(0, K, ch):
        GB.pack_tile(f[:, k0:], wp, k0 // 2, ch // 2)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K])
@pytest.mark.parametrize("K", [256, 1536])
def test_kquant_tiles_are_exact_bf16_pairs(qtype, K):
    rng = np.random.default_rng(K + int(qtype))
    M = 45                                   # a full tile, then 13 rows
    w = random_weight_bytes(rng, qtype, M, K)
    Wd = dequantize(QTensor("w", qtype, (M, K), w)).astype(np.float32)
    P = np.full((32, 128), 0xDEADBEEF, np.uint32)     # stale rows must not leak
    for m0 in (0, 32):
        wp = np.full((K // 2, 32), 7, np.uint32)
        _tile_k(int(qtype), w, m0, min(32, M - m0), P, wp, K)
        np.testing.assert_array_equal(wp, _tile_ref(Wd, m0))


@pytest.mark.parametrize("K", [576, 896, 1536])
def test_float_rows_pack_exactly(K):
    rng = np.random.default_rng(K)
    f = (rng.standard_normal((32, K)) * 10.0 ** rng.integers(-30, 30, (32, K))).astype(np.float32)
    f[0, :8] = [0.0, -0.0, 1.0, -1.0, 1.00390625, 1.01171875, 3.0e38, -1e-40]   # ties, signs, a subnormal
    wp = np.zeros((K // 2, 32), np.uint32)
    _tile_f(np.ascontiguousarray(f), wp, K, GB.chunk_cols(K))
    np.testing.assert_array_equal(wp, _tile_ref(f, 0))


KERNELS = [pytest.param("avx512", id="vdpbf16ps"),
           pytest.param("amx", id="amx", marks=pytest.mark.skipif(not AMX.HAVE_AMX, reason="no AMX-BF16 tiles here"))]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype,K", [(GGMLType.Q4_K, 512), (GGMLType.Q6_K, 768), (GGMLType.Q4_1, 576),
                                     (GGMLType.Q5_0, 896), (GGMLType.Q8_0, 640), (GGMLType.Q4_0, 1024),
                                     (GGMLType.MXFP4, 2880)])
@pytest.mark.parametrize("n", [21, 70])
def test_gemm_equals_bf16_reference(qtype, K, n, kernel):
    """The whole kernel: float32 sums of bf16 products of x and W, for every
    way of preparing a tile and a partial last tile of W and of x (70 rows:
    AMX's 32-row passes, the last one partial)."""
    rng = np.random.default_rng(3)
    M = 45
    w = random_weight_bytes(rng, qtype, M, K)
    Wd = dequantize(QTensor("w", qtype, (M, K), w)).astype(np.float32)
    x = rng.standard_normal((n, K)).astype(np.float32)
    rows = AMX.ROWS if kernel == "amx" else GB.ROWS
    xb = np.zeros((-(-n // rows) * rows, K // 2), np.uint32)
    GB.pack_x(x, xb)
    out = np.zeros((n, M), np.float32)
    nt = numba.config.NUMBA_NUM_THREADS
    fn = AMX.gemm_amx_tiles if kernel == "amx" else GB.gemm_bf16_tiles
    fn(int(qtype), w, xb, n, out, np.zeros((nt, 32, GB.chunk_cols(K)), np.float32),
       np.zeros((nt, K // 2, 32), np.uint32), np.zeros((nt, rows, 32), np.float32),
       np.zeros((nt, 32, 128), np.uint32))

    def up(a):
        return (_bf16(a).astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    xr, wr = up(x), up(Wd)
    ref = xr @ wr.T
    bound = 1e-5 * (np.abs(xr) @ np.abs(wr).T) + 1e-30
    assert np.max(np.abs(out - ref) / bound) <= 1.0
