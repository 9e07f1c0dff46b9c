"""Greedy decoding's argmax on the device: the argmax_rows kernel against np.argmax (ties,
NaN, signed zeros, infinities, many rows), and on real models the ids of the decode graph
that takes the argmax on the device against np.argmax of the logits graph's rows, and
greedy generation's tokens with and without the seam, and with the old host path."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from gpu_env import model_files
from runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu

MODELS = model_files()


@pytest.fixture(scope="module")
def backend():
    from runtime.backend.cuda import CUDABackend
    return CUDABackend()


def _dev_argmax(be, x):
    cp = be.cp
    with be.stream:
        got = be._argmax(cp.asarray(x)).get()
    return got.astype(np.int64)


@pytest.mark.parametrize("n", [1, 31, 257, 4096, 4097, 32001, 151936, 262144])
def test_argmax_rows_equals_numpy(backend, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3, n)).astype(np.float32)
    x[1] = np.round(x[1])                       # many ties: the first maximum wins
    x[2, :] = -np.inf
    x[2, n // 2:] = 0.0                         # -0.0 and +0.0 tie
    x[2, n // 2::2] = -0.0
    for _ in range(3):                          # repeated launches: state reset by the kernel
        np.testing.assert_array_equal(_dev_argmax(backend, x), np.argmax(x, axis=-1))


def test_argmax_rows_special_values(backend):
    n = 10000
    cases = []
    a = np.zeros(n, np.float32); a[7] = np.nan; a[9000] = np.nan; a[3] = np.inf; cases.append(a)
    b = np.full(n, -np.inf, np.float32); cases.append(b)
    c = np.full(n, -1.0, np.float32); c[n - 1] = -0.5; cases.append(c)
    d = np.full(n, 3.0, np.float32); cases.append(d)
    e = np.full(n, -0.0, np.float32); e[5000] = 0.0; e[6000] = 1e-45; cases.append(e)
    f = np.full(n, np.float32(-3e38)); f[4242] = np.float32(-1e-45); cases.append(f)
    x = np.stack(cases)
    np.testing.assert_array_equal(_dev_argmax(backend, x), np.argmax(x, axis=-1))
    for row in x:
        np.testing.assert_array_equal(_dev_argmax(backend, row[None]), [np.argmax(row)])


@dataclass
class LogitsGreedy(SamplingParams):
    """Greedy, but the token loop takes the logits and np.argmax (the path before the seam)."""

    @property
    def argmax_only(self) -> bool:
        return False


@pytest.fixture(scope="module", params=MODELS or [None], ids=lambda p: p.name if p else "none")
def engine(request):
    if request.param is None:
        pytest.skip("no model files: set LLAMBA_GPU_TEST_MODELS or fetch the catalog models")
    from lab.synth import load_weights_only
    from runtime.engine import Engine
    lm = load_weights_only(request.param)
    return Engine(lm, device="cuda", n_ctx=512)


def test_device_argmax_equals_argmax_of_logits(engine):
    """Each decode step twice from the same state: the logits graph, then the argmax graph
    (the same forward, captured apart): ids == np.argmax(logits) at every step, across
    graph widths (a 120-token walk), and for an eager multi-token step."""
    eng = engine
    be = eng.backend
    rng = np.random.default_rng(5)
    seq = eng.new_sequence()
    try:
        eng.prefill(seq, rng.integers(1, eng.config.vocab_size, 9).tolist())
        t = 1
        r0 = be.graph_replays
        for _ in range(120):
            n = len(seq)
            logits = eng.step([seq], [[t]])
            eng.cache.truncate(seq, n)
            ids = eng.step([seq], [[t]], argmax=True)
            assert ids.tolist() == [int(np.argmax(logits[0]))]
            t = int(ids[0])
        assert be.graph_replays - r0 >= 2 * 110
        assert any(k[-1] == "ids" for k in be._graphs) and any(k[-1] == "logits" for k in be._graphs)
        n = len(seq)
        logits = eng.step([seq], [[3, 4, 5]], all_logits=True)
        eng.cache.truncate(seq, n)
        np.testing.assert_array_equal(eng.step([seq], [[3, 4, 5]], all_logits=True, argmax=True),
                                      np.argmax(logits, axis=-1))
    finally:
        eng.release(seq)


def _greedy_ids(eng, params, prompt, n):
    from runtime.generate import _plain_tokens
    from runtime.sampling import Sampler
    seq = eng.new_sequence()
    history = list(prompt)
    out = []
    try:
        for t in _plain_tokens(eng, seq, eng.prefill(seq, prompt), history, Sampler(params)):
            out.append(t)
            history.append(t)
            if len(out) == n:
                return out
    finally:
        eng.release(seq)


def test_greedy_generation_identical_with_and_without_seam(engine):
    """Generation's token loop, 48 greedy tokens: the argmax seam (argmax on the device)
    and the logits path with np.argmax give the same ids."""
    eng = engine
    be = eng.backend
    prompt = np.random.default_rng(7).integers(1, eng.config.vocab_size, 6).tolist()
    fast = _greedy_ids(eng, SamplingParams(temperature=0.0), prompt, 48)
    slow = _greedy_ids(eng, LogitsGreedy(temperature=0.0), prompt, 48)
    print(f"{eng.loaded.path.name}: greedy {fast[:8]}...")
    assert fast == slow
