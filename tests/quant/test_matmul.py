"""matmul(x, W) = x @ W.T against dequantize-then-float64 matmul.

Stated tolerance, per output element y[r, m] (a rigorous bound, not a fit):
* float activations (F32/F16/BF16 weights, large batches, any path that keeps
  x in float32): |y - ref| <= 1e-5 * sum_k |x[r,k] * W[m,k]|, float32
  accumulation error with margin.
* bfloat16 products (large batches where the CPU has AVX512_BF16,
  quant.matmul_cpu.bf16_path): x and W each rounded to 8 significant bits
  (unit roundoff u = 2^-8), sums in float32: |y - ref| <= (2u + u^2) *
  sum_k |x[r,k] * W[m,k]| + the float term above.
* 8-bit activations (quantized weights on the small-batch path; block size B
  from quant.matmul_cpu.activation_block: 32, or 256 for K-quants): x is
  rounded to int8 in blocks of B with step d_b = amax_b / 127, so each x
  element moves by at most d_b/2:
  |y - ref| <= sum_b d_b/2 * sum_{k in b} |W[m,k]|  + the float term above.
"""
import numpy as np
import pytest

from quant import TYPE_INFO, GGMLType, QTensor, dequantize, matmul, matmul_into, matmul_multi
from quant.matmul_cpu import activation_block, bf16_path, BATCH_INVARIANT_MAX_ROWS, Scratch
from conftest import random_weight_bytes, real_tensors

TYPES = list(TYPE_INFO)


@pytest.fixture(params=["vnni", "int16"], autouse=True)
def kernel_path(request, monkeypatch):
    """Every test runs on both small-batch kernel sets: the u8 x s8 one (quant/vnni.py,
    where this CPU has AVX512-VNNI or AVX2) and the portable int16 fallback."""
    import quant.matmul_cpu as mc
    from quant.vnni import INT8_DOT
    if request.param == "vnni" and not INT8_DOT:
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2")
    monkeypatch.setattr(mc, "USE_VNNI", request.param == "vnni")
    return request.param


def _bound(x, Wd, qtype):
    x64 = x.astype(np.float64)
    bound = 1e-5 * (np.abs(x64) @ np.abs(Wd).T) + 1e-30
    if bf16_path(x.shape[0], qtype, x.shape[1]):
        u = 2.0 ** -8
        bound += (2 * u + u * u) * (np.abs(x64) @ np.abs(Wd).T)
    blk = activation_block(qtype, x.shape[0])
    if blk:
        n, K = x.shape
        amax = np.abs(x64).reshape(n, K // blk, blk).max(-1)              # [n, nb]
        wabs = np.abs(Wd).reshape(Wd.shape[0], K // blk, blk).sum(-1)     # [M, nb]
        bound += (amax / 127 / 2) @ wabs.T
    return bound


def _check(x, W, y):
    Wd = dequantize(W).astype(np.float64)
    ref = x.astype(np.float64) @ Wd.T
    bound = _bound(x, Wd, W.qtype)
    worst = np.max(np.abs(y - ref) / bound)
    assert worst <= 1.0, f"{W.qtype.name} n={x.shape[0]}: error {worst:.3g} x the stated bound"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 4, 64])
def test_matches_float64_reference(qtype, n, rng):
    M, K = 48, 512
    W = QTensor("w", qtype, (M, K), random_weight_bytes(rng, qtype, M, K))
    x = rng.standard_normal((n, K)).astype(np.float32)
    _check(x, W, matmul(x, W))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_batch_invariance(qtype, rng):
    """Row r's result is bit-identical for any n <= BATCH_INVARIANT_MAX_ROWS,
    whatever the other rows hold (speculative decoding's greedy exactness)."""
    # 32-element formats: 1-14 blocks a row, so every tail after groups of 8 (0-7) occurs
    sizes = [256, 512] if TYPE_INFO[qtype][0] == 256 else [32, 96, 224, 256, 352, 448]
    for K in sizes:
        M = 40
        W = QTensor("w", qtype, (M, K), random_weight_bytes(rng, qtype, M, K))
        probe = rng.standard_normal((1, K)).astype(np.float32)
        alone = matmul(probe, W)[0].copy()
        _check(probe, W, alone[None])
        for n in range(2, BATCH_INVARIANT_MAX_ROWS + 1, 1 if K in (96, 256) else 5):
            x = (rng.standard_normal((n, K)) * rng.uniform(0.01, 100, (n, 1))).astype(np.float32)
            r = rng.integers(n)
            x[r] = probe[0]
            np.testing.assert_array_equal(matmul(x, W)[r], alone, err_msg=f"K={K}, n={n}, row {r}")


def test_real_weights(rng):
    for model in ("SmolLM2-135M-Instruct-Q4_1.gguf", "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"):
        for name, qtype, shape, raw in real_tensors(model, max_rows=64):
            W = QTensor(name, qtype, shape, raw)
            for n in (1, 4):
                x = rng.standard_normal((n, shape[1])).astype(np.float32)
                _check(x, W, matmul(x, W))


def test_entry_points_agree(rng):
    K = 256
    Ws = [QTensor(f"w{i}", t, (M, K), random_weight_bytes(rng, t, M, K))
          for i, (t, M) in enumerate([(GGMLType.Q4_K, 24), (GGMLType.Q8_0, 8), (GGMLType.Q6_K, 16)])]
    x = rng.standard_normal((3, K)).astype(np.float32)
    expect = [matmul(x, W) for W in Ws]
    outs = [np.full((3, W.shape[0]), np.nan, np.float32) for W in Ws]
    assert all(o is r for o, r in zip(outs, matmul_multi(x, Ws, outs)))
    for o, e in zip(outs, expect):
        np.testing.assert_array_equal(o, e)
    scratch = Scratch()
    out = np.empty((3, 24), np.float32)
    matmul_into(x, Ws[0], out, scratch)
    np.testing.assert_array_equal(out, expect[0])
    np.testing.assert_array_equal(matmul(x[1], Ws[0]), expect[0][1])     # 1-D x
    strided = np.empty((3, 48), np.float32)[:, ::2]                       # non-contiguous out
    matmul(x, Ws[0], strided)
    np.testing.assert_array_equal(strided, expect[0])
    with pytest.raises(ValueError, match="w0"):
        matmul(np.zeros((1, 128), np.float32), Ws[0])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_parallel_split_is_bit_identical(qtype, rng, monkeypatch):
    """The multi-threaded path (several chunks of W rows) gives exactly the
    serial result: how rows are split between threads never changes a value."""
    import quant.matmul_cpu as mc
    M, K = 37, 512
    W = QTensor("w", qtype, (M, K), random_weight_bytes(rng, qtype, M, K))
    x = rng.standard_normal((5, K)).astype(np.float32)
    serial = matmul(x, W)
    monkeypatch.setattr(mc, "PARALLEL_MIN_ELEMS", 0)
    parallel = matmul(x, W)
    np.testing.assert_array_equal(parallel, serial)
    _check(x, W, parallel)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.MXFP4],
                         ids=lambda t: t.name)
def test_matmul_multi_fused_region_is_bit_identical(qtype, rng, monkeypatch):
    """matmul_multi runs same-type weights (q/k/v, gate/up) in one parallel
    region; each output equals the separate matmul exactly."""
    import quant.matmul_cpu as mc
    monkeypatch.setattr(mc, "PARALLEL_MIN_ELEMS", 0)
    K = 512
    Ws = [QTensor(f"w{i}", qtype, (M, K), random_weight_bytes(rng, qtype, M, K))
          for i, M in enumerate((40, 9, 23))]
    x = rng.standard_normal((3, K)).astype(np.float32)
    outs = matmul_multi(x, Ws)
    for W, o in zip(Ws, outs):
        np.testing.assert_array_equal(o, matmul(x, W))


@pytest.mark.parametrize("n", [1, 3])
def test_matmul_multi_mixed_k_quants_is_bit_identical(n, rng, monkeypatch):
    """Q4_K and Q6_K weights together (q/k/v of Q4_K_M files) share one parallel
    region and one activation quantization; each output equals the separate
    matmul exactly."""
    import quant.matmul_cpu as mc
    monkeypatch.setattr(mc, "PARALLEL_MIN_ELEMS", 0)
    K = 512
    types_ = (GGMLType.Q4_K, GGMLType.Q4_K, GGMLType.Q6_K)
    Ws = [QTensor(f"w{i}", t, (M, K), random_weight_bytes(rng, t, M, K))
          for i, (t, M) in enumerate(zip(types_, (40, 9, 23)))]
    x = rng.standard_normal((n, K)).astype(np.float32)
    outs = matmul_multi(x, Ws)
    for W, o in zip(Ws, outs):
        np.testing.assert_array_equal(o, matmul(x, W))
        _check(x, W, o)


@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("K", [256, 1024])
def test_single_row_multi_w_row_path(qtype, K, rng):
    """Decode (n=1) with short W rows runs 4, then 2, then 1 W rows per kernel
    call (quant/vnni.py); long rows one at a time.  Both give exactly the
    values row r gets inside a larger batch, and stay within the bound."""
    M = 39                                # 4*9 + 2 + 1: every tail
    W = QTensor("w", qtype, (M, K), random_weight_bytes(rng, qtype, M, K))
    x = rng.standard_normal((5, K)).astype(np.float32)
    batch = matmul(x, W)
    for r in (0, 3):
        np.testing.assert_array_equal(matmul(x[r:r + 1], W)[0], batch[r])
    _check(x[:1], W, matmul(x[:1], W))


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
                                   GGMLType.MXFP4, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_row_groups_long_rows(qtype, rng):
    """Row-group kernels (n >= 3: groups of 4, 8 or 16 rows in vector lanes)
    and the row kernel (1-2 rows a W decode) on rows long enough for their main loops and every
    tail (K = 1248 / 1280: 39 / 40 blocks; 5 super-blocks): each row equals its
    n=1 value bit for bit for every n <= 16, and n = 17..31 (several groups)
    stays within the bound."""
    M = 21
    K = 1280 if TYPE_INFO[qtype][0] == 256 else 1248
    W = QTensor("w", qtype, (M, K), random_weight_bytes(rng, qtype, M, K))
    x = (rng.standard_normal((31, K)) * rng.uniform(0.01, 100, (31, 1))).astype(np.float32)
    alone = np.stack([matmul(x[r:r + 1], W)[0] for r in range(31)])
    for n in range(2, BATCH_INVARIANT_MAX_ROWS + 1):
        np.testing.assert_array_equal(matmul(x[:n], W), alone[:n], err_msg=f"n={n}")
    for n in (17, 24, 31):
        _check(x[:n], W, matmul(x[:n], W))


def test_q4_0_quad_kernel_same_bits_as_leg_rows(rng, monkeypatch):
    """vnni_quad (Q4_0, 1-2 rows, K a multiple of 128) gives leg_rows' bits: every
    K here has whole 8-block steps, and K = 384 / 896 also a 4-block tail; one W row
    up to several chunks; fused regions too."""
    import quant.matmul_cpu as MC
    from quant.vnni_quad import HAVE_QUAD
    if not (MC.USE_VNNI and HAVE_QUAD):
        pytest.skip("the quad kernel does not run with this kernel set (or CPU: it needs AVX512-VNNI and VBMI)")
    for K in (128, 256, 384, 896, 1024):
        for M in (1, 9, 300):
            W = QTensor("w", GGMLType.Q4_0, (M, K), random_weight_bytes(rng, GGMLType.Q4_0, M, K))
            x = (rng.standard_normal((3, K)) * rng.uniform(0.01, 100, (3, 1))).astype(np.float32)
            assert MC._vnni_kind(GGMLType.Q4_0, 1, K) == MC.QUAD
            for n in (1, 2):
                monkeypatch.setattr(MC, "USE_QUAD", True)
                quad = matmul(x[:n], W)
                monkeypatch.setattr(MC, "USE_QUAD", False)
                np.testing.assert_array_equal(quad, matmul(x[:n], W), err_msg=f"K={K}, M={M}, n={n}")
            monkeypatch.setattr(MC, "USE_QUAD", True)
            np.testing.assert_array_equal(matmul(x[1:2], W)[0], matmul(x, W)[1])   # and the row groups'
    Ws = [QTensor(f"w{i}", GGMLType.Q4_0, (2048, 896), random_weight_bytes(rng, GGMLType.Q4_0, 2048, 896))
          for i in range(2)]
    x = rng.standard_normal((2, 896)).astype(np.float32)
    quad = matmul_multi(x, Ws)
    monkeypatch.setattr(MC, "USE_QUAD", False)
    for a, b in zip(quad, matmul_multi(x, Ws)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q5_1, GGMLType.Q4_0, GGMLType.MXFP4],
                         ids=lambda t: t.name)
def test_extreme_codes(qtype, rng):
    """Every code byte at its largest (Q8_0 +127: 255 once xor 0x80; nibbles 15, fifth bits
    set) against activations at +-127: the products the u8 x s8 kernels take in pairs are as
    large as they get.  AVX2 sums such a pair in int16 (vpmaddubsw saturates), so this is
    where a lost bit would show; the results must still be within the bound, rows 1, 2 and
    a group alike."""
    M, K = 8, 1248 if qtype != GGMLType.Q8_0 else 1280
    be, bb = TYPE_INFO[qtype]
    raw = random_weight_bytes(rng, qtype, M, K).reshape(M, K // be, bb)
    first = {GGMLType.Q8_0: 2, GGMLType.Q5_1: 4, GGMLType.Q4_0: 2, GGMLType.MXFP4: 1}[qtype]
    raw[:, :, first:] = 0x7F if qtype == GGMLType.Q8_0 else 0xFF
    if qtype == GGMLType.MXFP4:
        raw[:, :, 1:] = 0x77             # code 7: +6, the largest positive E2M1 value (table code 24)
    W = QTensor("w", qtype, (M, K), raw.reshape(M, -1))
    x = np.ones((16, K), np.float32)    # all codes +127
    x[1] = -1                           # all -127
    for n in (1, 2, 16):
        _check(x[:n], W, matmul(x[:n], W))
