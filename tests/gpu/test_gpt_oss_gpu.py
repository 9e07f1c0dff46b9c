"""gpt-oss on the GPU: the CUDA backend against the CPU backend on random-weight gpt-oss
models (tests/lab/synth.py: q/k/v/o and expert biases, attention sinks, a 16-token window
in every other layer, a biased router, the clamped SwiGLU), and the batch invariance the
engine relies on.  The tiny checkpoints' agreement with transformers is checked on the
CPU (tests/checkpoints/test_gpt_oss.py); here the GPU's kernels are held to the CPU's.

On the GPU machine: TESTS=tests/gpu/test_gpt_oss_gpu.py tests/gpu/device_run.sh tests"""
from __future__ import annotations

import numpy as np
import pytest

from checkpoints.ckpt_helpers import assert_batch_invariant
from test_models import _float_cpu_backend, _greedy, _rel
from test_moe_gpu import NEAR_TIE, _margin, assert_greedy_close
from test_verify_invariance_gpu import _verify_and_singles

pytestmark = pytest.mark.gpu

# gpt-oss-20b's layer kinds scaled down: 8 experts of 256, 2 a token, head dim 64, 8 query
# heads on 2 kv heads, windows of 16 in layers 0 and 2
SHAPE = dict(arch="gpt-oss", n_layers=4, d_model=256, d_ff=256, n_heads=8, n_kv_heads=2, vocab=1000, tied=False,
             rope_theta=150000.0, n_experts=8, n_experts_used=2, d_ff_expert=256, head_dim=64, sliding_window=16)


@pytest.fixture(scope="module", params=["F16", "Q8_0", "Q4_K_M", "MXFP4_MOE"])
def engines(request, tmp_path_factory):
    from lab.synth import load_weights_only, write_random_gguf
    from runtime.engine import Engine
    mix = request.param
    p = write_random_gguf(tmp_path_factory.mktemp("gptoss") / f"gpt-oss-{mix}.gguf", mix=mix, seed=11, **SHAPE)
    lm = load_weights_only(p)
    assert lm.config.arch == "gpt-oss" and lm.config.local_layers == (0, 2)
    ref = Engine(lm, device="cpu", n_ctx=512)
    if mix == "F16":     # float32 activations on both sides (the GPU's matvec for F16 keeps them float)
        ref.backend.__class__ = _float_cpu_backend()
    gpu = Engine(lm, device="cuda", n_ctx=512)
    assert gpu.windows == [16, 0, 16, 0]
    return mix, lm, gpu, ref


def test_greedy_tokens_and_logits_match_cpu(engines):
    """An 8-token prompt, then 24 greedy tokens: the context crosses the window."""
    mix, lm, gpu, ref = engines
    ids = np.random.default_rng(4).integers(1, lm.config.vocab_size, 8).tolist()
    toks, logits = _greedy(gpu, ids, 24)
    want, ref_logits = _greedy(ref, ids, 24)
    errs = [_rel(g, r) for g, r in zip(logits, ref_logits)]
    print(f"gpt-oss {mix}: greedy {toks[:8]}..., logits rel err vs CPU max {max(errs):.2e}")
    # integer experts route on the device: decode steps replay graphs; F16 experts (no
    # id-indexed float matvec) route on the host: eager steps
    assert (gpu.backend.graph_replays == 0) == (mix == "F16")
    if mix == "F16":
        assert toks == want and max(errs) < 1e-4
    else:
        assert_greedy_close(toks, want, errs, ref_logits)


def test_cpu_moe_matches_cpu(engines):
    """--cpu-moe: the experts and their biases in system memory, run by the CPU (as host
    functions in the decode graphs where the fused kernels take them: not F16): greedy
    tokens and logits as the CPU backend's."""
    from runtime.engine import Engine
    mix, lm, _, ref = engines
    if mix == "F16":
        pytest.skip("the float reference runs float activations; the experts here the CPU's own")
    hyb = Engine(lm, device="cuda", n_ctx=512, cpu_moe=-1)
    ids = np.random.default_rng(7).integers(1, lm.config.vocab_size, 8).tolist()
    toks, logits = _greedy(hyb, ids, 16)
    want, ref_logits = _greedy(ref, ids, 16)
    assert hyb.backend.graph_replays > 0
    errs = [_rel(g, r) for g, r in zip(logits, ref_logits)]
    print(f"gpt-oss {mix} --cpu-moe: logits rel err vs CPU max {max(errs):.2e}")
    assert_greedy_close(toks, want, errs, ref_logits)


@pytest.mark.parametrize("n", [12, 100])
def test_prompt_logits_match_cpu(engines, n):
    """A prompt of 12 tokens (the decode kernels) and of 100 (the prompt kernels: tiled
    attention with its sinks, experts' runs on the fp16 GEMMs), beyond the window."""
    mix, lm, gpu, ref = engines
    ids = np.random.default_rng(n).integers(1, lm.config.vocab_size, n).tolist()
    a, b = ref.new_sequence(), gpu.new_sequence()
    want, got = ref.prefill(a, ids), gpu.prefill(b, ids)
    err = _rel(got, want)
    print(f"gpt-oss {mix}: prompt-{n} logits rel err {err:.2e}")
    assert err < (1e-3 if mix == "F16" and n <= 16 else 5e-2)
    assert int(np.argmax(got)) == int(np.argmax(want)) or _margin(want) < NEAR_TIE
    ref.release(a)
    gpu.release(b)


def test_sinks_reach_the_gpu_kernels(engines):
    """The same model without its sinks (a very negative logit: no weight) changes the
    logits on the GPU as it does on the CPU: the kernels do not drop them.  (How much
    the sinks matter depends on the random weights: 0.13% of the logits for the Q4_K_M
    draw, 18-35% for the others, on the CPU as on the GPU.)"""
    mix, lm, gpu, ref = engines
    ids = np.random.default_rng(2).integers(1, lm.config.vocab_size, 40).tolist()

    def with_and_without(eng):
        s = eng.new_sequence()
        w = eng.prefill(s, ids)
        eng.release(s, keep_cached=False)
        saved = [L["attn_sinks"].copy() for L in eng.model.layers]
        try:
            for L in eng.model.layers:
                L["attn_sinks"][:] = -1e30
            s = eng.new_sequence()
            wo = eng.prefill(s, ids)
            eng.release(s, keep_cached=False)
        finally:
            for L, v in zip(eng.model.layers, saved):
                L["attn_sinks"][:] = v
        return w, wo

    gw, gwo = with_and_without(gpu)
    cw, cwo = with_and_without(ref)
    effect_gpu, effect_cpu = _rel(gwo, gw), _rel(cwo, cw)
    print(f"gpt-oss {mix}: the sinks change the logits by {effect_gpu:.2e} on the GPU, {effect_cpu:.2e} on the CPU")
    assert _rel(gwo, cwo) < 5e-2                        # without sinks the GPU still agrees with the CPU
    assert 0.5 * effect_cpu < effect_gpu < 2 * effect_cpu + 5e-3


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


def test_split_backend_matches_cpu(engines):
    """--gpu-layers 2: layers 0-1 (a windowed one and a full one) on the GPU, 2-3 on the CPU."""
    from runtime.engine import Engine
    mix, lm, _, ref = engines
    split = Engine(lm, device="cuda", gpu_layers=2, n_ctx=256)
    ids = np.random.default_rng(6).integers(1, lm.config.vocab_size, 30).tolist()
    a, b = ref.new_sequence(), split.new_sequence()
    want, got = ref.prefill(a, ids), split.prefill(b, ids)
    ref.release(a)
    # the GPU layers' int8 activations against the CPU's (measured: Q8_0 5.3e-2, the others less)
    assert _rel(got, want) < 8e-2
    assert int(np.argmax(got)) == int(np.argmax(want)) or _margin(want) < NEAR_TIE


def test_cpu_moe_matches_cpu(engines):
    """--n-cpu-moe 2: layers 0-1's experts and their biases in system memory, run by the
    CPU backend on the router logits (with the router's bias) the GPU computed."""
    from runtime.engine import Engine
    mix, lm, _, ref = engines
    eng = Engine(lm, device="cuda", cpu_moe=2, n_ctx=256)
    assert isinstance(eng.model.layers[0]["ffn_gate_exps.bias"], np.ndarray)       # on the host
    assert not isinstance(eng.model.layers[2]["ffn_gate_exps.bias"], np.ndarray)   # on the GPU
    ids = np.random.default_rng(8).integers(1, lm.config.vocab_size, 30).tolist()
    a, b = ref.new_sequence(), eng.new_sequence()
    want, got = ref.prefill(a, ids), eng.prefill(b, ids)
    ref.release(a)
    assert _rel(got, want) < 5e-2
