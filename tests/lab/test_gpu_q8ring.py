"""The Q8_0 ring kernel's host side (tests/lab/gpu_q8ring.py; the kernel itself needs an
sm_90 GPU and checks its own outputs against float64 before timing): its ops are the step's
matrices, its slots whole rows, its float64 reference the Q8_0 format's own arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

from quant import GGMLType, QTensor, dequantize
from lab.gpu_q8ring import _random_q8, _reference, q8_ops, slot_rows
from lab.gpu_stream import step_ops


def test_ops_are_the_steps_matrices():
    ops = q8_ops("L8")
    assert sum(r * k // 32 * 34 for r, k in ops) == sum(b for _, b, _ in step_ops("L8", "Q8_0", 128, attention=False))
    assert ops[:4] == [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def test_slots_hold_whole_rows_two_blocks_a_thread_at_most():
    assert slot_rows(4096, 16384) == 3 and slot_rows(14336, 16384) == 1   # 13056 and 15232 bytes
    assert slot_rows(4096, 32768) == 7 and slot_rows(14336, 32768) == 2   # 30464 and 30464 bytes
    for k in (4096, 14336):
        assert slot_rows(k, 16384) * k // 32 <= 512 and slot_rows(k, 32768) * k // 32 <= 1024
    with pytest.raises(ValueError):
        slot_rows(1536, 32768)                                  # rows would split warps


def test_reference_is_the_dequantized_matvec():
    rng = np.random.default_rng(1)
    blocks = _random_q8(rng, 5, 2048)
    xq = rng.integers(-127, 128, 2048, dtype=np.int8)
    xd = rng.uniform(0.5, 1, 64) / 128
    w = np.asarray(dequantize(QTensor("w", GGMLType.Q8_0, (5, 2048), blocks.reshape(5, -1))), np.float64)
    x = (xq.reshape(-1, 32).astype(np.float64) * xd[:, None]).reshape(-1)
    np.testing.assert_allclose(_reference(blocks, xq, xd), w @ x, rtol=1e-9)
