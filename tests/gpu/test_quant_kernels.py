"""quant/cuda kernels against float64 references built from the CPU dequantizer."""
from __future__ import annotations

import numpy as np
import pytest

import quant
from quant import GGMLType, QTensor
from lab.synth import _Noise, random_weight

pytestmark = pytest.mark.gpu

TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
         GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4]


def _rel(a, ref):
    assert np.all(np.isfinite(a)), "non-finite or unwritten output"
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def _weight(qtype, M, K, seed):
    if qtype in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.MXFP4) and seed % 2:
        # real encoder output for the types quant/ can encode
        x = np.random.default_rng(seed).standard_normal((M, K)).astype(np.float32) * 0.05
        return QTensor("w", qtype, (M, K), quant.quantize(x, qtype))
    return QTensor("w", qtype, (M, K), random_weight(qtype, (M, K), _Noise(seed, 1 << 16)))


@pytest.fixture
def float_matvec(monkeypatch):
    """The float32 matvec for quantized types too (the integer path is the default)."""
    import quant.cuda as qc
    monkeypatch.setattr(qc, "INT8_MATVEC", False)


def _K(qtype):
    # widths that leave some lanes idle on the last pass: 40 K-quant parts, 24 legacy blocks
    return 1280 if qtype in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 768


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 8, 40])
def test_matmul_matches_float64(qtype, n, float_matvec):
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
def test_matmul_multi_bias_and_accumulate(n, float_matvec):
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


@pytest.mark.parametrize("qtype", [GGMLType.F32, GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
def test_float_weight_matvec(qtype):
    """mvf (float weights at decode): three weights in one launch with biases, the
    residual add, a K whose last word step is partial (800 = 3 steps of 256 + 32),
    matrices over INT8_SMALL_M rows (4 a warp) and under (2), a row tail; each output
    row's bits the same whatever the batch (1 row or 8: speculative verify)."""
    import cupy as cp
    import quant.cuda as qc
    assert qc.FLOAT_MV == "mvf"
    K = 800
    qts = [_weight(qtype, M, K, 20 + i) for i, M in enumerate((4100, 33, 7))]
    Ws = [qc.upload(q) for q in qts]
    rng = np.random.default_rng(9)
    x = rng.standard_normal((8, K)).astype(np.float32)
    biases = [rng.standard_normal(q.shape[0]).astype(np.float32) for q in qts]
    deq = [quant.dequantize(q).astype(np.float64) for q in qts]
    by_n = {}
    for n in (1, 2, 3, 8):
        outs = [cp.full((n, q.shape[0]), np.nan, cp.float32) for q in qts]
        qc.matmul(cp.asarray(x[:n]), Ws, outs, [cp.asarray(b) for b in biases])
        for o, d, b in zip(outs, deq, biases):
            assert _rel(o.get(), x[:n].astype(np.float64) @ d.T + b) < 1e-6, (qtype.name, n)
        by_n[n] = [o.get() for o in outs]
    for n in (1, 2, 3):
        for a, b in zip(by_n[n], by_n[8]):
            assert np.array_equal(a, b[:n]), (qtype.name, n)
    acc0 = rng.standard_normal((2, 4100)).astype(np.float32)
    acc = cp.asarray(acc0)
    qc.matmul(cp.asarray(x[:2]), [Ws[0]], [acc], accumulate=True)
    assert _rel(acc.get(), acc0 + x[:2].astype(np.float64) @ deq[0].T) < 1e-6


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
    deq = quant.dequantize(qt).astype(np.float64)
    assert _rel(full, deq) < 1e-3
    # every element, written once where it belongs (the kernel stages a stretch of
    # 256 parts in shared memory; 50 rows of 24 or 40 parts end in a partial stretch
    # and stretches cross rows): fp16 rounding of each value and nothing else
    assert np.all(np.abs(full - deq) <= 1e-3 * np.abs(deq) + 1e-7)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.F16],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("n", [9, 40])
@pytest.mark.parametrize("pro", ["rmsnorm", "silu", "gelu"])
def test_gemm_prologues(qtype, n, pro):
    """The op before a matmul folded into it: RMSNorm, SwiGLU, GeGLU, in a prompt GEMM's
    fp16 conversion (the integer decode path's: test_int8_matvec_prologues)."""
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
    assert _rel(y.get(), ref) < 2e-3


def test_float_matvec_takes_no_prologue(float_matvec):
    """The float matvec folds nothing: a prologue there is the caller's error, not a wrong sum."""
    import cupy as cp
    import quant.cuda as qc
    W = qc.upload(_weight(GGMLType.Q4_K, 8, 256, 3))
    x = cp.ones((1, 256), cp.float32)
    with pytest.raises(AssertionError):
        qc.matmul(x, [W], [cp.zeros((1, 8), cp.float32)], prologue=("silu", x))


@pytest.mark.parametrize("pro", [None, "rmsnorm", "silu", "gelu"])
def test_prompt_activations_fp16(pro):
    """f16_act: the prompt GEMM's operand is x after the prologue, each value rounded to
    the nearest fp16 once (no prologue: exactly numpy's float16 of x)."""
    import cupy as cp
    import quant.cuda as qc
    n, K = 5, 1312                        # not a multiple of 256: a partial last group
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((n, K)) * 3).astype(np.float32)
    x64 = x.astype(np.float64)
    w = rng.standard_normal(K).astype(np.float32)
    u = rng.standard_normal((n, K)).astype(np.float32)
    if pro is None:
        ref, prologue = x64, None
    elif pro == "rmsnorm":
        ref, prologue = x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-6) * w, ("rmsnorm", cp.asarray(w), 1e-6)
    elif pro == "silu":
        ref, prologue = x64 / (1 + np.exp(-x64)) * u, ("silu", cp.asarray(u))
    else:
        ref = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3))) * u
        prologue = ("gelu", cp.asarray(u))
    y = qc.f16_activations(cp.asarray(x), prologue, cp.full(n * K, np.nan, cp.float16))
    got = y.get().reshape(n, K)
    if pro is None:
        assert np.array_equal(got, x.astype(np.float16))
    else:       # the float32 prologue's last bits, then one fp16 rounding (2^-11 relative)
        assert np.all(np.abs(got.astype(np.float64) - ref) <= 5e-4 * np.abs(ref) + 1e-6)


INT8_TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
              GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.MXFP4]


def _block(qtype):
    return 256 if qtype in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 32


def _cpu_q8(x, block):
    """The CPU backend's activation rounding (quant/act_quant.py): codes, steps."""
    from quant import act_quant
    n, K = x.shape
    xq = np.zeros((n, K), np.int16)
    xd = np.zeros((n, K // block), np.float32)
    extra = np.zeros((n, K // 32), np.int32 if block == 256 else np.float32)
    (act_quant.quantize_q8_256 if block == 256 else act_quant.quantize_q8_32)(x, xq, xd, extra)
    return xq, xd


def _dequant_x(xq, xd, block):
    n, K = xq.shape
    return (xq.reshape(n, K // block, block).astype(np.float64) * xd[..., None]).reshape(n, K)


@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("pro", [None, "rmsnorm", "silu"])
def test_int8_activations_are_the_cpu_backends(block, pro):
    """q8_act rounds x as the CPU backend does: the same int8 codes and steps (bit for bit
    when x is the same), and xd * sum of codes per 16."""
    import cupy as cp
    import quant.cuda as qc
    K = 1280 if block == 256 else 576
    rng = np.random.default_rng(block)
    x = (rng.standard_normal((3, K)) * 3).astype(np.float32)
    x[1, :block] = 0.0                         # an all-zero block: step 0, codes 0
    prologue = None
    if pro == "rmsnorm":
        w = rng.standard_normal(K).astype(np.float32)
        prologue = ("rmsnorm", cp.asarray(w), 1e-6)
    elif pro == "silu":
        u = rng.standard_normal((3, K)).astype(np.float32)
        prologue = ("silu", cp.asarray(u))
    ws = qc.Workspace()
    xq, xd, xs = qc.quantize_act(cp.asarray(x), block, ws, prologue)
    xq, xd, xs = xq.get().reshape(3, K), xd.get().reshape(3, -1), xs.get().reshape(3, -1)
    if pro is None:
        h = x
    elif pro == "rmsnorm":       # the GPU's own float32 RMSNorm, as a second check of the codes
        h = (x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * w).astype(np.float32)
    else:
        h = (x / (1 + np.exp(-x.astype(np.float64))) * u).astype(np.float32)
    rq, rd = _cpu_q8(h, block)
    if pro is None:
        assert np.array_equal(xq, rq) and np.array_equal(xd, rd)
    else:                         # h differs from the GPU's in the last bits: a code may move by one
        assert np.abs(xq.astype(int) - rq).max() <= 1 and np.mean(xq != rq) < 1e-2
        assert np.allclose(xd, rd, rtol=1e-5, atol=0)
    sums = xq.astype(np.int64).reshape(3, K // 16, 16).sum(-1)
    assert np.allclose(xs, np.repeat(xd, block // 16, axis=1) * sums, rtol=1e-6, atol=1e-30)


def _int8_K(qtype):
    # chunks of 1024 weights.  K-quants: 1.25, 1.5 (Q6_K rows of 1260 bytes: not 16-byte
    # aligned) and 4.25 chunks.  Legacy: 0.75 (576: SmolLM2's width, not a multiple of 256),
    # 3.03 chunks; MXFP4 also gpt-oss's 2880 (17-byte blocks: rows at any byte alignment)
    if qtype == GGMLType.MXFP4:
        return (768, 576, 3104, 2880)
    return (1280, 1536, 4352) if _block(qtype) == 256 else (768, 576, 3104)


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_int8_matvec_path(qtype, n):
    """The integer decode path: y = (x rounded as the CPU backend rounds it) @ W.T to
    float32 accuracy; q/k/v-style multi-weight launch with biases, the residual
    accumulate, 1-8 rows of x (4, 2 and 1 rows a warp) and partial warps of rows."""
    import cupy as cp
    import quant.cuda as qc
    assert qc.INT8_MATVEC
    block = _block(qtype)
    for K in _int8_K(qtype):
        qts = [_weight(qtype, M, K, 20 + i) for i, M in enumerate((77, 32))]
        Ws = [qc.upload(q) for q in qts]
        rng = np.random.default_rng(n)
        x = rng.standard_normal((n, K)).astype(np.float32)
        biases = [rng.standard_normal(q.shape[0]).astype(np.float32) for q in qts]
        xr = _dequant_x(*_cpu_q8(x, block), block)
        outs = [cp.full((n, q.shape[0]), np.nan, cp.float32) for q in qts]
        qc.matmul(cp.asarray(x), Ws, outs, [cp.asarray(b) for b in biases])
        for q, o, b in zip(qts, outs, biases):
            wd = quant.dequantize(q).astype(np.float64)
            got = o.get()
            assert _rel(got, xr @ wd.T + b) < 1e-5, (qtype.name, n, K)
            assert _rel(got, x.astype(np.float64) @ wd.T + b) < 2e-2
        acc0 = np.ones((n, 77), np.float32)
        acc = cp.asarray(acc0)
        qc.matmul(cp.asarray(x), Ws[:1], [acc], accumulate=True)
        wd = quant.dequantize(qts[0]).astype(np.float64)
        assert _rel(acc.get(), acc0 + xr @ wd.T) < 1e-5


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_0, GGMLType.Q8_0],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("pro", ["rmsnorm", "silu", "gelu"])
def test_int8_matvec_prologues(qtype, pro):
    """RMSNorm / SwiGLU / GeGLU folded into the integer path's activation rounding."""
    import cupy as cp
    import quant.cuda as qc
    n, K = 2, _int8_K(qtype)[0]
    qt = _weight(qtype, 66, K, 11)
    W = qc.upload(qt)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, K)).astype(np.float32) * 2
    x64 = x.astype(np.float64)
    if pro == "rmsnorm":
        w = rng.standard_normal(K).astype(np.float32)
        h = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
        prologue = ("rmsnorm", cp.asarray(w), 1e-6)
    else:
        u = rng.standard_normal((n, K)).astype(np.float32)
        if pro == "silu":
            h = x64 / (1 + np.exp(-x64)) * u
        else:
            h = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3))) * u
        prologue = (pro, cp.asarray(u))
    block = _block(qtype)
    hr = _dequant_x(*_cpu_q8(h.astype(np.float32), block), block)
    wd = quant.dequantize(qt).astype(np.float64)
    y = cp.full((n, 66), np.nan, cp.float32)
    assert qc.int8_applies(n, [W])
    qc.matmul(cp.asarray(x), [W], [y], prologue=prologue)
    assert _rel(y.get(), hr @ wd.T) < 1e-3
    assert _rel(y.get(), h @ wd.T) < 2e-2


def _q8_0_chunk_order(raw, xq, xd):
    """Q8_0 rows summed in chunk order (qint8.cuh mvs_chunk), emulated exactly: each
    block's product as mvs_dot makes it (every fmaf's exact value fits a float64, rounded
    once to float32), each 32-block chunk's butterfly with partners 1, 2, 4, 8, 16 apart,
    then a row's chunk sums in order from 0.  raw: uint8 [M, nb * 34]; xq int8 [n, K];
    xd float32 [n, nb].  Returns float32 [n, M]."""
    M, nb = raw.shape[0], raw.shape[1] // 34
    blk = raw.reshape(M, nb, 34)
    d = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)           # [M, nb]
    q = blk[..., 2:].view(np.int8).astype(np.int64)                                 # [M, nb, 32]
    x = xq.reshape(xq.shape[0], nb, 32).astype(np.int64)                            # [n, nb, 32]
    s0 = np.einsum("mbk,nbk->nmb", q[..., :16], x[..., :16]).astype(np.float64)
    s1 = np.einsum("mbk,nbk->nmb", q[..., 16:], x[..., 16:]).astype(np.float64)
    t0 = (d * s0).astype(np.float32).astype(np.float64)
    t = (d * s1 + t0).astype(np.float32).astype(np.float64)
    b = (t * xd.astype(np.float64)[:, None, :]).astype(np.float32)                   # [n, M, nb]
    nch = -(-nb // 32)
    v = np.zeros(b.shape[:2] + (nch * 32,), np.float32)
    v[..., :nb] = b
    v = v.reshape(b.shape[:2] + (nch, 32))
    lanes = np.arange(32)
    for o in (1, 2, 4, 8, 16):
        v = v + v[..., lanes ^ o]
    row = np.zeros(b.shape[:2], np.float32)
    for c in range(nch):
        row = row + v[..., c, 0]
    return row


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_int8_q8_0_chunk_order(n):
    """Q8_0's integer matvec sums in chunk order, bit for bit, whatever the rows of x (1-8)
    (mvs): the order the decode megakernel's bulk ring keeps, and
    speculative verify (several rows) against decode (one) needs.  K of 0.56 to 4.25
    chunks, a partial last warp of rows, biases and the residual accumulate."""
    import cupy as cp
    import quant.cuda as qc
    old = qc.INT8_KERNEL
    kernels = ["mvs"]
    try:
        for K in (576, 768, 4352):
            qt = _weight(GGMLType.Q8_0, 77, K, 60 + K)
            W = qc.upload(qt)
            raw = np.ascontiguousarray(qt.data).reshape(77, -1)
            rng = np.random.default_rng(n + K)
            x = rng.standard_normal((n, K)).astype(np.float32)
            bias = rng.standard_normal(77).astype(np.float32)
            xq, xd, _ = qc.quantize_act(cp.asarray(x), 32, qc.Workspace())
            want = _q8_0_chunk_order(raw, xq.get().reshape(n, K), xd.get().reshape(n, -1))
            for kern in kernels:
                qc.set_int8_kernel(kern)
                y = cp.full((n, 77), np.nan, cp.float32)
                qc.matmul(cp.asarray(x), [W], [y], [cp.asarray(bias)])
                assert np.array_equal(y.get(), want + bias), (kern, n, K, float(np.abs(y.get() - want - bias).max()))
                acc0 = rng.standard_normal((n, 77)).astype(np.float32)
                acc = cp.asarray(acc0)
                qc.matmul(cp.asarray(x), [W], [acc], accumulate=True)
                assert np.array_equal(acc.get(), acc0 + want), (kern, n, K)
    finally:
        qc.set_int8_kernel(old)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q4_0], ids=lambda t: t.name)
def test_int8_mvk(qtype):
    """mvk (weights straight into registers, persistent grid): float32 accuracy against
    x rounded as the CPU rounds it, and batch invariance: a row of x gives the same bits
    whatever the rows of x beside it (1-8), the rows a warp (1, 2, 4) and the grid size;
    q/k/v-style launches of three weights with biases, matrices of a partial last task,
    K of partial steps (1280, 1536, 4352; Q6_K rows 2- and 4-byte aligned; Q4_0: 768, 2304,
    4352, and 576, which mvk leaves to mvs), the residual accumulate."""
    import cupy as cp
    import quant.cuda as qc
    old = (qc.INT8_KERNEL, qc.MVK_ROWS, qc.MVK_BPS, qc.MVK_V, qc.MVK_ROWS6, set(qc.MVK_ON), qc.MVK_RULES)
    block = _block(qtype)
    Ks = (768, 2304, 4352, 576) if qtype == GGMLType.Q4_0 else _int8_K(qtype)
    try:
        qc.set_int8_kernel("mvk")
        qc.MVK_ON, qc.MVK_RULES = set(qc.MVK_TYPES), False     # every shape (the default keeps some on mvs)
        assert qc._mvk_applies(qtype, Ks[0])
        for K in Ks:
            Ms = (qc.INT8_SMALL_M + 37, 77, 33) if K == 4352 else (77, 45, 31)
            qts = [_weight(qtype, M, K, 60 + i) for i, M in enumerate(Ms)]
            Ws = [qc.upload(q) for q in qts]
            rng = np.random.default_rng(K)
            x = rng.standard_normal((8, K)).astype(np.float32)
            xg = cp.asarray(x)
            biases = [rng.standard_normal(M).astype(np.float32) for M in Ms]
            cfgs = ((2, 0, 0), (1, 0, 1), (4, 0, 0), (2, 1, 1), (1, 3, 0))
            if qtype == GGMLType.Q6_K:     # 4 rows a warp: far past its registers
                cfgs = ((1, 0, 1), (2, 0, 0), (1, 3, 1), (2, 1, 0))
            elif qtype == GGMLType.Q4_0:   # rows a warp 1, 2 (each compiled once), two grids each
                cfgs = ((2, 0, 0), (1, 0, 1), (2, 1, 0), (1, 3, 1))
            for v in ((0, 2) if qtype == GGMLType.Q4_K else (0,)):   # 4 or 2 lanes a Q4_K block (2: K >= MVK_WIDE_K)
                ref = None
                for R, bps, il in cfgs[:5 if v == 0 else 3]:
                    qc.MVK_ROWS, qc.MVK_ROWS6, qc.MVK_BPS, qc.MVK_V = R, R, bps, v | il
                    qc._bps.clear()             # modules are keyed on the settings
                    for n in (8, 1, 2, 3, 5):
                        outs = [cp.full((n, M), np.nan, cp.float32) for M in Ms]
                        qc.matmul(xg[:n], Ws, outs, [cp.asarray(b) for b in biases])
                        acc = cp.ones((n, Ms[1]), cp.float32)
                        qc.matmul(xg[:n], Ws[1:2], [acc], accumulate=True)
                        got = [o.get() for o in outs] + [acc.get()]
                        if ref is None:
                            ref = got
                            xr = _dequant_x(*_cpu_q8(x, block), block)
                            for q, o, b in zip(qts, got, biases):
                                wd = quant.dequantize(q).astype(np.float64)
                                assert _rel(o, xr @ wd.T + b) < 1e-5, (qtype.name, K)
                            wd = quant.dequantize(qts[1]).astype(np.float64)
                            assert _rel(got[-1], 1.0 + xr @ wd.T) < 1e-5
                        for a, b in zip(got, ref):
                            assert np.array_equal(a, b[:n]), (qtype.name, K, R, bps, n, float(np.abs(a - b[:n]).max()))
    finally:
        qc.set_int8_kernel(old[0])
        qc.MVK_ROWS, qc.MVK_BPS, qc.MVK_V, qc.MVK_ROWS6, qc.MVK_ON, qc.MVK_RULES = old[1:]
        qc._mods.by_type.clear()
        qc._bps.clear()


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q4_0, GGMLType.Q6_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_int8_weight_hints_same_bits(qtype):
    """The weight loads' cache hints (W_HINT: .L2::256B / .L2::128B prefetch size, L2
    evict_first) and mvk's L2 prefetch of its own weights ahead (W_PF, across tasks and
    weights: a grid of one block an SM so warps walk many tasks) change no bit of the
    result: mvk4k (Q4_K), mvkt (Q4_0, Q6_K with every type on), mvs (Q8_0); partial
    steps, a 3-weight launch with a partial last task.  Kernels compiled one at a time."""
    import cupy as cp
    import quant.cuda as qc
    old = (qc.INT8_KERNEL, set(qc.MVK_ON), qc.MVK_RULES, qc.MVK_BPS, qc.W_HINT, qc.W_PF, qc.COMPILE_LAZY)
    try:
        qc.COMPILE_LAZY = True
        qc.set_int8_kernel("mvk")
        qc.MVK_ON, qc.MVK_RULES = set(qc.MVK_TYPES), False
        K = 4352 if _block(qtype) == 256 else 2304
        Ms = (qc.INT8_SMALL_M + 37, 77, 33)
        Ws = [qc.upload(_weight(qtype, M, K, 80 + i)) for i, M in enumerate(Ms)]
        rng = np.random.default_rng(3)
        ns = (1, 3) if qtype == GGMLType.Q4_K else (1,)
        xs = {n: cp.asarray(rng.standard_normal((n, K)).astype(np.float32)) for n in ns}
        ref = None
        for hint, pf, bps in ((0, 0, 0), (4, 0, 0), (1, 4, 0), (0, 8, 1)):
            qc.set_weight_hints(hint, pf)
            qc.MVK_BPS = bps
            qc._bps.clear()
            got = []
            for n in ns:
                outs = [cp.full((n, M), np.nan, cp.float32) for M in Ms]
                qc.matmul(xs[n], Ws, outs)
                got += [o.get() for o in outs]
            if ref is None:
                ref = got
                assert all(np.all(np.isfinite(g)) for g in got)
            for a, b in zip(got, ref):
                assert np.array_equal(a, b), (qtype.name, hint, pf, bps, float(np.abs(a - b).max()))
    finally:
        qc.set_int8_kernel(old[0])
        qc.MVK_ON, qc.MVK_RULES, qc.MVK_BPS = old[1], old[2], old[3]
        qc.set_weight_hints(old[4], old[5])
        qc.COMPILE_LAZY = old[6]
        qc._mods.by_type.clear()
        qc._bps.clear()
