"""Shared helpers for the quant/ tests: valid random blocks of every type and
access to the real GGUF files (skipped when they are not downloaded)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from quant import TYPE_INFO, GGMLType

MODEL_DIR = Path(os.environ.get("LLAMBA_MODEL_DIR", Path.home() / ".cache" / "llm-models"))

# byte offsets of the f16 scale fields inside one block
_F16_FIELDS = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}


def random_weight_bytes(rng: np.random.Generator, qtype: GGMLType, M: int, K: int,
                        finite: bool = True) -> np.ndarray:
    """uint8 [M, row_nbytes]: random quants; with finite=True the scales are
    finite halves of realistic size, so products stay finite."""
    be, bb = TYPE_INFO[qtype]
    if qtype == GGMLType.F32:
        return rng.standard_normal((M, K)).astype(np.float32).view(np.uint8)
    if qtype == GGMLType.F16:
        return rng.standard_normal((M, K)).astype(np.float16).view(np.uint8)
    if qtype == GGMLType.BF16:
        bits = rng.standard_normal((M, K)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (M, K // be, bb), dtype=np.uint8)
    if finite and qtype == GGMLType.MXFP4:
        # the E8M0 exponent byte: blocks of 2^-10 .. 2^-1 (largest value 12 x 2^(e-128) <= 0.375)
        raw[:, :, 0] = rng.integers(118, 124, (M, K // be), dtype=np.uint8)
    elif finite:
        for off in _F16_FIELDS[qtype]:
            s = rng.uniform(-0.05, 0.05, (M, K // be)).astype(np.float16)
            raw[:, :, off:off + 2] = s.view(np.uint8).reshape(M, K // be, 2)
    return raw.reshape(M, -1)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def model_path(name: str) -> Path:
    p = MODEL_DIR / name
    if not p.exists():
        pytest.skip(f"{p} not downloaded (python3 shared/models/fetch)")
    return p


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_index(path: Path):
    """(tensor list, data offset, alignment) of a GGUF file: a minimal parser,
    because gguf.GGUFReader spends tens of seconds building numpy views of
    every metadata field of a 150k-token vocabulary."""
    import mmap
    import struct
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, mm, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string():
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(mm[pos - n:pos]).decode("utf-8", "replace")

    def skip(t):
        nonlocal pos
        if t == 8:
            n = take("Q")   # (not `pos += take(...)`: that reads pos before take moves it)
            pos += n
        elif t == 9:
            et, n = take("I"), take("Q")
            if et in _SCALAR:
                pos += n * _SCALAR[et]
            else:
                for _ in range(n):
                    skip(et)
        else:
            pos += _SCALAR[t]

    assert mm[:4] == b"GGUF", path
    pos = 8
    n_tensors, n_kv = take("Q"), take("Q")
    align = 32
    for _ in range(n_kv):
        key, t = string(), take("I")
        if key == "general.alignment" and t == 4:
            align = take("I")
        else:
            skip(t)
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        tensors.append((name, take("I"), tuple(reversed(dims)), take("Q")))
    return mm, tensors, (pos + align - 1) // align * align


_INDEX = {}


def real_tensors(name: str, max_rows: int = 32):
    """One tensor per supported GGML type from a real GGUF file, first max_rows
    rows: yields (tensor name, GGMLType, numpy shape, uint8 [rows, row_nbytes])."""
    p = model_path(name)
    if p not in _INDEX:
        _INDEX[p] = _gguf_index(p)
    mm, tensors, data_start = _INDEX[p]
    buf = np.frombuffer(mm, np.uint8)
    seen = set()
    for tname, t, shape, off in tensors:
        if t not in TYPE_INFO or GGMLType(t) in seen:
            continue
        qt = GGMLType(t)
        seen.add(qt)
        be, bb = TYPE_INFO[qt]
        rows = min(max_rows, int(np.prod(shape[:-1])))
        row_nbytes = shape[-1] // be * bb
        data = buf[data_start + off: data_start + off + rows * row_nbytes].reshape(rows, row_nbytes)
        yield tname, qt, (rows, shape[-1]), data
