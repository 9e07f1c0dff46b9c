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

from .act_quant import quantize_q8_32, quantize_q8_256
from .dequant import deq_range_kernel, deq_row
from .kernels_k import mm_q4_k, mm_q5_k, mm_q6_k
from .kernels_legacy import mm_q4_0, mm_q4_1, mm_q5_0, mm_q5_1, mm_q8_0
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
    """Reusable work buffers for matmul_into / matmul_multi, grown on demand and
    never shrunk; views are cached per shape so a steady-state call allocates
    nothing.  Keep one per calling thread (not thread-safe)."""

    def __init__(self):
        self._flat: dict[tuple[str, type], np.ndarray] = {}
        self._views: dict[tuple, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        key = (name, shape, dtype)
        v = self._views.get(key)
        if v is not None:
            return v
        size = 1
        for d in shape:
            size *= d
        fk = (name, dtype)
        b = self._flat.get(fk)
        if b is None or b.size < size:
            b = np.empty(max(size, 1, 2 * (0 if b is None else b.size)), dtype)
            self._flat[fk] = b
            # views into the old buffer must not be handed out again
            self._views = {k: w for k, w in self._views.items() if k[0] != name or k[2] != dtype}
        v = self._views[key] = b[:size].reshape(shape)
        return v


_local = threading.local()


def default_scratch() -> Scratch:
    s = getattr(_local, "scratch", None)
    if s is None:
        s = _local.scratch = Scratch()
    return s


_NCH_CACHE: dict[int, int] = {}


def _n_chunks(M: int) -> int:
    # several chunks per thread so one thread slowed by a noisy neighbour does
    # not hold everyone up; never more chunks than rows
    nch = _NCH_CACHE.get(M)
    if nch is None:
        nch = _NCH_CACHE[M] = max(1, min(M, 8 * numba.get_num_threads()))
    return nch


# How each weight type is multiplied on the small-batch path.
_K_KERNELS = {GGMLType.Q4_K: mm_q4_k, GGMLType.Q5_K: mm_q5_k, GGMLType.Q6_K: mm_q6_k}
_LEGACY_KERNELS = {GGMLType.Q4_0: mm_q4_0, GGMLType.Q4_1: mm_q4_1, GGMLType.Q5_0: mm_q5_0,
                   GGMLType.Q5_1: mm_q5_1, GGMLType.Q8_0: mm_q8_0}


def _q8_activations(x, block, scratch):
    """x quantized to 8-bit blocks of `block` elements, in scratch buffers."""
    n, K = x.shape
    xq = scratch.get("xq%d" % block, (n, K), np.int16)
    xd = scratch.get("xd%d" % block, (n, K // block))
    if block == 32:
        xs = scratch.get("xs32", (n, K // 32))
        quantize_q8_32(x, xq, xd, xs)
    else:
        xs = scratch.get("xb256", (n, K // 32), np.int32)
        quantize_q8_256(x, xq, xd, xs)
    return xq, xd, xs


def _small_batch(x, W, out, scratch, acts):
    qt = W.qtype
    n, K = x.shape
    M = W.data.shape[0]
    nch = _n_chunks(M)
    kern = _K_KERNELS.get(qt)
    if kern is not None:
        xq, xd, xb = acts.get(256) or acts.setdefault(256, _q8_activations(x, 256, scratch))
        kern(W.data, xq, xd, xb, out, scratch.get("acc", (nch, n)),
             scratch.get("wb256", (nch, 256), np.int16), scratch.get("mb", (nch, 8), np.int32), nch)
        return
    kern = _LEGACY_KERNELS.get(qt)
    if kern is not None:
        xq, xd, xs = acts.get(32) or acts.setdefault(32, _q8_activations(x, 32, scratch))
        kern(W.data, xq, xd, xs, out, scratch.get("wq", (nch, K), np.int16),
             scratch.get("wf", (nch, 2, K // 32)), 32, nch)
        return
    if qt == GGMLType.F32:
        _mm_f32(x, W.data.view(np.float32), out, nch)
        return
    _mm_decoded_rows(int(qt), x, W.data, out, scratch.get("wrow", (nch, K)))


def matmul_into(x: np.ndarray, W: QTensor, out: np.ndarray, scratch: Scratch) -> np.ndarray:
    """y = x @ W.T into out, without argument checks (hot path).

    x: float32 [n, K] C-contiguous; out: float32 [n, M] C-contiguous; W: 2-D QTensor.
    """
    if x.shape[0] >= LARGE_BATCH_MIN:
        return _matmul_large(x, W, out, scratch)
    _small_batch(x, W, out, scratch, {})
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


def matmul_multi(x: np.ndarray, Ws: list[QTensor], outs: list[np.ndarray | None] | None = None,
                 scratch: Scratch | None = None):
    """[x @ W.T for W in Ws] for one activation x (q/k/v, gate/up): x is
    quantized once for all of them.  Returns the outs (allocated where None)."""
    if x.ndim == 1:
        return [o.reshape(-1) for o in matmul_multi(x.reshape(1, -1), Ws,
                [None if o is None else o.reshape(1, -1) for o in (outs or [None] * len(Ws))])]
    if outs is None:
        outs = [None] * len(Ws)
    if len(outs) != len(Ws):
        raise ValueError("matmul_multi: need one out per weight")
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    scratch = scratch or default_scratch()
    res = []
    acts = {}
    for W, o in zip(Ws, outs):
        _check(x, W, o)
        if o is None:
            o = np.empty((x.shape[0], W.shape[0]), np.float32)
        tgt = o if o.flags.c_contiguous else np.empty(o.shape, np.float32)
        if x.shape[0] >= LARGE_BATCH_MIN:
            _matmul_large(x, W, tgt, scratch)
        else:
            _small_batch(x, W, tgt, scratch, acts)
        if tgt is not o:
            o[...] = tgt
        res.append(o)
    return res


def activation_block(qtype, n: int) -> int:
    """Block size of the 8-bit activation quantization matmul uses for this
    weight type and row count, 0 when x stays float32 (what the accuracy bound
    in the tests depends on)."""
    if n >= LARGE_BATCH_MIN:
        return 0
    t = GGMLType(qtype)
    return 256 if t in _K_KERNELS else 32 if t in _LEGACY_KERNELS else 0


def kernel_name(qtype, n: int) -> str:
    """Which kernel matmul uses for this type and row count (for the benchmark)."""
    if n >= LARGE_BATCH_MIN:
        return "dequant-tile+sgemm"
    t = GGMLType(qtype)
    if t in _K_KERNELS:
        return "int16-dot, x as q8/256"
    if t in _LEGACY_KERNELS:
        return "int16-dot, x as q8/32"
    return "f32-dot" if t == GGMLType.F32 else "decode-row+f32-dot"
