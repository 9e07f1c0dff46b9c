"""The VNNI kernels' activation rounding (vector IR, act_quant.q8_block) gives
exactly the codes, steps and sums of the scalar reference rounding
(quantize_q8_32 / quantize_q8_256, which the GPU kernels are tested against)."""
import numpy as np
import pytest

from quant import act_quant as A


def _inputs(n, K, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, K)) * rng.choice([1e-3, 1.0, 40.0], size=(n, 1))).astype(np.float32)
    x[0, :32] = 0.0                       # an all-zero block: step 0, codes 0
    x[1 % n, 40:72] = 0.0
    # values that land exactly on .5 after scaling: rounding must be half-to-even
    x[n - 1, 256 - 32:256] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)
    x[n - 1, 256 - 33] = np.float32(127.0)  # so the block's step is 1 and the halves stay halves
    return x


@pytest.mark.parametrize("n,K", [(1, 1536), (3, 256), (2, 8960)])
def test_q8_256_i8_matches_reference(n, K):
    x = _inputs(n, K, K)
    ref_q = np.zeros((n, K), np.int16)
    ref_d = np.zeros((n, K // 256), np.float32)
    ref_b = np.zeros((n, K // 32), np.int32)
    A.quantize_q8_256(x, ref_q, ref_d, ref_b)
    xq, xq4 = np.zeros(n * K, np.int8), np.zeros(n * K, np.int8)
    xd, xb, xb16 = np.zeros(n * K // 256, np.float32), np.zeros(n * K // 32, np.int32), np.zeros(n * K // 16, np.int32)
    xbf = np.zeros(n * K // 32, np.float32)
    A.quantize_q8_256_i8(x, xq, xq4, xd, xb, xb16, xbf)
    assert np.array_equal(xq.reshape(n, K), ref_q)
    assert np.array_equal(xd.reshape(n, -1), ref_d)
    assert np.array_equal(xb.reshape(n, -1), ref_b)
    assert np.array_equal(xb16, ref_q.reshape(-1, 16).sum(1))
    assert np.array_equal(xbf, (ref_b.astype(np.float32) * np.repeat(ref_d, 8, axis=1)).reshape(-1))
    # xq4: each 256-block's codes in Q4_K's load order
    assert np.array_equal(xq4.reshape(-1, 256), xq.reshape(-1, 256)[:, A.Q4_K_ORDER])
    assert sorted(A.Q4_K_ORDER) == list(range(256))


@pytest.mark.parametrize("n,K", [(1, 576), (3, 896), (2, 4864), (2, 608)])
def test_q8_32_i8_matches_reference(n, K):
    x = _inputs(n, K, K)
    ref_q = np.zeros((n, K), np.int16)
    ref_d = np.zeros((n, K // 32), np.float32)
    ref_s = np.zeros((n, K // 32), np.float32)
    A.quantize_q8_32(x, ref_q, ref_d, ref_s)
    xq = np.zeros(n * K, np.int8)
    xd, xsum, xs = np.zeros(n * K // 32, np.float32), np.zeros(n * K // 32, np.int32), np.zeros(n * K // 32, np.float32)
    A.quantize_q8_32_i8(x, xq, xd, xsum, xs)
    nat = np.empty_like(xq.reshape(n, K))
    nat[:, A.pair_order(K)] = xq.reshape(n, K)
    assert np.array_equal(nat, ref_q)
    assert np.array_equal(xd.reshape(n, -1), ref_d)
    assert np.array_equal(xsum, ref_q.reshape(-1, 32).sum(1))
    assert np.array_equal(xs.reshape(n, -1), ref_s)
    assert (xd.reshape(n, -1)[0, 0], xsum[0]) == (0.0, 0)
