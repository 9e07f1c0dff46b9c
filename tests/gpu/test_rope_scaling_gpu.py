"""YaRN and LongRoPE on the GPU against the CPU computing in float32: greedy tokens and
every step's logits, decode replayed from CUDA graphs.  YaRN's magnitude on cos and sin
(rope_mscale) goes through the fused RoPE + KV write (RoPE over the whole head); LongRoPE
on part of each head (as Phi-4-mini) through the plain RoPE kernel, the dims past
rope_dim left alone.  (The models' agreement with transformers is checked on the CPU:
tests/checkpoints/test_rope_scaling.py.)"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from test_models import _float_cpu_backend, _greedy, _rel

pytestmark = pytest.mark.gpu

_SHAPE = dict(n_layers=2, d_model=512, d_ff=1408, n_heads=8, n_kv_heads=2, vocab=1000, tied=False)


def _variant(name):
    from models.config import YarnScaling, longrope_mscale, yarn_mscale
    if name == "yarn":          # llama (GPT-J pairs), RoPE over the whole head of 64
        return "llama", dict(rope_yarn=YarnScaling(8.0, 64), rope_mscale=yarn_mscale(8.0))
    rng = np.random.default_rng(3)  # qwen2 (NeoX halves), RoPE on 32 of 64 dims, the long factors
    return "qwen2", dict(rope_dim=32, rope_factors_short=(1 + rng.random(16)).astype(np.float32),
                         rope_factors_long=(1 + 30 * rng.random(16)).astype(np.float32),
                         rope_original_context=64, rope_mscale=longrope_mscale(64.0, 64))


@pytest.fixture(scope="module", params=["yarn", "longrope-partial"])
def engines(request, tmp_path_factory):
    from lab.synth import load_weights_only, write_random_gguf
    from runtime.engine import Engine
    arch, changes = _variant(request.param)
    p = write_random_gguf(tmp_path_factory.mktemp("rope") / f"{request.param}.gguf", arch=arch, mix="F16",
                          seed=5, rope_theta=1e4, **_SHAPE)
    lm = load_weights_only(p)
    lm = dataclasses.replace(lm, config=dataclasses.replace(lm.config, **changes))
    ref = Engine(lm, device="cpu", n_ctx=512)
    ref.backend.__class__ = _float_cpu_backend()
    gpu = Engine(lm, device="cuda", n_ctx=512)
    assert gpu.config.rope_mscale > 1.1
    if request.param != "yarn":
        assert gpu.config.rope_uses_long_factors          # 512 > the original 64
    return lm, gpu, ref


def test_greedy_tokens_and_logits(engines):
    lm, gpu, ref = engines
    ids = np.random.default_rng(4).integers(1, lm.config.vocab_size, 80).tolist()   # past the original 64
    toks, logits = _greedy(gpu, ids, 24)
    assert gpu.backend.graph_replays > 0
    want, ref_logits = _greedy(ref, ids, 24)
    errs = [_rel(g, r) for g, r in zip(logits, ref_logits)]
    print(f"{lm.path.name}: logits rel err vs float32 CPU max {max(errs):.2e}")
    assert toks == want
    # YaRN's and LongRoPE's magnitude (1.21 and 1.35 on q and k) sharpens every softmax, so the
    # GPU's keys, one fp16 rounding apart from the CPU's where it fuses a*c - b*s, weigh more than
    # in test_float_models (1e-4): measured 5.9e-4 and 7.3e-4, greedy tokens equal
    assert max(errs) < 2e-3
