"""The GGUF reader on real files and on hostile ones: every bad file must fail
fast with a GGUFError (a clear message), never hang or allocate gigabytes."""
from __future__ import annotations

import resource
import struct
import time

import numpy as np
import pytest

from quant import UnsupportedQuantType
from runtime.gguf_file import GGUFError, GGUFFile


def _header(n_tensors=0, n_kv=0, version=3):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _kv_string(key, val):
    k, v = key.encode(), val.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


def _write(tmp_path, data, name="m.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _fails_fast(path, exc=GGUFError):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    with pytest.raises(exc) as info:
        GGUFFile(path)
    assert time.perf_counter() - t < 2.0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 100, f"reader grew by {grown_mb:.0f} MB on a hostile file"
    return str(info.value)


def test_real_file(model_path):
    g = GGUFFile(model_path("smollm2-135m"))
    assert g.metadata["general.architecture"] == "llama"
    t = g.tensors["token_embd.weight"]
    assert t.shape == (49152, 576)
    assert g.tensor_bytes("token_embd.weight").nbytes == t.nbytes


def test_tiny_file_claiming_2_pow_63_strings(tmp_path):
    # 49 bytes: header, one key "a", type ARRAY of STRING, claiming 2**63 elements
    data = _header(0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<II", 9, 8) + struct.pack("<Q", 2**63)
    msg = _fails_fast(_write(tmp_path, data))
    assert "claims" in msg


def test_huge_kv_count(tmp_path):
    _fails_fast(_write(tmp_path, _header(0, 2**62)))


def test_huge_string_length(tmp_path):
    data = _header(0, 1) + struct.pack("<Q", 2**60) + b"key"
    _fails_fast(_write(tmp_path, data))


def test_huge_tensor_count(tmp_path):
    _fails_fast(_write(tmp_path, _header(2**40, 0)))


def test_nested_array_bomb(tmp_path):
    # array of arrays, each claiming a huge length
    data = _header(0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<II", 9, 9) + struct.pack("<Q", 3)
    data += (struct.pack("<I", 8) + struct.pack("<Q", 2**50)) * 3
    _fails_fast(_write(tmp_path, data))


def test_not_gguf(tmp_path):
    msg = _fails_fast(_write(tmp_path, b"PK\x03\x04" + b"\0" * 100))
    assert "not a GGUF" in msg


def test_too_short(tmp_path):
    assert "too short" in _fails_fast(_write(tmp_path, b"GGUF"))


def test_bad_version(tmp_path):
    assert "version" in _fails_fast(_write(tmp_path, _header(0, 0, version=99)))


def test_truncated_real_file(tmp_path, model_path):
    src = model_path("smollm2-135m").read_bytes()
    for cut in (30, 5000, len(src) // 2):
        msg = _fails_fast(_write(tmp_path, src[:cut], f"cut{cut}.gguf"))
        assert "truncated" in msg or "claims" in msg


def _one_tensor_file(ggml_type: int, shape=(32,), offset=0, extra=b""):
    name = b"w"
    body = _header(1, 1) + _kv_string("general.architecture", "llama")
    body += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(shape))
    body += b"".join(struct.pack("<Q", d) for d in reversed(shape))
    body += struct.pack("<IQ", ggml_type, offset)
    pad = (-len(body)) % 32
    return body + b"\0" * pad + extra


def test_tensor_past_end(tmp_path):
    msg = _fails_fast(_write(tmp_path, _one_tensor_file(0, (1024, 1024), extra=b"\0" * 64)))
    assert "truncated" in msg and "tensor w" in msg


def test_huge_tensor_dims(tmp_path):
    _fails_fast(_write(tmp_path, _one_tensor_file(0, (2**62, 2**62))))


def test_unknown_quant_type_is_named(tmp_path):
    msg = _fails_fast(_write(tmp_path, _one_tensor_file(77, (32,), extra=b"\0" * 64)), UnsupportedQuantType)
    assert "'w'" in msg and "77" in msg


def test_valid_tiny_file(tmp_path):
    data = np.arange(32, dtype=np.float32).tobytes()
    g = GGUFFile(_write(tmp_path, _one_tensor_file(0, (32,), extra=data)))
    assert np.array_equal(np.frombuffer(g.tensor_bytes("w"), np.float32), np.arange(32))
