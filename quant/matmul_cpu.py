"""y = x @ W.T on the CPU with W kept in its GGML block layout.

Two paths:
* small batches (n <= LARGE_BATCH_MIN - 1 rows: decode, speculative verify,
  batched decode): one parallel Numba kernel over chunks of W's rows; each W
  row is decoded once, block by block, into a per-chunk scratch row, then dotted
  with every activation row.  Row r of the result depends only on x[r] and W:
  the arithmetic for it is the same whatever n is (batch invariance).
* large batches (prompt processing): W is dequantized one tile of rows at a
  time into float32 scratch and multiplied with BLAS sgemm (np.matmul), so each
  weight block is decoded once per tile and the multiply runs at BLAS speed.
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange

from .dequant import deq_range_kernel, deq_row
from .tensor import QTensor
from .types import GGMLType

# Row counts at or above this take the dequantize-tile + sgemm path.
LARGE_BATCH_MIN = 32
# Rows of W dequantized per sgemm tile on the large-batch path.
TILE_ROWS = 256
# The guarantee the rest of Llamba may rely on: for n <= this, row r of
# matmul(x, W) is bit-identical whatever the other rows of x are.
BATCH_INVARIANT_MAX_ROWS = 16
assert BATCH_INVARIANT_MAX_ROWS < LARGE_BATCH_MIN


@njit(parallel=True, cache=True, fastmath=True)
def _mm_decoded_rows(qt, x, w, out, wbuf):
    n = x.shape[0]
    K = x.shape[1]
    M = w.shape[0]
    nch = wbuf.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        buf = wbuf[c]
        for m in range(c * per, min(M, (c + 1) * per)):
            deq_row(qt, w[m], buf)
            for r in range(n):
                xr = x[r]
                s = np.float32(0.0)
                for k in range(K):
                    s += xr[k] * buf[k]
                out[r, m] = s


@njit(parallel=True, cache=True, fastmath=True)
def _mm_f32(x, w, out, nch):
    n = x.shape[0]
    K = x.shape[1]
    M = w.shape[0]
    per = (M + nch - 1) // nch
    for c in prange(nch):
        for m in range(c * per, min(M, (c + 1) * per)):
            wr = w[m]
            for r in range(n):
                xr = x[r]
                s = np.float32(0.0)
                for k in range(K):
                    s += xr[k] * wr[k]
                out[r, m] = s


class Scratch:
    """Reusable work buffers for matmul_into / matmul_multi (grown on demand,
    never shrunk).  One per thread that calls matmul; not thread-safe."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        size = 1
        for s in shape:
            size *= s
        b = self._bufs.get(name)
        if b is None or b.size < size or b.dtype != dtype:
            b = np.empty(max(size, 1), dtype)
            self._bufs[name] = b
        return b[:size].reshape(shape)


_local = threading.local()


def default_scratch() -> Scratch:
    s = getattr(_local, "scratch", None)
    if s is None:
        s = _local.scratch = Scratch()
    return s


def _n_chunks(M: int) -> int:
    # several chunks per thread so a thread slowed by a noisy neighbour does not
    # hold everyone up; never more chunks than rows
    return max(1, min(M, 8 * numba.get_num_threads()))


def matmul_into(x: np.ndarray, W: QTensor, out: np.ndarray, scratch: Scratch) -> np.ndarray:
    """y = x @ W.T into out, without argument checks (hot path).

    x: float32 [n, K] C-contiguous; out: float32 [n, M] C-contiguous; W: 2-D QTensor.
    """
    n = x.shape[0]
    M = W.data.shape[0]
    qt = W.qtype
    if n >= LARGE_BATCH_MIN:
        return _matmul_large(x, W, out, scratch)
    if qt == GGMLType.F32:
        _mm_f32(x, W.data.view(np.float32), out, _n_chunks(M))
        return out
    nch = _n_chunks(M)
    _mm_decoded_rows(int(qt), x, W.data, out, scratch.get("wrow", (nch, x.shape[1])))
    return out


def _matmul_large(x, W, out, scratch):
    M, K = W.data.shape[0], W.shape[-1]
    n = x.shape[0]
    if W.qtype == GGMLType.F32:
        np.matmul(x, W.data.view(np.float32).T, out=out)
        return out
    tile = min(TILE_ROWS, M)
    wt = scratch.get("wtile", (tile, K))
    yt = scratch.get("ytile", (n, tile))
    qt = int(W.qtype)
    for m0 in range(0, M, tile):
        m1 = min(M, m0 + tile)
        w = wt[: m1 - m0]
        deq_range_kernel(qt, W.data, m0, w)
        if m1 - m0 == tile:
            np.matmul(x, w.T, out=yt)
            out[:, m0:m1] = yt
        else:
            out[:, m0:m1] = x @ w.T
    return out


def _check(x, W, out):
    if not isinstance(W, QTensor):
        raise TypeError(f"W must be a QTensor, got {type(W).__name__}")
    if len(W.shape) != 2:
        raise ValueError(f"tensor {W.name!r}: matmul needs a 2-D weight, shape is {W.shape}")
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != W.shape[1]:
        raise ValueError(f"tensor {W.name!r} {W.shape}: x must be float32 [n, {W.shape[1]}], "
                         f"got {x.dtype} {x.shape}")
    if out is not None and (out.dtype != np.float32 or out.shape != (x.shape[0], W.shape[0])):
        raise ValueError(f"tensor {W.name!r}: out must be float32 {(x.shape[0], W.shape[0])}, "
                         f"got {out.dtype} {out.shape}")


def matmul(x: np.ndarray, W: QTensor, out: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W.T for x float32 [n, K] (or [K]), W a 2-D QTensor (M, K); returns out [n, M]."""
    squeeze = x.ndim == 1
    if squeeze:
        x = x.reshape(1, -1)
    _check(x, W, out)
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    if out is None:
        out = np.empty((x.shape[0], W.shape[0]), np.float32)
    if out.flags.c_contiguous:
        matmul_into(x, W, out, default_scratch())
    else:
        tmp = np.empty(out.shape, np.float32)
        matmul_into(x, W, tmp, default_scratch())
        out[...] = tmp
    return out[0] if squeeze else out


def matmul_multi(x: np.ndarray, Ws: list[QTensor], outs: list[np.ndarray | None] | None = None):
    """[x @ W.T for W in Ws] sharing one activation (q/k/v, gate/up); returns the outs."""
    if outs is None:
        outs = [None] * len(Ws)
    return [matmul(x, W, o) for W, o in zip(Ws, outs)]


def uses_q8_activations(qtype, n: int) -> bool:
    """Whether matmul quantizes x to 8-bit blocks for this weight type and row
    count (what the accuracy bound in the tests depends on)."""
    return False
