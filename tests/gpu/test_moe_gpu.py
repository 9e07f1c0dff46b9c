"""Mixture of experts (qwen3moe) on the GPU: the CUDA backend's `moe` op against the CPU's
on random-weight models (tests/lab/synth.py), and its batch invariance: speculative
verify rows equal one-token steps, sequences decoding together equal each alone, bit
for bit, though their tokens share experts.  Decode steps of integer experts route on
the device and replay CUDA graphs; F16 experts (no id-indexed kernel) route on the host
and run eagerly (test_moe_device_gpu.py compares the two paths)."""
from __future__ import annotations

import numpy as np
import pytest

from checkpoints.ckpt_helpers import assert_batch_invariant
from test_models import _float_cpu_backend, _greedy, _rel
from test_verify_invariance_gpu import _verify_and_singles

pytestmark = pytest.mark.gpu

# Qwen3-30B-A3B's layer shape scaled down: 16 experts of 256, 4 a token; head dim 64
SHAPE = dict(arch="qwen3moe", n_layers=2, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2, vocab=1000,
             tied=False, rope_theta=1e6, n_experts=16, n_experts_used=4, d_ff_expert=256)


@pytest.fixture(scope="module", params=["F16", "Q4_K_M", "Q8_0", "MXFP4_MOE"])
def engines(request, tmp_path_factory):
    from lab.synth import load_weights_only, write_random_gguf
    from runtime.engine import Engine
    mix = request.param
    p = write_random_gguf(tmp_path_factory.mktemp("moe") / f"qwen3moe-{mix}.gguf", mix=mix, seed=7, **SHAPE)
    lm = load_weights_only(p)
    assert lm.config.n_experts == 16 and lm.config.n_experts_used == 4
    ref = Engine(lm, device="cpu", n_ctx=512)
    if mix == "F16":     # float32 activations on both sides (the GPU's matvec for F16 keeps them float)
        ref.backend.__class__ = _float_cpu_backend()
    return mix, lm, Engine(lm, device="cuda", n_ctx=512), ref


def test_greedy_tokens_and_logits_match_cpu(engines):
    mix, lm, gpu, ref = engines
    ids = np.random.default_rng(4).integers(1, lm.config.vocab_size, 8).tolist()
    toks, logits = _greedy(gpu, ids, 16)
    want, ref_logits = _greedy(ref, ids, 16)
    errs = [_rel(g, r) for g, r in zip(logits, ref_logits)]
    print(f"qwen3moe {mix}: greedy {toks[:8]}..., logits rel err vs CPU max {max(errs):.2e}")
    if mix == "F16" or not gpu.backend.moe_on_device:
        assert gpu.backend.graph_replays == 0      # routed on the host (float experts, or the default): eager
    else:
        assert gpu.backend.graph_replays > 0       # routed on the device: decode steps replayed
    if mix == "F16":
        assert toks == want and max(errs) < 1e-4
    else:
        assert_greedy_close(toks, want, errs, ref_logits)


# top-two logit gap under which 8-bit activation rounding may pick either answer (the
# logits of these random models spread ~0.5)
NEAR_TIE = 0.1


def _margin(logits):
    top = np.sort(np.asarray(logits, np.float64))[-2:]
    return float(top[1] - top[0])


def assert_greedy_close(toks, want, errs, ref_logits, what=""):
    """Greedy tokens toks against the reference's want, both from 8-bit activations rounded by
    different kernels: a token may part from the reference's only where the reference's own
    top two were near a tie; the logits' relative errors errs, compared while both fed the
    same tokens (after a parting the inputs differ), have a median under 5e-2."""
    same = len(toks)
    for i, (a, b) in enumerate(zip(toks, want)):
        if a != b:
            assert _margin(ref_logits[i]) < NEAR_TIE, f"{what} step {i}: {a} vs {b}"
            same = i + 1
            break
    assert float(np.median(errs[:same])) < 5e-2, what


def test_prefill_logits_match_cpu(engines):
    """A 100-token prompt: experts' runs of more than 8 rows take the fp16 GEMM path."""
    mix, lm, gpu, ref = engines
    ids = np.random.default_rng(1).integers(1, lm.config.vocab_size, 100).tolist()
    a, b = ref.new_sequence(), gpu.new_sequence()
    want, got = ref.prefill(a, ids), gpu.prefill(b, ids)
    err = _rel(got, want)
    print(f"qwen3moe {mix}: prefill-100 logits rel err {err:.2e}")
    assert err < 5e-2
    assert int(np.argmax(got)) == int(np.argmax(want)) or (mix != "F16" and _margin(want) < NEAR_TIE)
    ref.release(a)
    gpu.release(b)


@pytest.mark.parametrize("qtype,E,M,K,n,k", [("Q4_K", 128, 768, 2048, 100, 8), ("MXFP4", 32, 2880, 2880, 64, 4),
                                               ("Q6_K", 16, 256, 512, 40, 2), ("F16", 8, 64, 256, 12, 2)])
def test_matmul_experts_equals_each_experts_product(qtype, E, M, K, n, k):
    """A prompt's pairs laid out in chunks of experts (moe.ExpertChunks, cap 5: several
    chunks), one dequantization and one batched GEMM a chunk: each pair's row equals its
    token's fp16 activations times its expert's fp16 weights (float64 on the host), pad
    rows included (all written, finite).  Shapes: M30's gate, gpt-oss-20b's, small ones."""
    import cupy as cp
    import quant.cuda as qc
    from quant import GGMLType, QTensor
    from lab.synth import _Noise, random_weight
    from runtime.backend import moe
    from runtime.backend.cuda import CUDABackend
    t = GGMLType[qtype]
    be = CUDABackend()
    W = be.upload(QTensor("gate_exps", t, (E, M, K), random_weight(t, (E * M, K), _Noise(4))))
    cp.cuda.runtime.deviceSynchronize()
    rng = np.random.default_rng(E + M)
    logits = rng.standard_normal((n, E)).astype(np.float32)
    logits[:, 1] += 3                                  # a hot expert
    w, tokens, starts, pos = moe.plan(logits, k, True)
    ck = moe.ExpertChunks(starts, tokens, pos, 5)
    assert len(ck.chunks) > 1
    ck.experts_d = cp.asarray(ck.experts)
    x16 = rng.standard_normal((n, K)).astype(np.float16)
    xs16 = cp.asarray(x16[ck.src])
    y = cp.full((ck.rows, M), np.nan, cp.float32)
    qc.matmul_experts(xs16, W, ck, y, qc.Workspace())
    got = y.get()
    assert np.isfinite(got).all()
    for e in ck.experts:
        w16 = qc.dequantize_f16(W[e]).get().astype(np.float64)
        r = np.flatnonzero(ck.eid == e)
        want = x16[ck.src[r]].astype(np.float64) @ w16.T
        scale = np.abs(x16).max() * np.abs(w16).sum(axis=1).max()
        assert np.abs(got[r] - want).max() <= 1e-4 * scale, (qtype, int(e))


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_verify_rows_equal_single_steps(engines, rows):
    _, _, gpu, _ = engines
    batched, single = _verify_and_singles(gpu, 40, rows, rows)
    assert np.array_equal(batched, single), float(np.abs(batched - single).max())


def test_batched_decode_equals_each_sequence_alone(engines):
    _, lm, gpu, _ = engines
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, lm.config.vocab_size, n).tolist() for n in (12, 30, 5, 21)]
    n_steps = 5

    assert_batch_invariant(gpu, prompts, n_steps)
