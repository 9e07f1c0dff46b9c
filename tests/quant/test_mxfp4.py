"""MXFP4 (ggml type 39, gpt-oss's experts): blocks of 32 E2M1 codes with one E8M0 exponent.

Dequantization is gguf-py's bit for bit on every code and every exponent byte (ggml reads
E8M0 255 as 2^127, not as NaN: so do we); matmuls follow the other 32-element formats
(test_matmul.py covers them, bounds included); here the gpt-oss shape's row tail, and a
GGUF file written by gguf-py with MXFP4 tensors (2-D and 3-D experts) loads through our
reader as memory-mapped blocks, and a truncated one is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from quant import GGMLType, QTensor, dequantize, dequantize_rows, matmul
from quant.matmul_cpu import BATCH_INVARIANT_MAX_ROWS
from quant.types import KVALUES_MXFP4

gguf = pytest.importorskip("gguf")


def _ref(raw):
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)


def _same_bits(a, b):
    return a.shape == b.shape and bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


def test_every_code_and_exponent_bit_exact():
    """256 blocks, one a exponent byte (0 and 1: subnormal scales; 255: 2^127), each
    holding all 16 codes in both nibbles."""
    raw = np.zeros((256, 17), np.uint8)
    raw[:, 0] = np.arange(256)
    codes = np.arange(16, dtype=np.uint8)
    raw[:, 1:] = codes | (codes[::-1] << 4)
    qt = QTensor("w", GGMLType.MXFP4, (8, 1024), raw.reshape(8, -1))
    ref = _ref(raw.reshape(8, -1))
    out = dequantize(qt)
    assert _same_bits(out, ref)
    assert _same_bits(dequantize_rows(qt, [7, 0, 3]), ref[[7, 0, 3]])
    # spot values: code c of the block with exponent e is kvalue[c] / 2 * 2^(e - 127)
    blocks = out.reshape(256, 32)
    assert blocks[127, 1] == 0.5 and blocks[127, 7] == 6.0 and blocks[127, 15] == -6.0
    assert blocks[0, 1] == np.float32(2.0 ** -128) and blocks[1, 2] == np.float32(2.0 ** -126)
    assert blocks[255, 1] == np.float32(2.0 ** 127) and np.isinf(blocks[255, 2])   # ggml: no NaN
    assert blocks[127, 8] == 0.0
    assert list(blocks[128, :16]) == list(np.array(KVALUES_MXFP4, np.float32))


def test_random_bytes_bit_exact(rng):
    raw = rng.integers(0, 256, (13, 90 * 17), dtype=np.uint8)
    assert _same_bits(dequantize(QTensor("w", GGMLType.MXFP4, (13, 2880), raw)), _ref(raw))


def _mx(rng, M, K, lo=116, hi=124):
    raw = rng.integers(0, 256, (M, K // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = rng.integers(lo, hi, (M, K // 32))
    return raw.reshape(M, -1)


def test_gpt_oss_width_decode_rows(rng):
    """d_model 2880 (90 blocks: the row kernels' 2-block tail): 1..16 rows give each row
    its one-row bits, and the decode (int8) and prompt (bf16) paths stay within
    test_matmul.py's stated bounds of the float64 reference."""
    from test_matmul import _check
    M, K = 37, 2880
    W = QTensor("w", GGMLType.MXFP4, (M, K), _mx(rng, M, K))
    x = (rng.standard_normal((40, K)) * rng.uniform(0.1, 10, (40, 1))).astype(np.float32)
    alone = np.stack([matmul(x[r:r + 1], W)[0] for r in range(BATCH_INVARIANT_MAX_ROWS)])
    for n in (2, 3, 5, 8, 16):
        np.testing.assert_array_equal(matmul(x[:n], W), alone[:n], err_msg=f"n={n}")
    for n in (1, 16, 40):
        _check(x[:n], W, matmul(x[:n], W))


def _write_gguf(path, tensors):
    w = gguf.GGUFWriter(str(path), "llama")
    for name, arr in tensors.items():
        if arr.dtype == np.uint8:
            w.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_file_with_mxfp4_tensors(tmp_path, rng):
    """gguf-py quantizes and writes MXFP4 (a matrix and a 3-D expert tensor, as gpt-oss's
    ffn_*_exps); our reader maps them as blocks (views of the file, nothing expanded) that
    dequantize to what gguf-py's reader gives, and the experts' views are each expert's."""
    from runtime.gguf_file import GGUFFile
    a = rng.standard_normal((64, 96)).astype(np.float32)
    exps = rng.standard_normal((4, 32, 64)).astype(np.float32) * 0.1
    qa = gguf.quants.quantize(a, gguf.GGMLQuantizationType.MXFP4)
    qe = gguf.quants.quantize(exps, gguf.GGMLQuantizationType.MXFP4)
    assert qa.shape == (64, 3 * 17) and qe.shape == (4, 32, 2 * 17)
    p = _write_gguf(tmp_path / "mx.gguf", {"w.weight": qa, "blk.0.ffn_up_exps.weight": qe,
                                           "norm.weight": np.ones(64, np.float32)})
    g = GGUFFile(p)
    ti = g.tensors["w.weight"]
    assert ti.ggml_type == 39 and ti.shape == (64, 96) and ti.nbytes == qa.nbytes
    r = gguf.GGUFReader(str(p))
    ref = {t.name: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type) for t in r.tensors}
    for name, shape in (("w.weight", (64, 96)), ("blk.0.ffn_up_exps.weight", (4, 32, 64))):
        raw = g.tensor_bytes(name)
        qt = QTensor.from_file_bytes(name, g.tensors[name].ggml_type, g.tensors[name].shape, raw)
        assert qt.qtype == GGMLType.MXFP4 and qt.shape == shape
        assert np.shares_memory(qt.data, raw) and not qt.data.flags.writeable    # the file's bytes
        assert _same_bits(dequantize(qt), ref[name].reshape(shape).astype(np.float32))
    e = QTensor.from_file_bytes("x", 39, (4, 32, 64), g.tensor_bytes("blk.0.ffn_up_exps.weight")).experts()
    assert _same_bits(dequantize(e[2]), ref["blk.0.ffn_up_exps.weight"].reshape(4, 32, 64)[2])
    # gguf-py's quantizer, round trip: every value within half a step of its block's grid
    back = dequantize(QTensor("a", 39, (64, 96), qa))
    assert np.abs(back - a).max() <= np.abs(a).max() / 4


def test_truncated_mxfp4_file_is_refused(tmp_path, rng):
    from runtime.gguf_file import GGUFError, GGUFFile
    q = gguf.quants.quantize(rng.standard_normal((64, 2880)).astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    p = _write_gguf(tmp_path / "mx.gguf", {"blk.0.ffn_down_exps.weight": q.reshape(2, 32, -1)})
    data = p.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-17 * 5])
    with pytest.raises(GGUFError, match="truncated.*ffn_down_exps"):
        GGUFFile(cut)


def test_packed_hf_layout_repacks_losslessly(rng):
    """gpt-oss's Hugging Face tensors (*_blocks: two consecutive values a byte, *_scales:
    E8M0 bytes) become GGML blocks by moving bits: the values are the OCP format's."""
    from quant.encode import mxfp4_from_packed
    rows, cols = 6, 2880
    packed = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (rows, cols // 32), dtype=np.uint8)
    scales[0, :3] = (0, 1, 255)
    fp4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)
    codes = np.stack((packed & 15, packed >> 4), -1).reshape(rows, cols)
    with np.errstate(over="ignore"):
        ref = (fp4[codes] * np.ldexp(1.0, np.repeat(scales.astype(int) - 127, 32, axis=1))).astype(np.float32)
    blocks = mxfp4_from_packed(packed, scales)
    assert blocks.shape == (rows, cols // 32 * 17)
    got = dequantize(QTensor("w", GGMLType.MXFP4, (rows, cols), blocks))
    assert np.array_equal(got, ref)             # (-0.0 == 0.0: ggml has no negative zero code)
    assert np.array_equal(mxfp4_from_packed(packed.reshape(rows, -1), scales), blocks)
    with pytest.raises(ValueError, match="packed bytes"):
        mxfp4_from_packed(packed[:, :-1], scales)
