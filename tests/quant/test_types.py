import numpy as np
import pytest

import quant
from quant import TYPE_INFO, GGMLType, QTensor, UnsupportedQuantType

gguf = pytest.importorskip("gguf")


def test_ids_and_block_sizes_agree_with_gguf():
    for t in gguf.GGMLQuantizationType:
        assert GGMLType[t.name] == t.value
        # gguf-py still lists Q8_1 as 40 bytes (float d, s); ggml's block_q8_1 is
        # two halves + 32 int8 = 36 since 2024, which is what BLOCK_LAYOUT says.
        if GGMLType(t.value) in quant.BLOCK_LAYOUT and t.name != "Q8_1":
            assert quant.BLOCK_LAYOUT[GGMLType(t.value)] == gguf.GGML_QUANT_SIZES[t]
    assert len(TYPE_INFO) == 12
    for t, info in TYPE_INFO.items():
        assert info == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))]


def test_unsupported_type_error_names_type_and_tensor():
    with pytest.raises(UnsupportedQuantType) as e:
        QTensor("blk.3.ffn_down.weight", GGMLType.IQ2_XS, (4, 256), np.zeros(4 * 74, np.uint8))
    assert "IQ2_XS" in str(e.value) and "blk.3.ffn_down.weight" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(UnsupportedQuantType, match="tok.*unknown type id 99"):
        QTensor("tok", 99, (1, 32), np.zeros(18, np.uint8))


def test_qtensor_validates_size_and_is_read_only():
    buf = np.zeros(3 * 144 * 2, np.uint8)
    qt = QTensor.from_file_bytes("w", GGMLType.Q4_K, (3, 512), buf)
    assert (qt.rows, qt.cols, qt.nbytes, qt.data.shape) == (3, 512, buf.size, (3, 288))
    assert not qt.data.flags.writeable and np.shares_memory(qt.data, buf)
    with pytest.raises(ValueError, match="needs 864 bytes"):
        QTensor("w", GGMLType.Q4_K, (3, 512), buf[:-1])
    with pytest.raises(ValueError, match="multiple|whole number"):
        QTensor("w", GGMLType.Q4_0, (3, 48), np.zeros(100, np.uint8))
    norm = QTensor("n", GGMLType.F32, (8,), np.arange(8, dtype=np.float32))
    assert norm.rows == 1 and norm.cols == 8
    np.testing.assert_array_equal(quant.dequantize(norm), np.arange(8, dtype=np.float32))
