"""How weights are stored: GGML block formats and the kernels that compute with them.

Public API
----------
GGMLType                 IntEnum of every GGML type id (retired ones too, so errors can name them)
TYPE_INFO[t]             (block_elems, block_bytes) of the 11 supported types; BLOCK_LAYOUT has all
UnsupportedQuantType     ValueError naming the type and the tensor
QTensor(name, qtype, shape, data)
                         a tensor in block layout; shape in numpy order (M out, K in); data is
                         uint8 [rows, row_nbytes], typically a read-only memmap view
QTensor.from_file_bytes(name, qtype, shape, flat_uint8)
dequantize(qt)           float32 of qt.shape (bit-exact with gguf.quants.dequantize)
dequantize_rows(qt, ids) float32 [len(ids), K] touching only those rows (embeddings)
matmul(x, W, out=None)   y = x @ W.T; x float32 [n, K]; W read block by block, never unpacked
quantize(x, qtype)       float32 [M, K] -> uint8 [M, row_nbytes] for Q8_0, Q4_0, Q4_K (bit-exact
                         with llama.cpp's reference quantizers) and F32, F16, BF16

Lower-level entries for the CPU backend
---------------------------------------
Scratch()                reusable work buffers; keep one per calling thread
matmul_into(x, W, out, scratch)
                         matmul without argument checks or allocation: x float32 [n, K]
                         C-contiguous, out float32 [n, M] C-contiguous
matmul_multi(x, [W1, W2, ...], [out1, out2, ...])
                         several weights applied to one x (q/k/v, gate/up)

Batch invariance: for n <= BATCH_INVARIANT_MAX_ROWS (16) row r of matmul(x, W) is
bit-identical whatever n is and whatever the other rows of x contain.
"""
from .types import (BLOCK_LAYOUT, QK, QK_K, SUPPORTED, TYPE_INFO, GGMLType, UnsupportedQuantType,
                    row_nbytes, tensor_nbytes, type_name)
from .tensor import QTensor
from .dequant import dequantize, dequantize_rows
from .matmul_cpu import (BATCH_INVARIANT_MAX_ROWS, Scratch, matmul, matmul_into, matmul_multi)
from .encode import quantize

__all__ = [
    "BLOCK_LAYOUT", "QK", "QK_K", "SUPPORTED", "TYPE_INFO", "GGMLType", "UnsupportedQuantType",
    "row_nbytes", "tensor_nbytes", "type_name", "QTensor", "dequantize", "dequantize_rows",
    "BATCH_INVARIANT_MAX_ROWS", "Scratch", "matmul", "matmul_into", "matmul_multi", "quantize",
]
