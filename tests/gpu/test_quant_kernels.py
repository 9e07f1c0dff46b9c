"""quant/cuda kernels against float64 references built from the CPU dequantizer."""
from __future__ import annotations

import numpy as np
import pytest

import quant
from quant import GGMLType, QTensor
from runtime.backend.cuda_synth import _Noise, random_weight

pytestmark = pytest.mark.gpu

TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
         GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]


def _rel(a, ref):
    assert np.all(np.isfinite(a)), "non-finite or unwritten output"
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def _weight(qtype, M, K, seed):
    if qtype in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_K) and seed % 2:
        # real encoder output for the types quant/ can encode
        x = np.random.default_rng(seed).standard_normal((M, K)).astype(np.float32) * 0.05
        return QTensor("w", qtype, (M, K), quant.quantize(x, qtype))
    return QTensor("w", qtype, (M, K), random_weight(qtype, (M, K), _Noise(seed, 1 << 16)))


def _K(qtype):
    # widths that leave some lanes idle on the last pass: 40 K-quant parts, 24 legacy blocks
    return 1280 if qtype in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 768


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 8, 40])
def test_matmul_matches_float64(qtype, n):
    import cupy as cp
    import quant.cuda as qc
    M, K = 77, _K(qtype)
    for seed in (n, n + 1):
        qt = _weight(qtype, M, K, seed)
        W = qc.upload(qt)
        x = np.random.default_rng(seed + 100).standard_normal((n, K)).astype(np.float32)
        ref = x.astype(np.float64) @ quant.dequantize(qt).astype(np.float64).T
        y = cp.full((n, M), np.nan, cp.float32)
        qc.matmul(cp.asarray(x), [W], [y])
        err = _rel(y.get(), ref)
        # n <= 8: float32 decode in registers; n > 8: fp16 operands on the tensor cores
        assert err < (1e-5 if n <= qc.MV_MAX_ROWS else 2e-3), (qtype.name, n, err)


@pytest.mark.parametrize("n", [1, 5, 33])
def test_matmul_multi_bias_and_accumulate(n):
    """q/k/v in one launch with biases; matmul_add accumulates into the residual."""
    import cupy as cp
    import quant.cuda as qc
    K = 512
    qts = [_weight(GGMLType.Q4_K, M, K, 7 + i) for i, M in enumerate((96, 32, 32))]
    Ws = [qc.upload(q) for q in qts]
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    biases = [rng.standard_normal(q.shape[0]).astype(np.float32) for q in qts]
    outs = [cp.full((n, q.shape[0]), np.nan, cp.float32) for q in qts]
    qc.matmul(cp.asarray(x), Ws, outs, [cp.asarray(b) for b in biases])
    tol = 1e-5 if n <= qc.MV_MAX_ROWS else 2e-3
    for q, o, b in zip(qts, outs, biases):
        ref = x.astype(np.float64) @ quant.dequantize(q).astype(np.float64).T + b
        assert _rel(o.get(), ref) < tol
    acc0 = rng.standard_normal((n, 96)).astype(np.float32)
    acc = cp.asarray(acc0)
    qc.matmul(cp.asarray(x), [Ws[0]], [acc], accumulate=True)
    ref = acc0 + x.astype(np.float64) @ quant.dequantize(qts[0]).astype(np.float64).T
    assert _rel(acc.get(), ref) < tol


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embed_rows_and_dequantize(qtype):
    import cupy as cp
    import quant.cuda as qc
    M, K = 50, _K(qtype)
    qt = _weight(qtype, M, K, 3)
    W = qc.upload(qt)
    ids = np.array([0, 49, 7, 7, 23], np.int32)
    out = cp.full((len(ids), K), np.nan, cp.float32)
    qc.embed_rows(W, cp.asarray(ids), out, 2.0)
    ref = quant.dequantize_rows(qt, ids).astype(np.float64) * 2.0
    assert _rel(out.get(), ref) < 1e-6
    full = qc.dequantize_f16(W).get().astype(np.float64)
    assert _rel(full, quant.dequantize(qt).astype(np.float64)) < 1e-3


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.F16],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("pro", ["rmsnorm", "silu", "gelu"])
def test_matvec_prologues(qtype, n, pro):
    """The op before a decode matvec folded into its loads: RMSNorm, SwiGLU, GeGLU."""
    import cupy as cp
    import quant.cuda as qc
    M, K = 66, _K(qtype)
    qt = _weight(qtype, M, K, 11)
    W = qc.upload(qt)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, K)).astype(np.float32) * 2
    w = rng.standard_normal(K).astype(np.float32)
    x64 = x.astype(np.float64)
    if pro == "rmsnorm":
        h = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
        prologue = ("rmsnorm", cp.asarray(w), 1e-6)
    else:
        u = rng.standard_normal((n, K)).astype(np.float32)
        if pro == "silu":
            h = x64 / (1 + np.exp(-x64)) * u
        else:
            h = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3))) * u
        prologue = (pro, cp.asarray(u))
    ref = h @ quant.dequantize(qt).astype(np.float64).T
    y = cp.full((n, M), np.nan, cp.float32)
    qc.matmul(cp.asarray(x), [W], [y], prologue=prologue)
    assert _rel(y.get(), ref) < 1e-5


INT8_TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
              GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 2])
def test_int8_matvec_path(qtype, n):
    """The integer decode path (x rounded to int8 per 16 values, dp4a): close to the
    float64 reference (8-bit activations: ~1e-3 relative), q/k/v-style multi-weight launch
    and the residual accumulate included."""
    import cupy as cp
    import quant.cuda as qc
    K = _K(qtype)
    qts = [_weight(qtype, M, K, 20 + i) for i, M in enumerate((77, 32))]
    Ws = [qc.upload(q) for q in qts]
    x = np.random.default_rng(n).standard_normal((n, K)).astype(np.float32)
    outs = [cp.full((n, q.shape[0]), np.nan, cp.float32) for q in qts]
    ws = qc.Workspace()
    qc.matvec_int8(cp.asarray(x), Ws, outs, None, False, ws)
    for q, o in zip(qts, outs):
        ref = x.astype(np.float64) @ quant.dequantize(q).astype(np.float64).T
        assert _rel(o.get(), ref) < 1.5e-2, (qtype.name, n)
    acc0 = np.ones((n, 77), np.float32)
    acc = cp.asarray(acc0)
    qc.matvec_int8(cp.asarray(x), Ws[:1], [acc], None, True, ws)
    ref = acc0 + x.astype(np.float64) @ quant.dequantize(qts[0]).astype(np.float64).T
    assert _rel(acc.get(), ref) < 1.5e-2
