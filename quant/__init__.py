"""How weights are stored: GGML block formats and the kernels that compute with them.

Public API
----------
GGMLType                 IntEnum of every GGML type id (retired ones too, so errors can name them)
TYPE_INFO[t]             (block_elems, block_bytes) of the 12 supported types; BLOCK_LAYOUT has all
UnsupportedQuantType     ValueError naming the type and the tensor
QTensor(name, qtype, shape, data)
                         a tensor in block layout; shape in numpy order (M out, K in); data is
                         uint8 [rows, row_nbytes], typically a read-only memmap view
QTensor.from_file_bytes(name, qtype, shape, flat_uint8)
dequantize(qt)           float32 of qt.shape (bit-exact with gguf.quants.dequantize)
dequantize_rows(qt, ids) float32 [len(ids), K] touching only those rows (embeddings)
matmul(x, W, out=None)   y = x @ W.T; x float32 [n, K]; W read block by block, never unpacked
quantize(x, qtype)       float32 [M, K] -> uint8 [M, row_nbytes] for Q8_0, Q4_0, Q5_0, Q3_K, Q4_K,
                         Q5_K, Q6_K, MXFP4 (bit-exact with llama.cpp's reference quantizers) and
                         F32, F16, BF16

Lower-level entries for the CPU backend
---------------------------------------
Scratch()                reusable work buffers; keep one per calling thread
matmul_into(x, W, out, scratch)
                         matmul without argument checks or allocation: x float32 [n, K]
                         C-contiguous, out float32 [n, M] C-contiguous (~3 us fixed cost per call)
matmul_multi(x, [W1, W2, ...], [out1, out2, ...], scratch=None)
                         several weights applied to one x (q/k/v, gate/up): x is quantized once, and
                         weights of one type run in a single parallel region
quant.kernels_k / kernels_legacy / kernels_float .rows_<type>(..., m0, m1)
                         the per-type kernels computing W rows m0..m1-1 with one worker's scratch, for
                         a caller that runs its own prange (see matmul_cpu._small_batch for the
                         argument layout)

How matmul computes (quant/matmul_cpu.py)
-----------------------------------------
n < 32 rows: integer kernels.  x is rounded to int8 codes in blocks (32 elements for the
32-element formats, 256 for the K-quants, one float scale per block, as llama.cpp's Q8_0/Q8_K);
each W row is decoded once into int16 codes and dotted with every row of x (vpmaddwd /
vpdpwssd).  Error vs. float64: at most sum over blocks of (step_x/2 * sum|W|), step_x =
amax/127 of the block (tests/quant/test_matmul.py checks this bound).  Measured 2-10x faster
per core than the float-FMA alternative (python -m runtime.bench.kernels --fma).  F32/F16/BF16
weights keep x in float32.
n >= 32 rows (prompt processing): W is dequantized a tile of 256 rows at a time and
multiplied with BLAS sgemm (x stays float32).
Matrices under 2**19 weights run on the calling thread, larger ones in parallel over chunks
of W rows (env LLAMBA_QUANT_PARALLEL_MIN to change).

Every kernel lets go of the GIL while it runs (nogil): a server's event loop and the app's window
go on (reading requests, streaming tokens) while a forward computes on another thread, instead of
waiting for each matmul call to end.

Batch invariance: for n <= BATCH_INVARIANT_MAX_ROWS (31) row r of matmul(x, W) is
bit-identical whatever n is, whatever the other rows of x contain and however rows are split
between threads (in fact for every n below 32, the sgemm threshold).
"""
from .kernel_cache import configure as _configure_kernel_cache

_configure_kernel_cache()     # before any kernel is decorated: see kernel_cache.py

from .types import (BLOCK_LAYOUT, QK, QK_K, SUPPORTED, TYPE_INFO, GGMLType, UnsupportedQuantType,
                    row_nbytes, tensor_nbytes, type_name)
from .tensor import QTensor
from .dequant import dequantize, dequantize_rows
from .matmul_cpu import (BATCH_INVARIANT_MAX_ROWS, Scratch, matmul, matmul_dequant, matmul_into, matmul_multi)
from .encode import quantize

__all__ = [
    "BLOCK_LAYOUT", "QK", "QK_K", "SUPPORTED", "TYPE_INFO", "GGMLType", "UnsupportedQuantType",
    "row_nbytes", "tensor_nbytes", "type_name", "QTensor", "dequantize", "dequantize_rows",
    "BATCH_INVARIANT_MAX_ROWS", "Scratch", "matmul", "matmul_into", "matmul_multi", "quantize",
]
