"""dequantize / dequantize_rows are bit-exact against gguf-py's reference."""
import numpy as np
import pytest

from quant import TYPE_INFO, GGMLType, QTensor, dequantize, dequantize_rows
from conftest import random_weight_bytes, real_tensors

gguf = pytest.importorskip("gguf")


def _ref(raw, qtype):
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))


def _same_bits(a, b):
    """Bit-identical, except that where both are NaN the payloads may differ
    (IEEE 754 leaves open which input's payload an operation propagates, and
    vectorized code may order operands differently from numpy)."""
    if a.shape != b.shape:
        return False
    same = a.view(np.uint32) == b.view(np.uint32)
    return bool(np.all(same | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("qtype", list(TYPE_INFO), ids=lambda t: t.name)
def test_random_blocks_bit_exact(qtype, rng):
    be = TYPE_INFO[qtype][0]
    K = 2 * max(be, 256)
    for finite in (True, False):   # also raw random bytes: inf/NaN scales, subnormals
        if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) and not finite:
            raw = rng.integers(0, 256, (7, K * TYPE_INFO[qtype][1]), dtype=np.uint8)
        else:
            raw = random_weight_bytes(rng, qtype, 7, K, finite)
        qt = QTensor("w", qtype, (7, K), raw)
        with np.errstate(all="ignore"):
            ref = _ref(raw, qtype)
        assert _same_bits(dequantize(qt), ref)
        rows = np.array([6, 0, 3, 3])
        assert _same_bits(dequantize_rows(qt, rows), ref[rows])


MODELS = ["SmolLM2-135M-Instruct-Q4_1.gguf", "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"]


@pytest.mark.parametrize("model", MODELS)
def test_real_blocks_bit_exact(model):
    types = set()
    for name, qtype, shape, raw in real_tensors(model):
        qt = QTensor(name, qtype, shape, raw)
        assert _same_bits(dequantize(qt), _ref(raw, qtype)), name
        types.add(qtype)
    assert GGMLType.Q8_0 in types


def test_dequantize_rows_bounds():
    qt = QTensor("emb", GGMLType.Q8_0, (4, 32), np.zeros((4, 34), np.uint8))
    with pytest.raises(IndexError):
        dequantize_rows(qt, [4])
    assert dequantize_rows(qt, []).shape == (0, 32)
