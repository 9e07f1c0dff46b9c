"""The CPU backend's small kernels where they stand in for a NumPy routine: the same
float32 results, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.backend import cpu_kernels as K


@pytest.mark.parametrize("n", [1, 4])
def test_bias_adds_round_as_numpy(n):
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal((n, d)).astype(np.float32) * 30 for d in (896, 128, 128)]
    bs = [rng.standard_normal(x.shape[1]).astype(np.float32) for x in xs]
    want = [np.add(x, b) for x, b in zip(xs, bs)]
    one = xs[0].copy()
    K.add_bias(one, bs[0])
    assert np.array_equal(one, want[0])
    three = [x.copy() for x in xs]
    K.add_bias3(three[0], bs[0], three[1], bs[1], three[2], bs[2])
    for got, w in zip(three, want):
        assert np.array_equal(got, w)
