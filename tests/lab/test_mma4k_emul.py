"""The lab tensor-core kernels (tests/lab/mma4k.cu), emulated thread by thread on the CPU, take
the product's operations in its order (lab.mma4k_emul): the Q4_K ones equal an emulated mvk4k
bit for bit, the Q6_K ones an emulated mvs<IQ6_K> / mvkt<MQ6_K>, here with partial tiles of rows and outputs
and widths that leave part of the last step empty; another walk order does not."""
import pytest

from lab import mma4k_emul as emul


def test_lab_kernels_take_mvk4k_order():
    bad, dist = emul.check(M=8, K=1536, n=9, kernels=("i8", "w", "t2"), seed=5)
    assert bad == {"i8": 0, "w": 0, "t2": 0}
    assert dist < 1e-5          # mvk4k's emulation computes the product (float64 reference)


def test_a_warp_a_slot_keeps_the_order_over_two_tiles_and_a_partial_step():
    """mma4k_w (qmma.cuh, tests/lab/pending/mma-decode.diff): 24 outputs (a CTA's 16 and a
    partial one), 17 rows, K 2304 (9 blocks: slot 0's second step alone holds one)."""
    bad, _ = emul.check(M=24, K=2304, n=17, kernels=("w",), seed=3)
    assert bad == {"w": 0}


def test_the_check_sees_another_order(monkeypatch):
    monkeypatch.setattr(emul, "QORD", (0, 1, 2, 3, 4, 5, 6, 7))
    bad, _ = emul.check(M=8, K=1536, n=9, kernels=("i8",), seed=5)
    assert bad["i8"] > 0


def test_q6k_kernel_takes_mvs_order(monkeypatch):
    assert emul.check6(M=8, K=1280, n=9, seed=0)[0] == 0
    monkeypatch.setattr(emul, "SORD", (0, 1, 2, 3))
    assert emul.check6(M=8, K=1280, n=9, seed=0)[0] > 0


def test_q6k_warp_a_slot_keeps_mvs_order():
    """mma6k_s_w (qmma.cuh, tests/lab/pending/mma-decode.diff): a CTA's 16 outputs and a partial
    one, 17 rows, K 2304 (9 blocks: slot 0's third chunk alone holds one)."""
    assert emul.check6(M=24, K=2304, n=17, seed=2, order="mvs_w")[0] == 0


def test_q6k_kernel_takes_mvkt_order(monkeypatch):
    bad, dist = emul.check6(M=8, K=2304, n=9, seed=1, order="mvkt")
    assert bad == 0 and dist < 1e-5
    monkeypatch.setattr(emul, "QORD", (0, 1, 2, 3, 4, 5, 6, 7))
    assert emul.check6(M=8, K=2304, n=9, seed=1, order="mvkt")[0] > 0


@pytest.mark.parametrize("v", [0.1, 1e-30, -3.0e38])
def test_fmaf_rounds_once(v):
    a, b = emul.f32(1 + 2 ** -23), emul.f32(1 - 2 ** -23)
    # a * b = 1 - 2^-46: rounds to 1 alone; with c = -1 the single rounding keeps -2^-46
    assert emul.fmaf(a, b, emul.f32(-1)) == emul.f32(-(2.0 ** -46))
    assert emul.fmaf(emul.f32(v), emul.f32(1), emul.f32(0)) == emul.f32(v)
