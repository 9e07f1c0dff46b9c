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
    if finite:
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


_READERS = {}


def gguf_reader(name: str):
    gguf = pytest.importorskip("gguf")
    p = model_path(name)
    if p not in _READERS:
        _READERS[p] = gguf.GGUFReader(p)
    return _READERS[p]


def real_tensors(name: str, max_rows: int = 32):
    """One tensor per GGML type from a real GGUF file, first max_rows rows:
    yields (tensor name, GGMLType, numpy shape, uint8 [rows, row_nbytes])."""
    r = gguf_reader(name)
    seen = set()
    for t in r.tensors:
        qt = GGMLType(int(t.tensor_type))
        if qt in seen or qt not in TYPE_INFO:
            continue
        seen.add(qt)
        shape = tuple(int(s) for s in reversed(t.shape))   # GGUF lists ne0 first
        data = np.asarray(t.data).view(np.uint8)
        data = data.reshape(-1, data.size // int(np.prod(shape[:-1])))[:max_rows]
        yield t.name, qt, (data.shape[0], shape[-1]), data
