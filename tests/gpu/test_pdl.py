"""Programmatic dependent launch (quant/cuda/pdl.py): the ctypes launch computes what
CuPy's does, and decode steps captured with it give the logits of steps captured
without it, bit for bit, on the real models (sm_90 and newer; skipped below)."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_env import model_files

pytestmark = pytest.mark.gpu

MODELS = model_files()


@pytest.fixture(scope="module")
def backend():
    from runtime.backend.cuda import CUDABackend
    be = CUDABackend()
    if be.device_info["cc"] < be._pdl.MIN_CC:
        pytest.skip(f"sm_{be.device_info['cc']}: no programmatic dependent launch")
    return be


def test_pdl_launch_equals_cupy_launch(backend):
    """add_inplace and rmsnorm through cuLaunchKernelEx (arrays, int32/int64/float32
    scalars, outside a capture) against the same kernels launched by CuPy."""
    be, cp, pdl = backend, backend.cp, backend._pdl
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 1000)).astype(np.float32)
    w = rng.standard_normal(1000).astype(np.float32)
    with be.stream:
        a, b, wd = cp.asarray(x), cp.asarray(x[::-1].copy()), cp.asarray(w)
        ref, got = a.copy(), a.copy()
        be._fn("add_inplace")(((a.size + 255) // 256,), (256,), (ref, b, np.int64(a.size)))
        pdl.launch(be._fn("add_inplace").fn, ((a.size + 255) // 256,), (256,), (got, b, np.int64(a.size)))
        n_ref, n_got = cp.empty_like(a), cp.empty_like(a)
        be._fn("rmsnorm")((3,), (256,), (ref, wd, np.float32(1e-6), n_ref, np.int32(1000)))
        with pdl.capturing(True):            # the wrapper's path, as in a capture
            be._fn("rmsnorm")((3,), (256,), (got, wd, np.float32(1e-6), n_got, np.int32(1000)))
        be.stream.synchronize()
    np.testing.assert_array_equal(got.get(), x + x[::-1])
    np.testing.assert_array_equal(got.get(), ref.get())
    np.testing.assert_array_equal(n_got.get(), n_ref.get())


@pytest.fixture(scope="module", params=MODELS or [None], ids=lambda p: p.name if p else "none")
def engine(request, backend):
    if request.param is None:
        pytest.skip("no model files: set LLAMBA_GPU_TEST_MODELS or fetch the catalog models")
    from lab.synth import load_weights_only
    from runtime.engine import Engine
    return Engine(load_weights_only(request.param), device="cuda", n_ctx=512)


def _walk(eng, prompt, n):
    """Logits of n greedy decode steps after the prompt (graph-replayed steps)."""
    seq = eng.new_sequence()
    out = []
    try:
        eng.prefill(seq, prompt)
        t = 1
        for _ in range(n):
            logits = eng.step([seq], [[t]])
            out.append(logits[0].copy())
            t = int(np.argmax(logits[0]))
    finally:
        eng.release(seq, keep_cached=False)     # a prefix reused would change the prefill's shape
    return np.stack(out)


def test_pdl_graphs_equal_plain_graphs(engine):
    """40 decode steps replayed from graphs captured without PDL launches, with them, and
    without again (a race that left wrong K/V behind would show in the third): the same
    logits at every step, across more than one graph width."""
    eng = engine
    be = eng.backend
    prompt = np.random.default_rng(3).integers(1, eng.config.vocab_size, 30).tolist()
    saved = be.use_pdl
    walks = []
    try:
        for use in (False, True, False):
            be._graphs.clear()
            be.use_pdl = use
            r0 = be.graph_replays
            walks.append(_walk(eng, prompt, 40))
            assert be.graph_replays - r0 >= 30
    finally:
        be.use_pdl = saved
        be._graphs.clear()
    plain, with_pdl, plain2 = walks
    np.testing.assert_array_equal(plain2, plain)
    bad = [i for i in range(len(plain)) if not np.array_equal(with_pdl[i], plain[i])]
    assert not bad, f"steps {bad} differ"
