"""y = x @ W.T on the CPU with W kept in its GGML block layout.

Paths, chosen per call from the row count n of x:

* small batches, n < LARGE_BATCH_MIN (decode, speculative verify, batched
  decode), on CPUs with AVX512-VNNI (USE_VNNI; Zen4, Ice Lake and later) for
  Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/MXFP4/Q4_K/Q6_K: quant/vnni.py, u8 x s8 vpdpbusd kernels
  written in LLVM IR, x rounded to int8 codes (same blocks and steps as below);
  one Numba call quantizes x and runs all W rows.  (MXFP4 is one of the
  32-element formats: its E2M1 codes become int8 by table lookup, as in
  llama.cpp's vec_dot_mxfp4_q8_0.)  Otherwise (other CPUs, other
  types): per-type Numba kernels that walk W row by row, decode each weight
  block once into a small int16 (or float32) scratch, and dot it with all n
  activation rows before moving on.  Quantized types use integer dots with x
  rounded to 8-bit blocks (act_quant); float types keep x in float32.  The
  operations that produce y[r, m] involve only x[r] and W[m] and do not depend
  on n or on how rows are split between threads: batch invariance.
* large batches (prompt processing): W is dequantized one tile of rows at a
  time inside Numba's pool, each weight block once per call, and multiplied
  in bfloat16 with float32 sums where the CPU has AVX512_BF16 (gemm_bf16.py,
  bf16_path; LLAMBA_BF16_PREFILL=0 turns it off), otherwise in float32 by
  single-threaded OpenBLAS sgemm (gemm_tiles.py).  (Prompts through the 8-bit
  VNNI kernels failed the 98% top-1 bar against transformers: see _sgemm_path.)
  matmul_dequant keeps x in float32 at any row count.

Small matrices (M*K < PARALLEL_MIN_ELEMS) run on the calling thread: waking
the thread pool costs more than it saves, and on a busy machine a parallel
region waits for its slowest thread.  Larger ones run nch chunks of W rows
(several per thread) handed out dynamically.

Each kernel family exposes a rows_<type>(..., m0, m1) function computing W
rows m0..m1-1 with one worker's scratch, so a caller with its own parallel
region (the CPU backend fusing q/k/v) can split work the same way.
"""
from __future__ import annotations

import functools
import os
import threading

import numba
import numpy as np
from numba.np.ufunc import parallel as _npar

from . import amx as AMX
from . import gemm_bf16 as GB
from . import kernels_float as KF
from . import kernels_k as KK
from . import kernels_legacy as KL
from . import vnni as KV
from . import vnni_quad as VQ
from .act_quant import quantize_q8_256, quantize_q8_256_i8, quantize_q8_32, quantize_q8_32_i8, quantize_q8_32_quad
assert VQ.QUAD_R == KV.LEG_ROWS_MAX     # the rows vnni_quad takes are exactly leg_rows' (same bits)
from .blas_threads import set_blas_threads, sgemm_address
from .dequant import deq_range_kernel
from .gemm_tiles import gemm_tiles, tile_rows
from .tensor import QTensor
from .types import GGMLType

# Row counts at or above this take the dequantize-tile + sgemm path.  Measured
# (one core, 1536x1536, CPU time): the integer kernels win at 16 rows (1.3-1.7x),
# sgemm wins at 32 rows for Q4_1/Q8_0 (1.2x; Q4_K still 1.4x slower there) and
# for every type from 64 rows (1.2-1.9x at 128).
LARGE_BATCH_MIN = 32
# Rows of W dequantized per sgemm tile on the large-batch path.
TILE_ROWS = 256
# Large batches run sgemm per tile inside Numba's thread pool (gemm_tiles.py)
# where numpy's OpenBLAS is found; LLAMBA_QUANT_POOL_SGEMM=0 keeps np.matmul.
USE_POOL_SGEMM = os.environ.get("LLAMBA_QUANT_POOL_SGEMM", "1") != "0"
# Below this many weights a matmul runs on the calling thread (a 2**19-weight
# Q4 matvec is ~50 us on one Zen4 core; waking the pool costs several us on an
# idle machine and milliseconds on an oversubscribed one).  Override with the
# environment variable LLAMBA_QUANT_PARALLEL_MIN.
PARALLEL_MIN_ELEMS = int(os.environ.get("LLAMBA_QUANT_PARALLEL_MIN", 1 << 19))
# The guarantee the rest of Llamba may rely on: for n <= this, row r of
# matmul(x, W) is bit-identical whatever the other rows of x are (every row count
# below the sgemm path's runs the same per-row integer arithmetic).
BATCH_INVARIANT_MAX_ROWS = LARGE_BATCH_MIN - 1
assert BATCH_INVARIANT_MAX_ROWS < LARGE_BATCH_MIN

# family, serial row kernel, parallel kernel
_K = {GGMLType.Q4_K: (KK.rows_q4_k, KK.par_q4_k), GGMLType.Q5_K: (KK.rows_q5_k, KK.par_q5_k),
      GGMLType.Q6_K: (KK.rows_q6_k, KK.par_q6_k)}
_LEGACY = {GGMLType.Q4_0: (KL.rows_q4_0, KL.par_q4_0), GGMLType.Q4_1: (KL.rows_q4_1, KL.par_q4_1),
           GGMLType.Q5_0: (KL.rows_q5_0, KL.par_q5_0), GGMLType.Q5_1: (KL.rows_q5_1, KL.par_q5_1),
           GGMLType.Q8_0: (KL.rows_q8_0, KL.par_q8_0), GGMLType.MXFP4: (KL.rows_mxfp4, KL.par_mxfp4)}
# several weights of one type in one parallel region (matmul_multi)
_MULTI = {GGMLType.Q4_K: KK.multi_q4_k, GGMLType.Q5_K: KK.multi_q5_k, GGMLType.Q6_K: KK.multi_q6_k,
          GGMLType.Q4_0: KL.multi_q4_0, GGMLType.Q4_1: KL.multi_q4_1, GGMLType.Q5_0: KL.multi_q5_0,
          GGMLType.Q5_1: KL.multi_q5_1, GGMLType.Q8_0: KL.multi_q8_0, GGMLType.MXFP4: KL.multi_mxfp4}


class Scratch:
    """Reusable work buffers for matmul_into / matmul_multi, grown on demand and
    never shrunk; views are cached per shape so a steady-state call allocates
    nothing.  Keep one per calling thread (not thread-safe)."""

    def __init__(self):
        self._flat: dict[tuple[str, type], np.ndarray] = {}
        self._views: dict[tuple, np.ndarray] = {}
        self._sets: dict[tuple, tuple] = {}     # per-kernel bundles of views (_buffers)
        self.rec: list | None = None            # kernel calls of a step being recorded

    def call(self, fn, *args):
        """fn(*args): every kernel the small-batch path runs goes through here, so a
        decode step's calls can be recorded once and replayed (runtime/backend/cpu_plan.py)."""
        r = fn(*args)
        if self.rec is not None:
            self.rec.append((fn, args, r))
        return r

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
            # views of the old buffer must not be handed out again
            self._views = {k: w for k, w in self._views.items() if k[0] != name or k[2] != dtype}
            self._sets.clear()
        v = self._views[key] = b[:size].reshape(shape)
        return v


_local = threading.local()


def default_scratch() -> Scratch:
    s = getattr(_local, "scratch", None)
    if s is None:
        s = _local.scratch = Scratch()
    return s


def _kernel_view(W: QTensor) -> np.ndarray:
    """W's bytes as the kernels want them (float32 / uint16 matrix for float types)."""
    v = W._kernel_view
    if v is None:
        if W.qtype == GGMLType.F32:
            v = W.data.view(np.float32)
        elif W.qtype in (GGMLType.F16, GGMLType.BF16):
            v = W.data.view(np.uint16)
        else:
            v = W.data
        W._kernel_view = v
    return v


def _q8_activations(scratch, x, block, bufs, acts):
    """x rounded to 8-bit blocks of `block` elements into bufs[:3] (done once
    per activation: matmul_multi shares it through acts)."""
    a = acts.get(block)
    if a is None:
        a = acts[block] = bufs[:3]
        scratch.call(quantize_q8_32 if block == 32 else quantize_q8_256, x, *a)
    return a


def _buffers(scratch, fam, n, K, nch):
    """All scratch arrays one kernel family needs, cached as one tuple so a
    steady-state call does a single dict lookup."""
    key = (fam, n, K, nch)
    b = scratch._sets.get(key)
    if b is None:
        g = scratch.get
        if fam == 0:     # K-quants
            b = (g("xq", (n, K), np.int16), g("xd256", (n, K // 256)), g("xb256", (n, K // 32), np.int32),
                 g("acc", (nch, n)), g("wb", (nch, 256), np.int16), g("mb", (nch, 8), np.int32))
        elif fam == 1:   # 32-element formats
            b = (g("xq32", (n, K), np.int16), g("xd32", (n, K // 32)), g("xs32", (n, K // 32)),
                 g("wq", (nch, K), np.int16), g("wf", (nch, 2, K // 32)), g("lanes", (nch, 32)))
        else:            # float weights
            b = (g("frow", (nch, K)),)
        scratch._sets[key] = b
    return b


# Prompt processing in bfloat16 (quant/gemm_bf16.py) where the CPU has AVX512_BF16:
# read per call, so tests can compare it with the float32 path.
BF16_PREFILL = GB.HAVE_BF16
USE_AMX = BF16_PREFILL and AMX.HAVE_AMX
# Quantized weights only: float checkpoints (F32/F16/BF16) keep float32 activations,
# so an unquantized model still reproduces its float reference to KL < 1e-4.
_BF16_TYPES = frozenset(_K) | frozenset(_LEGACY)

# The u8 x s8 kernels (quant/vnni.py) where the CPU can run them (AVX512-VNNI, or AVX2 with
# vpdpbusd spelled in two instructions: quant/ir.py, INT8_DOT): kind code per type.
# USE_VNNI is read per call, so tests can run the int16 fallback too.
USE_VNNI = KV.INT8_DOT
# Q4_0 rows of K % 128 == 0 take vnni_quad's kernel instead of vnni.leg_rows for 1-2
# activation rows, same bits (USE_QUAD: the CPU has AVX512-VBMI; LLAMBA_QUANT_QUAD=0
# turns it off).
USE_QUAD = VQ.HAVE_QUAD
_VNNI_KIND = {GGMLType.Q4_0: 0, GGMLType.Q4_1: 1, GGMLType.Q5_0: 2, GGMLType.Q5_1: 3,
              GGMLType.Q8_0: 4, GGMLType.MXFP4: 6, GGMLType.Q4_K: 10, GGMLType.Q6_K: 11}


QUAD = VQ.KIND     # the kind of Q4_0 matrices that vnni_quad's kernel runs (K % 128 == 0, AVX512-VBMI)


def _vnni_kind(qt, n, K):
    """The VNNI kernel kind for a weight type, row count and row length, None for none."""
    kind = _VNNI_KIND.get(qt)
    if kind == 0 and n <= VQ.QUAD_R and USE_QUAD and K % VQ.QUAD_K == 0:
        return QUAD
    return kind


def _family(kind):
    """Which activation quantization a kind reads: "k" (256-element blocks), "q" (quad
    order, vnni_quad) or "l" (32-element blocks in pair order, vnni.py)."""
    return "k" if kind >= 10 else "q" if kind == QUAD else "l"


def _vnni_buffers(scratch, fam, n, K, nch):
    key = ("vnni", fam, n, K, nch)
    b = scratch._sets.get(key)
    if b is None:
        g = scratch.get
        ng = (n + 15) // 16
        if fam == "k":
            b = (g("vxq256", (n * K,), np.int8), g("vxd256", (n * (K // 256),)),
                 g("vxb32", (n * (K // 32),), np.int32), g("vxb16", (n * (K // 16),), np.int32),
                 g("vres", (nch, 16)), g("vxq256k", (n * K,), np.int8),     # the codes in Q4_K's order
                 g("vxbf32", (n * (K // 32),)))                              # step x code sum, per 32
        elif fam == "q":        # as below, the codes in vnni_quad's order
            b = (g("vxqq", (n * K,), np.int8), g("vxdq", (n * (K // 32),)),
                 g("vxsumq", (n * (K // 32),), np.int32), g("vxsq", (n * (K // 32),)), g("vres", (nch, 16)))
        else:
            b = (g("vxq32", (n * K,), np.int8), g("vxd32", (n * (K // 32),)),
                 g("vxsum32", (n * (K // 32),), np.int32), g("vxs32", (n * (K // 32),)),
                 g("vres", (nch, 16)),
                 # row groups (n >= 2): codes, steps, code sums, steps * code sums
                 g("vxg32", (ng * 16 * K,), np.int8), g("vxdg32", (ng * (K // 32) * 16,)),
                 g("vxsumg", (ng * (K // 32) * 16,), np.int32), g("vxsg", (ng * (K // 32) * 16,)))
        scratch._sets[key] = b
    return b


def _vnni_grouped(kind, n):
    """Whether this kind and row count run the row-group kernels (vnni.leg_grp).
    K-quants never do: vnni_kq.kq_rows shares each W decode among up to 8 rows
    itself, on the flat activation layout; nor do the 32-element formats' first
    few rows (vnni.leg_rows, vnni_quad)."""
    return kind in KV.LEG_KINDS and n > KV.LEG_ROWS_MAX


def _vnni_activations(scratch, x, kind, bufs, acts):
    """(xq, xd, xs1, xs2) as vnni.rows_any wants them for this kind, or for
    the row-group kernels (n >= 2, _vnni_grouped) (xg, xdg, xa, xb) as
    vnni.grp_rows wants them."""
    fam = _family(kind)
    if ("v", fam) not in acts:
        acts[("v", fam)] = True
        if fam == "k":
            scratch.call(quantize_q8_256_i8, x, bufs[0], bufs[5], *bufs[1:4], bufs[6])
        elif fam == "q":
            scratch.call(quantize_q8_32_quad, x, *bufs[:4])
        else:
            scratch.call(quantize_q8_32_i8, x, *bufs[:4])
        if _vnni_grouped(kind, x.shape[0]):
            n, K = x.shape
            scratch.call(KV.group_q8_32, n, K, *bufs[:4], *bufs[5:9])
    if _vnni_grouped(kind, x.shape[0]):
        return bufs[5:9]
    if fam != "k":
        return bufs[:4]
    if kind == 10:
        return bufs[5], bufs[1], bufs[6], bufs[1]
    return bufs[0], bufs[1], bufs[3], bufs[1]


def _small_batch_vnni(x, W, out, scratch, acts, kind):
    w = W.data
    n, K = x.shape
    M = w.shape[0]
    fam = _family(kind)
    grouped = _vnni_grouped(kind, n)
    if M * K >= PARALLEL_MIN_ELEMS and _nthreads() > 1:
        nch = min(M, 8 * _nthreads())
        bufs = _vnni_buffers(scratch, fam, n, K, nch)
        xa = _vnni_activations(scratch, x, kind, bufs, acts)
        _run_parallel(scratch, KV.grp_par if grouped else KV.par_any, kind, w, *xa, out, bufs[4], n, K, nch)
        return
    bufs = _vnni_buffers(scratch, fam, n, K, 1)
    fresh = ("v", fam) not in acts
    acts[("v", fam)] = True
    if grouped:
        scratch.call(KV.matvec_grp_leg, kind, x, w, *bufs[:4], *bufs[5:9], out, bufs[4][0], fresh)
        return
    if fam == "k":
        scratch.call(KV.matvec_k, kind, x, w, bufs[0], bufs[5], bufs[1], bufs[2], bufs[3], bufs[6], out, bufs[4][0], fresh)
    else:
        scratch.call(KV.matvec_leg, kind, x, w, bufs[0], bufs[1], bufs[2], bufs[3], out, bufs[4][0], fresh)


def _nthreads() -> int:
    # numba.get_num_threads() takes two locks on every call (~1 us); once the
    # pool is up, its C getter is enough
    if _npar._is_initialized:
        return _npar._get_num_threads()
    return numba.get_num_threads()


_FAMILY = {t: 0 for t in _K} | {t: 1 for t in _LEGACY} | {GGMLType.F32: 2, GGMLType.F16: 2,
                                                          GGMLType.BF16: 2}


def _run_parallel(scratch, kernel, *args):
    # chunks of W rows are handed out one at a time instead of split evenly up
    # front, so a thread that the OS deschedules holds back one chunk, not half
    # the matrix.  The setting is per calling thread and every parallel kernel
    # Llamba runs is coarse-grained, so it is set once per thread and left on
    # (setting and restoring it took two Numba calls per matmul, ~100 matmuls a
    # token; calling it inside a kernel makes Numba refuse to cache the kernel).
    parallel_chunks_one()
    scratch.call(kernel, *args)


def parallel_chunks_one() -> None:
    """The chunk size _run_parallel sets (also for a caller that runs recorded kernels itself)."""
    if not getattr(_local, "chunk1", False):
        numba.set_parallel_chunksize(1)
        _local.chunk1 = True


def _small_batch(x, W, out, scratch, acts):
    qt = W.qtype
    if USE_VNNI:
        kind = _vnni_kind(qt, *x.shape)
        if kind is not None:
            _small_batch_vnni(x, W, out, scratch, acts, kind)
            return
    w = W._kernel_view
    if w is None:
        w = _kernel_view(W)
    n, K = x.shape
    M = w.shape[0]
    nch = 1
    if M * K >= PARALLEL_MIN_ELEMS:
        nthr = _nthreads()
        if nthr > 1:
            nch = min(M, 8 * nthr)
    fam = _FAMILY[qt]
    bufs = _buffers(scratch, fam, n, K, nch)
    if fam <= 1:
        # K-quants (x as q8/256) or the 32-element formats (x as q8/32): the same call shape
        xq, xd, xs = _q8_activations(scratch, x, 256 if fam == 0 else 32, bufs, acts)
        rows, par = (_K if fam == 0 else _LEGACY)[qt]
        if nch > 1:
            _run_parallel(scratch, par, w, xq, xd, xs, out, bufs[3], bufs[4], bufs[5], nch)
        else:
            scratch.call(rows, w, xq, xd, xs, out, bufs[3][0], bufs[4][0], bufs[5][0], 0, M)
    elif qt == GGMLType.F32:
        if nch > 1:
            _run_parallel(scratch, KF.par_f32, x, w, out, nch)
        else:
            scratch.call(KF.rows_f32, x, w, out, 0, M)
    else:
        bf16 = qt == GGMLType.BF16
        if nch > 1:
            _run_parallel(scratch, KF.par_f16, x, w, out, bufs[0], bf16, nch)
        else:
            scratch.call(KF.rows_f16, x, w, out, bufs[0][0], bf16, 0, M)


def pool_sgemm():
    """numpy's OpenBLAS sgemm address, with OpenBLAS set to one thread on first
    use: it is then called from each of Numba's workers, which are the pool.
    None where LLAMBA_QUANT_POOL_SGEMM=0 or no OpenBLAS was found."""
    return _pool_sgemm() if USE_POOL_SGEMM else None


@functools.cache
def _pool_sgemm():
    sg = sgemm_address()
    if sg is not None:
        set_blas_threads(1)
        _prime_sgemm()
    return sg


def _prime_sgemm():
    """One sgemm of 128 x 4096 x 64 (2-5 ms), once, before the prompt tiles'.  numpy's
    OpenBLAS (0.3.31, Haswell kernels) runs the tiles' shapes at a third of its speed until
    some call of enough rows and width has run in the process, whatever came before and
    however many calls of those shapes follow; after one it stays fast (AMD EPYC, AVX2,
    one thread, 128 x 256 x 576 from x @ w.T: 11 GFLOP/s before, 35-41 after; 128 x 320 x
    4096 or 8 x 384 x 576 first did not do it, 128 x 384 x 576 or 128 x 4096 x 64 did).
    Measured, not understood.  SmolLM2 Q4_1 pp128, 2 threads: 98-104 -> 148-157 t/s."""
    np.ones((128, 64), np.float32) @ np.ones((4096, 64), np.float32).T


def _use_amx(K: int) -> bool:
    """Whether a bf16 prompt matmul of row length K runs on AMX tiles (quant/amx.py)."""
    return USE_AMX and K % 32 == 0


def _pack_bf16(x, scratch):
    """x as the bf16 pairs gemm_bf16 reads (rows padded to a multiple of its kernel's rows)."""
    n, K = x.shape
    rows = AMX.ROWS if _use_amx(K) else GB.ROWS
    xb = scratch.get("bf16x", (-(-n // rows) * rows, K // 2), np.uint32)
    GB.pack_x(x, xb)
    return xb


def _gemm_bf16(xb, n, W, out, scratch):
    """out = x @ W.T in bf16 products and fp32 sums (quant/gemm_bf16.py), x packed
    by _pack_bf16: twice the float32 peak, or on AMX tiles (quant/amx.py) where the
    CPU has them."""
    nt = numba.config.NUMBA_NUM_THREADS
    K = W.shape[-1]
    amx = _use_amx(K)
    kernel, rows = (AMX.gemm_amx_tiles, AMX.ROWS) if amx else (GB.gemm_bf16_tiles, GB.ROWS)
    _run_parallel(scratch, kernel, int(W.qtype), W.data, xb, n, out,
                  scratch.get("bf16f", (nt, GB.TILE, GB.chunk_cols(K))),
                  scratch.get("bf16w", (nt, K // 2, GB.TILE), np.uint32),
                  scratch.get("bf16c", (nt, rows, GB.TILE)),
                  scratch.get("bf16p", (nt, GB.TILE, 128), np.uint32))
    return out


def _matmul_large(x, W, out, scratch, bf16: bool = True):
    M, K = W.data.shape[0], W.shape[-1]
    n = x.shape[0]
    if bf16 and bf16_path(n, W.qtype, K):
        return _gemm_bf16(_pack_bf16(x, scratch), n, W, out, scratch)
    sg = pool_sgemm()
    if sg is not None:
        # dequantize + single-threaded sgemm per tile, in Numba's pool (quant/gemm_tiles.py)
        nthr = _nthreads()
        tile = tile_rows(M, nthr)
        wbuf = scratch.get("wtiles", (numba.config.NUMBA_NUM_THREADS, tile, K))
        _run_parallel(scratch, gemm_tiles, sg[0], sg[1], int(W.qtype), W.data, x, out, wbuf, tile)
        return out
    if W.qtype == GGMLType.F32:
        np.matmul(x, _kernel_view(W).T, out=out)
        return out
    tile = min(TILE_ROWS, M)
    wt = scratch.get("wtile", (tile, K))
    yt = scratch.get("ytile", (n, tile))
    qt = int(W.qtype)
    for m0 in range(0, M, tile):
        m1 = min(M, m0 + tile)
        w = wt[: m1 - m0]
        deq_range_kernel(qt, W.data, m0, w, 32)
        if m1 - m0 == tile:
            np.matmul(x, w.T, out=yt)
            out[:, m0:m1] = yt
        else:
            out[:, m0:m1] = x @ w.T
    return out


def matmul_into(x: np.ndarray, W: QTensor, out: np.ndarray, scratch: Scratch) -> np.ndarray:
    """y = x @ W.T into out, without argument checks (hot path).

    x: float32 [n, K] C-contiguous; out: float32 [n, M] C-contiguous; W: 2-D QTensor.
    """
    if _sgemm_path(x.shape[0], W.qtype):
        return _matmul_large(x, W, out, scratch)
    _small_batch(x, W, out, scratch, {})
    return out


def _sgemm_path(n: int, qtype) -> bool:
    """Whether n rows of x go through dequantize-tile + sgemm (x kept in float32).

    The VNNI kernels' row groups could take prompts too, as llama.cpp's int8
    path does.  Measured (an opt-in until session 30, removed then): faster
    than float32 sgemm (2 threads, pp512: Qwen2.5-0.5B 239/247 vs 199/209 t/s)
    but no faster than the bfloat16 path, and 8-bit activations cost accuracy:
    against HF transformers over a 256-token text, top-1 agreement fell from
    100% to 97.7% (SmolLM2) and 97.3% (gemma3), mean KL from 4e-7 to 3-5e-3."""
    return n >= LARGE_BATCH_MIN


def bf16_path(n: int, qtype, K: int) -> bool:
    """Whether n rows of x against this weight type run the bfloat16 prompt
    kernel (x and the dequantized weights rounded to bf16, sums in fp32)."""
    return BF16_PREFILL and n >= LARGE_BATCH_MIN and qtype in _BF16_TYPES and K % 2 == 0


def matmul_dequant(x: np.ndarray, W: QTensor, out: np.ndarray | None = None) -> np.ndarray:
    """y = x @ dequantize(W).T with x kept in float32 (dequantize a tile, sgemm)
    at any row count: the float reference path, for tests and comparisons."""
    _check(x, W, out)
    x = np.ascontiguousarray(x)
    if out is None:
        out = np.empty((x.shape[0], W.shape[0]), np.float32)
    return _matmul_large(x, W, out, default_scratch(), bf16=False)


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
    n = x.shape[0]
    for W, o in zip(Ws, outs):
        _check(x, W, o)
    outs = [np.empty((n, W.shape[0]), np.float32) if o is None else o for W, o in zip(Ws, outs)]
    tgts = [o if o.flags.c_contiguous else np.empty(o.shape, np.float32) for o in outs]
    matmul_multi_into(x, Ws, tgts, scratch)
    for o, t in zip(outs, tgts):
        if t is not o:
            o[...] = t
    return outs


def matmul_multi_into(x: np.ndarray, Ws, outs, scratch: Scratch):
    """matmul_multi without argument checks or allocation (hot path): x float32
    [n, K] C-contiguous, outs float32 [n, M_i] C-contiguous."""
    n = x.shape[0]
    if n >= LARGE_BATCH_MIN and any(_sgemm_path(n, W.qtype) for W in Ws):
        xb = None       # x packed to bf16 once for all the weights that take that path
        for W, o in zip(Ws, outs):
            if bf16_path(n, W.qtype, x.shape[1]):
                if xb is None:
                    xb = _pack_bf16(x, scratch)
                _gemm_bf16(xb, n, W, o, scratch)
            else:
                matmul_into(x, W, o, scratch)
    elif not _fused(x, Ws, outs, scratch):
        acts = {}
        for W, o in zip(Ws, outs):
            _small_batch(x, W, o, scratch, acts)
    return outs


def _fused(x, Ws, outs, scratch) -> bool:
    """Run same-type weights in one parallel region (one thread-pool wake-up
    instead of one per weight).  False when it does not apply."""
    qt = Ws[0].qtype
    fn = _MULTI.get(qt)
    same = all(W.qtype == qt for W in Ws)
    # Q4_K with Q6_K (q/k/v of Q4_K_M files): one region too, on one quantization
    mixed_kq = not same and USE_VNNI and all(_VNNI_KIND.get(W.qtype, -1) >= 10 for W in Ws)
    if not mixed_kq and (fn is None or len(Ws) < 2 or not same):
        return False
    n, K = x.shape
    total = sum(W.data.shape[0] for W in Ws)
    nthr = _nthreads()
    if nthr < 2 or total * K < PARALLEL_MIN_ELEMS:
        return False
    key = ("multi", tuple(W.data.shape[0] for W in Ws), nthr)
    plan = scratch._sets.get(key)
    if plan is None:
        # chunks of about total / (8 threads) rows, never straddling two weights
        per = max(1, -(-total // (8 * nthr)))
        cw, c0, c1 = [], [], []
        for i, W in enumerate(Ws):
            M = W.data.shape[0]
            for m0 in range(0, M, per):
                cw.append(i)
                c0.append(m0)
                c1.append(min(M, m0 + per))
        plan = scratch._sets[key] = (np.array(cw, np.int64), np.array(c0, np.int64), np.array(c1, np.int64))
    cw, c0, c1 = plan
    nch = cw.size
    if mixed_kq:
        bufs = _vnni_buffers(scratch, "k", n, K, nch)
        key = ("kinds",) + tuple(W.qtype for W in Ws)
        kinds_a = scratch._sets.get(key)
        if kinds_a is None:
            kinds_a = scratch._sets[key] = np.array([_VNNI_KIND[W.qtype] for W in Ws], np.int64)
        scratch.call(quantize_q8_256_i8, x, bufs[0], bufs[5], *bufs[1:4], bufs[6])
        _run_parallel(scratch, KV.multi_kq, kinds_a, tuple(W.data for W in Ws), bufs[0], bufs[5], bufs[1], bufs[6], bufs[3],
                      tuple(outs), bufs[4], n, K,
                      cw, c0, c1)
        return True
    kind = _vnni_kind(qt, n, K) if USE_VNNI else None
    if kind is not None:
        bufs = _vnni_buffers(scratch, _family(kind), n, K, nch)
        xa = _vnni_activations(scratch, x, kind, bufs, {})
        _run_parallel(scratch, KV.grp_multi if _vnni_grouped(kind, n) else KV.multi_any, kind, tuple(W.data for W in Ws), *xa, tuple(outs), bufs[4], n, K,
                      cw, c0, c1)
        return True
    fam = _FAMILY[qt]
    bufs = _buffers(scratch, fam, n, K, nch)
    xa = _q8_activations(scratch, x, 256 if fam == 0 else 32, bufs, {})
    _run_parallel(scratch, fn, tuple(W.data for W in Ws), *xa, tuple(outs), bufs[3], bufs[4], bufs[5], cw, c0, c1)
    return True


def activation_block(qtype, n: int) -> int:
    """Block size of the 8-bit activation quantization matmul uses for this
    weight type and row count, 0 when x stays float32 (what the accuracy bound
    in the tests depends on)."""
    if _sgemm_path(n, qtype):
        return 0
    t = GGMLType(qtype)
    return 256 if t in _K else 32 if t in _LEGACY else 0


def matmul_float_fma(x, W, out, scratch):
    """The float-FMA alternative to the integer kernels (dequantize each W row
    to float32, FMA with float32 x), kept so the benchmark can show why the
    integer kernels are the default."""
    w = _kernel_view(W) if W.qtype not in _K and W.qtype not in _LEGACY else W.data
    if W.qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        return matmul_into(x, W, out, scratch)
    M, K = W.data.shape[0], x.shape[1]
    nthr = numba.get_num_threads()
    nch = min(M, 8 * nthr) if nthr > 1 and M * K >= PARALLEL_MIN_ELEMS else 1
    bufs = scratch.get("fmarow", (nch, K))
    if nch > 1:
        _run_parallel(scratch, KF.par_dequant_fma, int(W.qtype), x, w, out, bufs, 32, nch)
    else:
        scratch.call(KF.rows_dequant_fma, int(W.qtype), x, w, out, bufs[0], 32, 0, M)
    return out


def kernel_name(qtype, n: int, K: int = 1) -> str:
    """Which kernel matmul uses for this type, row count and row length (for the benchmark)."""
    if _sgemm_path(n, qtype):
        return "dequant-tile+sgemm"
    t = GGMLType(qtype)
    if USE_VNNI and t in _VNNI_KIND:
        return f"vnni u8xs8-dot, x as q8/{256 if _VNNI_KIND[t] >= 10 else 32}" + (
            ", 4 blocks a step" if _vnni_kind(t, n, K) == QUAD else "")
    if t in _K:
        return "int16-dot, x as q8/256"
    if t in _LEGACY:
        return "int16-dot, x as q8/32"
    return "f32-dot" if t == GGMLType.F32 else "widen-row+f32-dot"
