"""QTensor: a weight tensor kept in its GGML block layout (usually a view of a
memory-mapped GGUF file)."""
from __future__ import annotations

import math

import numpy as np

from .types import TYPE_INFO, GGMLType, as_supported_type, row_nbytes


class QTensor:
    """A tensor in GGML block layout.

    shape is in numpy order: a weight matrix is (M = out_features, K = in_features)
    (GGUF lists dimensions the other way round, ne0 first).  Tensors of any rank
    are allowed; they are stored as `rows = prod(shape[:-1])` rows of `cols =
    shape[-1]` elements, and `data` is the uint8 array [rows, row_nbytes] of
    their bytes.  data may be read-only (a memmap view); nothing here writes it.
    """

    __slots__ = ("name", "qtype", "shape", "data", "row_nbytes", "_kernel_view")

    def __init__(self, name: str, qtype, shape: tuple[int, ...], data: np.ndarray):
        self.name = str(name)
        self.qtype: GGMLType = as_supported_type(qtype, self.name)
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 0 for s in shape):
            raise ValueError(f"tensor {self.name!r}: bad shape {shape}")
        self.shape = shape
        self.row_nbytes = row_nbytes(self.qtype, shape[-1], self.name)
        rows = math.prod(shape[:-1])
        data = np.asarray(data)
        if data.dtype != np.uint8:
            # e.g. gguf.GGUFReader hands out F32/F16 tensors as float arrays
            if not data.flags.c_contiguous:
                raise ValueError(f"tensor {self.name!r}: data must be C-contiguous")
            data = data.reshape(-1).view(np.uint8)
        if data.size != rows * self.row_nbytes:
            raise ValueError(
                f"tensor {self.name!r}: {self.qtype.name} shape {shape} needs "
                f"{rows * self.row_nbytes} bytes, data has {data.size}")
        if data.shape != (rows, self.row_nbytes):
            data = data.reshape(rows, self.row_nbytes)   # raises if not viewable
        if not data.flags.c_contiguous:
            raise ValueError(f"tensor {self.name!r}: data rows must be C-contiguous")
        # The kernels are compiled for read-only uint8 matrices only (one
        # signature instead of two); a read-only view costs nothing.
        if data.flags.writeable:
            data = data.view()
            data.flags.writeable = False
        self.data = data
        self._kernel_view = None   # typed view the matmul kernels read (matmul_cpu)

    @classmethod
    def from_file_bytes(cls, name: str, qtype, shape: tuple[int, ...], buf: np.ndarray) -> "QTensor":
        """buf: flat uint8 array (e.g. a slice of a memmap) holding the tensor's bytes."""
        return cls(name, qtype, shape, np.asarray(buf).reshape(-1))

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.data.size

    @property
    def block_info(self) -> tuple[int, int]:
        return TYPE_INFO[self.qtype]

    def experts(self) -> list["QTensor"]:
        """A 3-D expert tensor [n_experts, M, K] (GGUF's ffn_*_exps) as one 2-D [M, K]
        view per expert: expert e's rows are a contiguous run of the bytes, so every
        matmul kernel takes it as it takes any matrix, and nothing is copied."""
        if len(self.shape) != 3:
            raise ValueError(f"tensor {self.name!r}: experts() needs a 3-D tensor, not shape {self.shape}")
        E, M = self.shape[0], self.shape[1]
        return [QTensor(f"{self.name}[{e}]", self.qtype, self.shape[1:], self.data[e * M:(e + 1) * M])
                for e in range(E)]

    def __repr__(self) -> str:
        return f"QTensor({self.name!r}, {self.qtype.name}, shape={self.shape}, {self.nbytes} bytes)"
