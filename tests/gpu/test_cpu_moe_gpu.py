"""--cpu-moe / --n-cpu-moe N on the GPU (backend/cuda_host_moe.py): the experts of every
layer, or of the first 2 of 4, stay in system memory and run on the CPU (the router's
logits computed on the GPU, the experts by the CPU backend's kernels, the sum added on
the GPU), against the all-GPU engine and the CPU backend on random-weight Qwen3-MoE
models (tests/lab/synth.py): greedy tokens and logits within test_moe_gpu.py's bounds,
the memory on each device, decode steps captured as graphs with the CPU's work as host
functions (the bits of the steps that wait for it), batch invariance, and --gpu-layers
beside it."""
from __future__ import annotations

import numpy as np
import pytest

from test_models import _float_cpu_backend, _greedy, _rel
from test_moe_gpu import NEAR_TIE, SHAPE, _margin, assert_greedy_close
from test_verify_invariance_gpu import _verify_and_singles

pytestmark = pytest.mark.gpu

LAYERS = 4
CPU_MOE = {"all": -1, "first2": 2}      # --cpu-moe, --n-cpu-moe 2


@pytest.fixture(scope="module", params=["F16", "Q4_K_M"])
def engines(request, tmp_path_factory):
    """(mix, model, all-GPU engine, CPU reference, {"all": --cpu-moe, "first2": --n-cpu-moe 2})."""
    from lab.synth import load_weights_only, write_random_gguf
    from runtime.engine import Engine
    mix = request.param
    p = write_random_gguf(tmp_path_factory.mktemp("cpumoe") / f"qwen3moe-{mix}.gguf", mix=mix, seed=11,
                          **dict(SHAPE, n_layers=LAYERS))
    lm = load_weights_only(p)
    ref = Engine(lm, device="cpu", n_ctx=1024)
    if mix == "F16":     # float32 activations on both sides, as test_moe_gpu's
        ref.backend.__class__ = _float_cpu_backend()
    hybrid = {k: Engine(lm, device="cuda", n_ctx=1024, cpu_moe=v) for k, v in CPU_MOE.items()}
    return mix, lm, Engine(lm, device="cuda", n_ctx=1024), ref, hybrid


def _expert_bytes(lm, layers):
    return sum(t.nbytes for n, t in lm.tensors.items()
               if n.endswith("_exps.weight") and int(n.split(".")[1]) in layers)


def test_experts_stay_in_system_memory(engines):
    from runtime.backend.cpu import _Experts
    _, lm, gpu, _, hybrid = engines
    for key, layers in (("all", range(LAYERS)), ("first2", range(2))):
        be = hybrid[key].backend
        host = be.host_experts
        assert host.layers == set(layers) and host.weight_bytes == _expert_bytes(lm, layers)
        # what the GPU holds is the all-GPU engine's less those experts (each padded to 256 bytes there)
        assert gpu.backend.weight_bytes - be.weight_bytes >= host.weight_bytes
        assert be.estimate["host_weights"] == host.weight_bytes
        assert be.estimate["weights"] < gpu.backend.estimate["weights"]
        # the model's expert lists: the CPU backend's (memory-mapped blocks) where the rule says
        for i, layer in enumerate(hybrid[key].model.layers):
            on_host = isinstance(layer["ffn_up_exps"], _Experts)
            assert on_host == (i in layers), (key, i)
        assert be.use_graphs and "experts of" in be.device_name
        assert be.memory_report()["host_weights_bytes"] == host.weight_bytes


def _compare(mix, toks, logits, want, want_logits, what):
    errs = [_rel(g, r) for g, r in zip(logits, want_logits)]
    print(f"{mix} {what}: greedy {toks[:8]}..., logits rel err max {max(errs):.2e} median {np.median(errs):.2e}")
    if mix == "F16":
        assert toks == want and max(errs) < 1e-3, what
        return
    assert_greedy_close(toks, want, errs, want_logits, what)


@pytest.mark.parametrize("key", list(CPU_MOE))
def test_greedy_tokens_and_logits_match(engines, key):
    """An 8-token prompt and 16 greedy tokens: as the all-GPU engine's and the CPU's."""
    mix, lm, gpu, ref, hybrid = engines
    ids = np.random.default_rng(4).integers(1, lm.config.vocab_size, 8).tolist()
    toks, logits = _greedy(hybrid[key], ids, 16)
    for other, name in ((gpu, "all-GPU"), (ref, "CPU")):
        want, want_logits = _greedy(other, ids, 16)
        _compare(mix, toks, logits, want, want_logits, f"--cpu-moe {key} vs {name}")


@pytest.mark.parametrize("key", list(CPU_MOE))
def test_prompt_logits_match(engines, key):
    """Prompts of 100 and 600 tokens (a chunk of 512 and one of 88: the host buffers grow
    and are reused): last-token logits as the all-GPU engine's and the CPU's."""
    mix, lm, gpu, ref, hybrid = engines
    for n in (100, 600):
        ids = np.random.default_rng(n).integers(1, lm.config.vocab_size, n).tolist()
        got = _prefill(hybrid[key], ids)
        for other, name in ((gpu, "all-GPU"), (ref, "CPU")):
            want = _prefill(other, ids)
            err = _rel(got, want)
            print(f"{mix} --cpu-moe {key} vs {name}: prefill-{n} logits rel err {err:.2e}")
            assert err < 5e-2
            assert int(np.argmax(got)) == int(np.argmax(want)) or _margin(want) < NEAR_TIE


def _prefill(eng, ids):
    s = eng.new_sequence()
    try:
        return eng.prefill(s, ids)
    finally:
        eng.release(s, keep_cached=False)


def test_decode_steps_replay_graphs_with_the_waiting_paths_bits(engines):
    """Where the fused kernels take the experts (Q4_K_M), a step queues the CPU's work as a
    host function (moe_host_fn.py) and waits for nothing: decode steps replay CUDA graphs,
    with the logits of steps that copy down, wait and run CPUBackend.moe_routed, bit for
    bit.  F16 experts take the waiting path: eager steps."""
    mix, lm, _, _, hybrid = engines
    eng = hybrid["all"]
    be, host = eng.backend, eng.backend.host_experts
    layer = eng.model.layers[0]
    kinds = host._node_kinds([layer["ffn_gate_exps"], layer["ffn_up_exps"], layer["ffn_down_exps"]])
    assert (kinds is None) == (mix == "F16")
    ids = np.random.default_rng(5).integers(1, lm.config.vocab_size, 9).tolist()
    r0 = be.graph_replays
    toks, got = _greedy(eng, ids, 10)
    if kinds is None:
        assert be.graph_replays == r0
        return
    assert be.graph_replays - r0 >= 8
    host._node_kinds = lambda experts: None         # every step waits for the host
    be.invalidate_plans()           # (the graphs captured above hold host functions)
    try:
        r0 = be.graph_replays
        _, want = _greedy(eng, ids, 10, forced=toks)
        assert be.graph_replays == r0
    finally:
        del host._node_kinds
        be.invalidate_plans()
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), (i, float(np.abs(np.asarray(a) - b).max()))


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_verify_rows_equal_single_steps(engines, rows):
    _, _, _, _, hybrid = engines
    batched, single = _verify_and_singles(hybrid["first2"], 40, rows, rows)
    assert np.array_equal(batched, single), float(np.abs(batched - single).max())


def test_batched_decode_equals_each_sequence_alone(engines):
    _, lm, _, _, hybrid = engines
    eng = hybrid["all"]
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, lm.config.vocab_size, n).tolist() for n in (12, 30, 5, 21)]

    def start(p):
        s = eng.new_sequence()
        return s, int(np.argmax(eng.prefill(s, p)))

    alone = []
    for p in prompts:
        s, t = start(p)
        rows = []
        for _ in range(5):
            rows.append(eng.step([s], [[t]])[0])
            t = int(np.argmax(rows[-1]))
        alone.append(rows)
        eng.release(s, keep_cached=False)
    started = [start(p) for p in prompts]
    seqs, last = [s for s, _ in started], [t for _, t in started]
    for i in range(5):
        out = eng.step(seqs, [[t] for t in last])
        for b in range(len(seqs)):
            assert np.array_equal(out[b], alone[b][i]), f"sequence {b}, step {i}"
        last = [int(np.argmax(r)) for r in out]
    for s in seqs:
        eng.release(s, keep_cached=False)


def test_with_gpu_layers(engines):
    """-ngl 2 --n-cpu-moe 1: layer 0's experts on the CPU beside its GPU attention, layer
    1 whole on the GPU, layers 2-3 whole on the CPU; the logits as the CPU's."""
    from runtime.backend.cpu import _Experts
    from runtime.engine import Engine
    mix, lm, _, ref, _ = engines
    split = Engine(lm, device="cuda", n_ctx=1024, gpu_layers=2, cpu_moe=1)
    assert split.backend.name == "cuda+cpu"
    kinds = [isinstance(layer["ffn_up_exps"], _Experts) for layer in split.model.layers]
    assert kinds == [True, False, True, True]
    assert split.backend.gpu.host_experts.layers == {0}
    assert split.backend.estimate["host_weights"] > _expert_bytes(lm, [0, 2, 3])   # (+ attention of 2-3, embedding)
    ids = np.random.default_rng(5).integers(1, lm.config.vocab_size, 8).tolist()
    toks, logits = _greedy(split, ids, 8)
    want, want_logits = _greedy(ref, ids, 8)
    _compare(mix, toks, logits, want, want_logits, "-ngl 2 --n-cpu-moe 1 vs CPU")
