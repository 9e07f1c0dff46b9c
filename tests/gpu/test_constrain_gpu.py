"""Greedy under a constraint on the GPU: the mask goes up with the step and the argmax is taken
among the allowed tokens on the device, in a replayed decode graph and in an eager step of several
sequences; each token equals np.argmax of the same step's logits masked on the host."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_env import model_files

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", model_files()[:2], ids=lambda p: p.stem)
def test_masked_argmax_on_device(path):
    from lab.synth import load_weights_only
    from runtime.constrain import apply_mask, mask_words
    from runtime.engine import Engine
    eng = Engine(load_weights_only(path), device="cuda", n_ctx=256)
    V = eng.config.vocab_size
    rng = np.random.default_rng(7)
    a, b = eng.new_sequence(), eng.new_sequence()
    eng.prefill(a, [int(t) for t in rng.integers(1, V, 9)])
    eng.prefill(b, [int(t) for t in rng.integers(1, V, 5)])
    ta, tb = 1, 2
    calls = []
    for i in range(12):
        seqs = [a] if i % 2 == 0 else [a, b]          # one sequence: graph replays; two: eager
        toks = [[ta]] if len(seqs) == 1 else [[ta], [tb]]
        m = rng.integers(0, 1 << 32, (len(seqs), mask_words(V)), dtype=np.uint64).astype(np.uint32)
        m &= rng.integers(0, 1 << 32, m.shape, dtype=np.uint64).astype(np.uint32)   # about a quarter allowed
        n0 = [len(s) for s in seqs]
        want = np.argmax(apply_mask(eng.step(seqs, toks).copy(), m), axis=-1)
        for s, n in zip(seqs, n0):
            eng.cache.truncate(s, n)
        got = eng.step(seqs, toks, argmax=True, masks=lambda m=m: calls.append(1) or m)
        assert list(got) == list(want), (i, got, want)
        assert all((m[r, t >> 5] >> (t & 31)) & 1 for r, t in enumerate(got))
        ta = int(got[0])
        tb = int(got[-1])
    assert len(calls) == 12
    assert eng.backend.graph_replays > 0
