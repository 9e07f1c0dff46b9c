"""Models stored in F16 / BF16 (decoded by mvf, quant/cuda/qfloat.cuh) against the CPU
computing in float32: greedy tokens and every step's logits, decode replayed from CUDA
graphs; speculative verify rows equal one-token steps bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from test_models import _float_cpu_backend, _greedy, _rel
from test_verify_invariance_gpu import _verify_and_singles

pytestmark = pytest.mark.gpu

# a llama body and a qwen2 one (q/k/v biases), head dim 64; a vocabulary of 1000, as
# _verify_and_singles draws its tokens
SHAPES = {
    "llama": dict(arch="llama", n_layers=2, d_model=512, d_ff=1408, n_heads=8, n_kv_heads=2, vocab=1000,
                  tied=False, rope_theta=1e4),
    "qwen2": dict(arch="qwen2", n_layers=2, d_model=512, d_ff=1408, n_heads=8, n_kv_heads=2, vocab=1000,
                  tied=True, rope_theta=1e6),
}


@pytest.fixture(scope="module", params=[(s, m) for s in SHAPES for m in ("F16", "BF16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def engines(request, tmp_path_factory):
    from lab.synth import load_weights_only, write_random_gguf
    from runtime.engine import Engine
    shape, mix = request.param
    p = write_random_gguf(tmp_path_factory.mktemp("float") / f"{shape}-{mix}.gguf", mix=mix, seed=5,
                          **SHAPES[shape])
    lm = load_weights_only(p)
    assert lm.tensors["blk.0.ffn_gate.weight"].qtype.name == mix
    ref = Engine(lm, device="cpu", n_ctx=512)
    ref.backend.__class__ = _float_cpu_backend()
    return lm, Engine(lm, device="cuda", n_ctx=512), ref


def test_greedy_32_tokens_and_logits(engines):
    lm, gpu, ref = engines
    ids = np.random.default_rng(4).integers(1, lm.config.vocab_size, 8).tolist()
    toks, logits = _greedy(gpu, ids, 32)
    assert gpu.backend.graph_replays > 0
    want, ref_logits = _greedy(ref, ids, 32)
    errs = [_rel(g, r) for g, r in zip(logits, ref_logits)]
    print(f"{lm.path.name}: greedy {want[:8]}..., logits rel err vs float32 CPU max {max(errs):.2e}")
    assert toks == want
    assert max(errs) < 1e-4


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_verify_rows_equal_single_steps(engines, rows):
    _, gpu, _ = engines
    batched, single = _verify_and_singles(gpu, 40, rows, rows)
    assert np.array_equal(batched, single), float(np.abs(batched - single).max())
