"""Quantized weights on an NVIDIA GPU (CuPy): upload in GGUF block layout, and
the kernels that compute with them.

DeviceWeight            a weight's blocks in device memory, byte for byte as in the file
upload(qt)              QTensor -> DeviceWeight (one copy; nothing dequantized)
matmul(x, [W..], [y..]) y = x @ W.T for each W (same input x, float32 [n, K]):
                        n <= MV_MAX_ROWS (decode, speculative verify): quantized W by
                        the integer path (INT8_MATVEC, the default): x rounded to int8
                        per block of W's family as the CPU backend does (32 values for
                        the legacy formats, 256 for the K-quants), dp4a dot products
                        (qint8.cuh: q8_act, mvs; qmvk.cuh: mvk); F16/BF16/F32 W:
                        float32 x and sums, each row's 16-byte words straight into
                        registers (qfloat.cuh: mvf); quantized W with LLAMBA_CUDA_INT8=0:
                        a float32 matvec that decodes each row's blocks once in registers
                        for all n rows of x (qkernels.cu: mv);
                        larger n: W is dequantized to fp16 one tile of rows at a time into
                        a reusable scratch and multiplied on the tensor cores by cuBLAS
                        (fp32 accumulate and output).  Only the tile lives in fp16.
embed_rows(W, ids, out) rows of W (token ids on the device) as float32
DeviceExperts           a layer's experts [E, M, K] in one buffer (upload of a 3-D tensor)
moe_route, matvec_ids,  a mixture of experts at decode without the host (qmoe.cuh): the
moe_combine             router's top-k on the device, the chosen experts' matvecs by ids
                        read from device memory, their weighted sum

CUDA sources: qblocks.cuh (each type's block decoder), qint8.cuh (the integer path),
qmvk.cuh (its register-pipelined matvec), qfloat.cuh (float weights), qmoe.cuh (experts
by id) and qkernels.cu.
Kernels are
compiled by NVRTC through cupy.RawModule, one module per type on first use, with no
architecture-specific code beyond what sm_75 has (except the weight loads' L2 cache hints,
W_HINT, which compile to plain loads below sm_80, and the programmatic-dependent-launch
waits of pdl.cuh, nothing below sm_90).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..tensor import QTensor
from ..types import QK_K, GGMLType

import cupy as cp

from . import pdl

_DIR = Path(__file__).resolve().parent
MV_MAX_ROWS = 8
# the op before a matmul (RMSNorm, GLU) that the integer path and the prompt GEMM fold
# into their activations' rounding
PROLOGUES = {"rmsnorm": 1, "silu": 2, "gelu": 3}
# output rows per block of the matvec kernel when x has 1-2 rows (their activations
# stay in registers across these rows); more x rows: one output row per block
ROWS_PER_BLOCK = 4
# fp16 elements a dequantized GEMM tile may hold (128 MiB)
GEMM_TILE_ELEMS = 64 << 20
# threads a block of deq_f16 (its shared-memory stretch is sized for this many parts)
DEQ_THREADS = 256

STRUCT = {
    GGMLType.F32: "TF32", GGMLType.F16: "TF16", GGMLType.BF16: "TBF16",
    GGMLType.Q4_0: "TQ4_0", GGMLType.Q4_1: "TQ4_1", GGMLType.Q5_0: "TQ5_0", GGMLType.Q5_1: "TQ5_1",
    GGMLType.Q8_0: "TQ8_0", GGMLType.Q4_K: "TQ4_K", GGMLType.Q5_K: "TQ5_K", GGMLType.Q6_K: "TQ6_K",
    GGMLType.MXFP4: "TMXFP4",
}
# (elements, bytes) of the kernels' block: the float types are read as blocks of 32
_KBLOCK = {GGMLType.F32: (32, 128), GGMLType.F16: (32, 64), GGMLType.BF16: (32, 64),
           GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22),
           GGMLType.Q5_1: (32, 24), GGMLType.Q8_0: (32, 34), GGMLType.Q4_K: (256, 144),
           GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210), GGMLType.MXFP4: (32, 17)}

_OPTIONS = ("-std=c++17", f"-I{_DIR}", f"-DDEQ_THREADS={DEQ_THREADS}")

# Integer decode path (int8 activations per block of the weight's family, dp4a): the
# quantized types.  Activations are rounded as the CPU backend's small-batch path rounds
# them (quant/act_quant.py: 32-value blocks for the legacy formats, 256 for the K-quants),
# so decode logits match the CPU backend's, not its float32 reference (~1e-2 away).
INT8_STRUCT = {GGMLType.Q4_0: "IQ4_0", GGMLType.Q4_1: "IQ4_1", GGMLType.Q5_0: "IQ5_0", GGMLType.Q5_1: "IQ5_1",
               GGMLType.Q8_0: "IQ8_0", GGMLType.Q4_K: "IQ4_K", GGMLType.Q5_K: "IQ5_K", GGMLType.Q6_K: "IQ6_K",
               GGMLType.MXFP4: "IMXFP4"}
INT8_MAX_ROWS = MV_MAX_ROWS
INT8_MATVEC = os.environ.get("LLAMBA_CUDA_INT8", "1") != "0"
# output rows per warp of the integer matvec for 1-2 rows of x (fewer for more rows:
# registers); tuned on the H200 with bench_gpu --micro --rpw-int8.  Matrices of at most
# INT8_SMALL_M rows take 2 a warp: twice the warps in flight (H200, 1024x4096 Q4_K:
# 382 -> 496 GB/s; 14336x4096: 2089 at 4 vs 2046 at 2).  Rows a warp never change a sum.
INT8_ROWS_PER_WARP = 4
INT8_SMALL_M = 4096
# (L8 decode graph, H200: Q8_0 2.730 ms at 2, 2.863 at 1, 2.853 at 4; NOTES.md session 28)
INT8_ROWS_SMALL = int(os.environ.get("LLAMBA_INT8_RS", "2"))
MVS_WARPS = 4               # warps a block of the integer matvec (qint8.cuh)
MVF_WARPS = 4               # and of the float-weight matvec (qfloat.cuh)
# which integer matvec kernel: "mvk" (the default: the types in MVK_ON by qmvk.cuh, the
# other types by mvs) or "mvs" for all (chunk bytes staged through registers, one chunk of
# each warp's rows in flight; the decode megakernel in tests/lab runs only with it).
# mvk's sums are its own.  LLAMBA_CUDA_MV=mvs picks mvs, for A/B runs.  (A cp.async
# pipelined mvs, "mvp", gave mvs's sums bit for bit and no speed: removed, NOTES.md.)
INT8_KERNEL = os.environ.get("LLAMBA_CUDA_MV", "mvk")
# the decode matvec of float weights (F16, BF16, F32; rows of whole 16-byte words): "mvf"
# (qfloat.cuh: 16-byte words of each warp's rows straight into registers, a group ahead)
# or "mv" (the generic kernel every type has; LLAMBA_CUDA_FMV=mv)
FLOAT_MV = os.environ.get("LLAMBA_CUDA_FMV", "mvf")
MVF_TYPES = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}
# mvf: word steps a group (loads a lane a row a group ahead), rows a warp for 1-2 rows of
# x above / at most INT8_SMALL_M rows (never a change to a sum).  H200, L8 F16 decode
# graph: 4.614 ms at (2, 4, 1); R 2 at <= 4096 rows 4.740, U 1 4.846, U 4 4.933 (NOTES.md)
MVF_U = int(os.environ.get("LLAMBA_MVF_U", "2"))
MVF_ROWS = int(os.environ.get("LLAMBA_MVF_R", "4"))
MVF_ROWS_SMALL = int(os.environ.get("LLAMBA_MVF_RS", "1"))
# mvk (qmvk.cuh): weights straight into registers, a persistent grid; the types it has
# (others take mvs under it).  Its sums are its own (not mvs's), batch invariant like them.
# Q4_K: mvk4k; Q6_K, Q4_0: mvkt<policy> (Q4_0 where K % 256 == 0: 8-block units of 144
# bytes, 16-byte aligned; other widths take mvs).  MVK_ON: the types mvk takes
# (LLAMBA_MVK_TYPES, names; the rest take mvs).  Default all three, under MVK_RULES (Q15
# Q4_0 decode graph 1.376 -> 1.150 ms; Q6_K, once decode steps used programmatic dependent
# launch: Q4_K_M graph L8 2.2516 -> 2.1958 ms, Q15 1.0793 -> 1.0210).
MVK_TYPES = {GGMLType.Q4_K: "mvk4k", GGMLType.Q6_K: "MQ6_K", GGMLType.Q4_0: "MQ4_0"}
MVK_ON = {GGMLType[t] for t in os.environ.get("LLAMBA_MVK_TYPES", "Q4_K,Q4_0,Q6_K").split(",") if t}
# and of those, by W's shape, where mvk measured faster than mvs (H200, NOTES.md): Q6_K with
# at most MVK_Q6K_MAX_M rows (1536x8960 +19%, 1024x4096 +4%; 4096x14336 -8%, the outputs
# 128256x4096 / 151936x1536 -13%); Q4_0 but 4096 x 4096 and smaller at K = 4096 (-13% at
# 4096x4096; 14336x4096 +0.5%, 4096x14336 +1%, 8960x1536 +7%, 1536x8960 +10%).  MVK_RULES
# False: every shape of the types on (tests, sweeps).  A property of W alone: batch invariant.
MVK_RULES = os.environ.get("LLAMBA_MVK_RULES", "1") != "0"
MVK_Q6K_MAX_M = 2048
MVK_WARPS = 4
# rows a warp for 1-2 rows of x (1 for more: registers); never changes a sum
MVK_ROWS = int(os.environ.get("LLAMBA_MVK_R", "2"))
# Q6_K's (its per-lane words take twice Q4_K's registers)
MVK_ROWS6 = int(os.environ.get("LLAMBA_MVK_R6", "1"))
# resident blocks an SM the persistent grid assumes (0: the occupancy the kernel has)
MVK_BPS = int(os.environ.get("LLAMBA_MVK_BPS", "0"))
# pipeline stages (S - 1 steps of loads in flight); variant bits: 1 = tasks interleaved
# over the warps (else a contiguous range a warp), 2 = 2 lanes a Q4_K block (else 4; only
# where K >= MVK_WIDE_K, since a step is then 16 blocks of a row)
MVK_STAGES = int(os.environ.get("LLAMBA_MVK_S", "2"))
MVK_V = int(os.environ.get("LLAMBA_MVK_V", "1"))
MVK_WIDE_K = 4096
# cache hints on the matvecs' weight loads (mvs, mvk; qint8.cuh ldg_w; sm_80+, the plain
# load below): W_HINT 0 none, 1 .L2::256B prefetch size, 2 .L2::128B, 3 L2 evict_first,
# 4 both 1 and 3, 5 both 2 and 3 (LLAMBA_CUDA_WHINT); W_PF > 0: mvk prefetches
# (prefetch.global.L2) each warp's weights that many steps ahead (LLAMBA_CUDA_WPF).
# Neither changes a sum.  Default 5 (H200, NOTES.md 2026-12-01: decode graph L8 Q4_K_M
# 2.562 -> 2.425 ms, Q15 1.378 -> 1.267 ms; Q4_K 14336x4096 2487 -> 2553 GB/s); W_PF
# measured 9-12% slower at 2-8 steps, off.
W_HINT = int(os.environ.get("LLAMBA_CUDA_WHINT", "5"))
W_PF = int(os.environ.get("LLAMBA_CUDA_WPF", "0"))
# compile each kernel on first use in a module of its own instead of a type's whole set
# at once (LLAMBA_CUDA_LAZY=1: sweeps and tests on a fresh machine compile far less)
COMPILE_LAZY = os.environ.get("LLAMBA_CUDA_LAZY", "0") == "1"
# Mixture of experts at decode (qmoe.cuh): routers of at most this many experts, at most
# this many chosen a token, take the device-routed path (moe_ids_ok); threads a block of
# moe_route_q8 (8 warps rounding x, one routing)
MOE_MAX_EXPERTS = 512
MOE_MAX_TOPK = 32
ROUTE_THREADS = 288


class DeviceWeight:
    """A weight matrix [M, K] in device memory, in its GGUF block layout."""

    __slots__ = ("name", "qtype", "shape", "data", "row_nbytes")

    def __init__(self, name, qtype, shape, data, row_nbytes):
        self.name, self.qtype, self.shape, self.data, self.row_nbytes = name, qtype, shape, data, row_nbytes

    @property
    def nbytes(self) -> int:
        return int(self.shape[0]) * int(self.row_nbytes)

    def __repr__(self):
        return f"DeviceWeight({self.name!r}, {self.qtype.name}, shape={self.shape})"


class DeviceExperts(list):
    """A layer's experts [E, M, K] in one device buffer `data`, expert e's rows from byte
    e * stride: a list of a DeviceWeight view an expert (what the host-routed path runs,
    one matmul an expert) that the id-indexed kernels (matvec_ids) read as one tensor."""

    def __init__(self, views, data, stride: int):
        super().__init__(views)
        self.data, self.stride = data, int(stride)

    @property
    def qtype(self):
        return self[0].qtype

    @property
    def shape(self):            # one expert's (M, K)
        return self[0].shape

    @property
    def row_nbytes(self):
        return self[0].row_nbytes


def kernel_supports(qt: QTensor) -> bool:
    """True when the GPU kernels take this tensor as a matrix (rows of whole kernel blocks)."""
    return qt.qtype in STRUCT and len(qt.shape) == 2 and qt.shape[-1] % _KBLOCK[qt.qtype][0] == 0


# bytes past the last row that the integer matvec's aligned 16-byte loads may touch
_PAD = 16


def upload(qt: QTensor) -> DeviceWeight:
    host = np.ascontiguousarray(qt.data).reshape(-1).view(np.uint8)
    data = cp.zeros(host.size + _PAD, cp.uint8)
    data[:host.size].set(host)
    return DeviceWeight(qt.name, qt.qtype, tuple(qt.shape), data, qt.row_nbytes)


def source(path: Path, *headers: Path) -> str:
    """A kernel file's text for cupy.RawModule, headed by a hash of the headers it
    includes: CuPy keys its compiled-kernel cache on the text alone, so an edited
    header would otherwise load the old binary."""
    import hashlib
    h = hashlib.sha1(b"".join(Path(f).read_bytes() for f in headers)).hexdigest()[:16]
    return f"// headers {h}\n" + Path(path).read_text()


def kernel_source() -> str:
    """qkernels.cu with its headers' hash."""
    return source(_DIR / "qkernels.cu", _DIR / "qblocks.cuh", _DIR / "qint8.cuh", _DIR / "qmvk.cuh", _DIR / "qfloat.cuh",
                  _DIR / "qmoe.cuh", pdl.HEADER)


def _options():
    """NVRTC options of the matvec modules (the weight-load hints as defines)."""
    return (_OPTIONS + ((f"-DLLAMBA_WHINT={W_HINT}",) if W_HINT else ()) + ((f"-DLLAMBA_WPF={W_PF}",) if W_PF else ())
            + (f"-DMVF_U={MVF_U}",) + pdl.options())


class _Lazy(dict):
    """A type's kernels compiled one at a time on first use (COMPILE_LAZY)."""

    def __init__(self, options):
        super().__init__()
        self.options = options

    def __missing__(self, name):
        mod = cp.RawModule(code=kernel_source(), options=self.options, name_expressions=[name])
        f = self[name] = pdl.Kernel(mod.get_function(name))
        return f


class _Modules:
    """One compiled module per weight type, built on first use."""

    def __init__(self):
        self.by_type = {}
        self.ids_by_type = {}   # the id-indexed matvecs (matvec_ids), compiled one by one on first use
        self.misc = {}          # pdl.MODE -> the q8_act module (the trigger's place is compiled in)

    @staticmethod
    def _key(qtype):
        return (qtype, _int8_kernel(), INT8_ROWS_PER_WARP, MVK_ROWS, MVK_ROWS6, MVK_STAGES, MVK_V, MVK_RULES,
                tuple(sorted(t.value for t in MVK_ON)), W_HINT, W_PF, COMPILE_LAZY, pdl.MODE, MVF_U, MVF_ROWS,
                MVF_ROWS_SMALL, INT8_ROWS_SMALL)

    def ids(self, qtype):
        """A type's id-indexed matvecs (qmoe.cuh), each compiled when first asked for: a
        model uses one or two of them, and only a mixture of experts any."""
        key = self._key(qtype)
        m = self.ids_by_type.get(key)
        if m is None:
            m = self.ids_by_type[key] = _Lazy(_options())
        return m

    def get(self, qtype):
        key = self._key(qtype)
        m = self.by_type.get(key)
        if m is None and COMPILE_LAZY:
            m = self.by_type[key] = _Lazy(_options())
        if m is None:
            s = STRUCT[qtype]
            names = ([f"mv<{s},{r},{_rpw(r)}>" for r in range(1, MV_MAX_ROWS + 1)]
                     + (sorted({_int8_name(qtype, r, M, K) for r in range(1, INT8_MAX_ROWS + 1) for M in (1, 4096, 1 << 30)
                                for K in (32, 256, 4096, 1 << 30)})
                        if qtype in INT8_STRUCT else [])
                     + (sorted({_mvf_name(qtype, r, M) for r in range(1, MV_MAX_ROWS + 1) for M in (1, 1 << 30)})
                        if qtype in MVF_TYPES else [])
                     + [f"deq_f16<{s}>", f"deq_rows<{s}>"])
            src = kernel_source()
            mod = cp.RawModule(code=src, options=_options(), name_expressions=names)
            m = self.by_type[key] = {n: pdl.Kernel(mod.get_function(n)) for n in names}
        return m

    def fn(self, name):
        """A kernel of no weight type: the activations' rounding, add_bias."""
        fns = self.misc.get(pdl.MODE)
        if fns is None:
            names = ([f"q8_act<{bs},{p}>" for bs in (32, 256) for p in range(4)] + [f"f16_act<{p}>" for p in range(4)]
                     + [f"moe_route_q8<{bs}>" for bs in (32, 256)])
            mod = cp.RawModule(code=kernel_source(), options=_OPTIONS + pdl.options(), name_expressions=names)
            fns = self.misc[pdl.MODE] = (mod, {})
        mod, got = fns
        f = got.get(name)
        if f is None:
            f = got[name] = pdl.Kernel(mod.get_function(name))
        return f


_mods = _Modules()


def _rpw(nrows: int) -> int:
    return ROWS_PER_BLOCK if nrows <= 2 else 1


def _mvk_applies(qtype, K: int, M: int = 1) -> bool:
    """mvk takes W (the launch's largest M) of this type and shape (a property of the
    weights alone, never of x: batch invariance)."""
    if _int8_kernel() != "mvk" or qtype not in MVK_ON or qtype not in MVK_TYPES:
        return False
    if qtype == GGMLType.Q4_0 and K % 256:
        return False
    if MVK_RULES and qtype == GGMLType.Q6_K and M > MVK_Q6K_MAX_M:
        return False
    if MVK_RULES and qtype == GGMLType.Q4_0 and K == 4096 and M <= 4096:
        return False
    return True


def _rpw_int8(nrows: int, M: int, qtype=None, K: int = 1 << 30) -> int:
    if _mvk_applies(qtype, K, M):
        return (MVK_ROWS6 if qtype == GGMLType.Q6_K else MVK_ROWS) if nrows <= 2 else 1
    return _rows_a_warp(nrows, M, INT8_ROWS_SMALL, INT8_ROWS_PER_WARP)


def _rows_a_warp(nrows: int, M: int, small: int, big: int) -> int:
    """Output rows a warp of mvs / mvf for nrows of x: for 1-2 rows, `small` where W
    has at most INT8_SMALL_M rows, else `big`; fewer for more rows of x (registers)."""
    if nrows <= 2:
        return small if M <= INT8_SMALL_M else big
    return 2 if nrows <= 4 else 1


def _int8_name(qtype, nrows: int, M: int, K: int = 1 << 30) -> str:
    """The integer matvec kernel (instantiation) for nrows of x and W of M x K."""
    rpw = _rpw_int8(nrows, M, qtype, K)
    if _mvk_applies(qtype, K, M):
        if qtype != GGMLType.Q4_K:
            return f"mvkt<{MVK_TYPES[qtype]},{nrows},{rpw},{MVK_STAGES},{MVK_V & 1}>"
        v = MVK_V if K >= MVK_WIDE_K else MVK_V & ~2
        return f"{MVK_TYPES[qtype]}<{nrows},{rpw},{MVK_STAGES},{v}>"
    return f"mvs<{INT8_STRUCT[qtype]},{nrows},{rpw}>"


def _mvf_applies(qtype, K: int) -> bool:
    return FLOAT_MV == "mvf" and qtype in MVF_TYPES and K % 8 == 0


def _mvf_rows(nrows: int, M: int) -> int:
    return _rows_a_warp(nrows, M, MVF_ROWS_SMALL, MVF_ROWS)


def _mvf_name(qtype, nrows: int, M: int) -> str:
    """mvf's instantiation for nrows of x and W of M rows (rows a warp never change a sum)."""
    return f"mvf<{STRUCT[qtype]},{nrows},{_mvf_rows(nrows, M)}>"


_sms = None
_bps = {}


def _mvk_blocks(f, name) -> int:
    """Blocks of a persistent mvk grid: as many as are resident on the device at once."""
    global _sms
    if _sms is None:
        _sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    if MVK_BPS:
        return _sms * MVK_BPS
    key = (name, W_HINT, W_PF)           # the hints change the kernel's registers
    b = _bps.get(key)
    if b is None:
        try:
            from cupy.cuda import driver
            b = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(f.ptr, 32 * MVK_WARPS, 0))
        except Exception:
            regs = max(32, int(getattr(f, "num_regs", 128)))
            b = max(1, 65536 // (((regs * 32 + 255) // 256) * 256 * MVK_WARPS))
        b = _bps[key] = max(1, min(b, 16))
    return _sms * b


def set_rows_per_block(n: int) -> None:
    """For tuning: recompile the matvec kernels with n output rows per block."""
    global ROWS_PER_BLOCK
    ROWS_PER_BLOCK = n
    _mods.by_type.clear()


def _int8_kernel() -> str:
    """The integer matvec kernel in use ("mvk" or "mvs")."""
    assert INT8_KERNEL in ("mvs", "mvk"), INT8_KERNEL
    return INT8_KERNEL


def set_int8_kernel(name: str) -> None:
    """Select the integer matvec kernel ("mvs" or "mvk"); recompiled on next use."""
    global INT8_KERNEL
    assert name in ("mvs", "mvk"), name
    if name != INT8_KERNEL:
        INT8_KERNEL = name
        _mods.by_type.clear()


def set_weight_hints(hint: int, pf: int = 0) -> None:
    """Select the weight loads' cache hints (W_HINT) and mvk's L2 prefetch distance (W_PF);
    modules are keyed on them (compiled on next use)."""
    global W_HINT, W_PF
    W_HINT, W_PF = int(hint), int(pf)


def set_int8_rows_per_warp(n: int) -> None:
    """For tuning: recompile the integer matvec with n output rows per warp."""
    global INT8_ROWS_PER_WARP
    INT8_ROWS_PER_WARP = n
    _mods.by_type.clear()


def warm(qtype) -> None:
    """Compile the kernels of one type now (before a CUDA-graph capture, say)."""
    _mods.get(qtype)
    _mods.fn("f16_act<0>")


class Workspace:
    """Scratch, grown on demand and reused: fp16 tiles for the large-batch path, the
    integer path's quantized activations.  A keep buffer that grows is kept alive, not
    freed: a captured CUDA graph may still point at it.  The others (the prompt path's
    fp16 tiles, sized by the largest weight) are freed when they grow, which bumps
    `generation`: a graph captured before then is stale."""

    def __init__(self):
        self.w16 = None
        self.x16 = None
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)
        self._retired = []
        self.generation = 0

    def get(self, attr, n, dtype=None, keep=False):
        b = getattr(self, attr, None)
        if b is None or b.size < n:
            if keep and b is not None:
                self._retired.append(b)
            elif b is not None:
                self.generation += 1
            size = 1 << max(8, (max(n, 1) - 1).bit_length()) if keep else max(n, 1)
            b = cp.empty(size, dtype or cp.float16)
            setattr(self, attr, b)
        return b[:n]


_default_ws = Workspace()


def int8_ok(W) -> bool:
    return W.qtype in INT8_STRUCT and W.shape[1] % _KBLOCK[W.qtype][0] == 0


def int8_applies(n: int, Ws) -> bool:
    """True when matmul takes x of n rows through the integer path for all of Ws (then
    it can fold any prologue into the activations' quantization)."""
    return INT8_MATVEC and n <= INT8_MAX_ROWS and all(int8_ok(W) for W in Ws)


def matmul(x, Ws, outs, biases=None, accumulate=False, ws: Workspace | None = None, prologue=None):
    """outs[i] (+)= f(x) @ Ws[i].T (+ biases[i]).  x float32 [n, K] C-contiguous on the device;
    outs[i] float32 [n, M_i] (rows may be strided: ldy = outs[i].strides[0] / 4).
    prologue (only where int8_applies(n, Ws) or gemm_applies(n)):
    f = ("rmsnorm", w, eps) or ("silu"|"gelu", u); otherwise f is the identity."""
    n, K = x.shape
    biases = list(biases) if biases else [None] * len(Ws)
    ws = ws or _default_ws
    if int8_applies(n, Ws):
        matvec_int8(x, Ws, outs, biases, accumulate, ws, prologue)
    elif gemm_applies(n):
        _gemms(x, Ws, outs, biases, accumulate, ws, prologue)
    else:
        assert prologue is None, "the float matvec folds no prologue (the caller runs the op first)"
        q = [i for i, W in enumerate(Ws) if INT8_MATVEC and int8_ok(W)]
        f = [i for i in range(len(Ws)) if i not in q]
        if q:
            matvec_int8(x, [Ws[i] for i in q], [outs[i] for i in q], [biases[i] for i in q], accumulate, ws)
        if f:
            _matvec(x, [Ws[i] for i in f], [outs[i] for i in f], [biases[i] for i in f], accumulate)


def gemm_applies(n: int) -> bool:
    """True when matmul takes x of n rows through cuBLAS (prompts), which folds any
    prologue into the activations' fp16 conversion."""
    return n > MV_MAX_ROWS


def _ptr(a):
    return 0 if a is None else a.data.ptr


def _prologue_args(prologue):
    """(kernel prologue code, RMSNorm weight, GLU up operand, eps) for a prologue
    ("rmsnorm", w, eps) / ("silu" | "gelu", up) or None."""
    if prologue is None:
        return 0, None, None, 0.0
    pro = PROLOGUES[prologue[0]]
    if pro == 1:
        return pro, prologue[1], None, float(prologue[2])
    return pro, None, prologue[1], 0.0


def _matvec(x, Ws, outs, biases, accumulate):
    n, K = x.shape
    # one launch per group of up to three weights of one type
    i = 0
    while i < len(Ws):
        j = i + 1
        while j < len(Ws) and j - i < 3 and Ws[j].qtype == Ws[i].qtype:
            j += 1
        grp = list(range(i, j))
        W0 = Ws[i]
        pad = grp + [grp[0]] * (3 - len(grp))
        Ms = [Ws[k].shape[0] for k in grp] + [0] * (3 - len(grp))
        maxM = max(Ms)
        # mv's and mvf's arguments
        args = ([Ws[k].data for k in pad] + [outs[k] for k in pad]
                + [biases[k] if biases[k] is not None else np.uint64(0) for k in pad]
                + [np.int32(m) for m in Ms]
                + [np.int32(K), np.int64(W0.row_nbytes), x, np.int32(x.strides[0] // 4)]
                + [np.int32(outs[k].strides[0] // 4) for k in pad] + [np.int32(1 if accumulate else 0)])
        if _mvf_applies(W0.qtype, K):
            rpw = _mvf_rows(n, maxM)
            _mods.get(W0.qtype)[_mvf_name(W0.qtype, n, maxM)](
                ((maxM + rpw * MVF_WARPS - 1) // (rpw * MVF_WARPS), len(grp)), (32 * MVF_WARPS,), tuple(args))
            i = j
            continue
        rpw = _rpw(n)
        f = _mods.get(W0.qtype)[f"mv<{STRUCT[W0.qtype]},{n},{rpw}>"]
        grid = ((maxM + rpw - 1) // rpw, len(grp))
        threads = min(128, (_parts(W0.qtype, K) + 31) // 32 * 32)
        f(grid, (threads,), tuple(args))
        i = j


def quantize_act(x, block: int, ws: Workspace, prologue=None):
    """x float32 [n, K] (after the prologue, if any) as the integer path's activations:
    (int8 codes [n, K], steps [n, K/block], step * sum of codes per 16 [n, K/16])."""
    return _quantize_act(x, block, ws, prologue)[:3]


def _act_buffers(n: int, K: int, block: int, ws: Workspace):
    """The workspace's buffers for n rows of K activations rounded in blocks of `block`
    (q8_act's outputs; xi only for block 256)."""
    xq = ws.get(f"xq{block}", n * K, cp.int8, keep=True)
    xd = ws.get(f"xd{block}", n * K // block, cp.float32, keep=True)
    xs = ws.get(f"xs{block}", n * K // 16, cp.float32, keep=True)
    xi = ws.get(f"xi{block}", n * K // 16, cp.int16, keep=True) if block == 256 else None
    return xq, xd, xs, xi


def _quantize_act(x, block: int, ws: Workspace, prologue=None):
    """quantize_act's three, and for block 256 the codes' sums per 16 as int16 [n, K/16]
    in mvk's order (None for block 32)."""
    n, K = x.shape
    xq, xd, xs, xi = _act_buffers(n, K, block, ws)
    pro, pw, pu, eps = _prologue_args(prologue)
    assert pu is None or pu.strides[0] == x.strides[0]
    f = _mods.fn(f"q8_act<{block},{pro}>")
    f(((K + 2047) // 2048, n), (256,),
      (x, np.int32(x.strides[0] // 4), pw if pw is not None else np.uint64(0),
       pu if pu is not None else np.uint64(0), np.float32(eps), np.int32(K), xq, xd, xs,
       xi if xi is not None else np.uint64(0)))
    return xq, xd, xs, xi


def matvec_int8(x, Ws, outs, biases, accumulate, ws: Workspace, prologue=None):
    """The integer decode path (n <= INT8_MAX_ROWS rows of x): x quantized once per
    block size the weights need (with the prologue folded in), then one launch per
    group of up to three weights of one type."""
    n, K = x.shape
    biases = list(biases) if biases else [None] * len(Ws)
    acts = {}
    i = 0
    while i < len(Ws):
        j = i + 1
        while j < len(Ws) and j - i < 3 and Ws[j].qtype == Ws[i].qtype:
            j += 1
        grp = list(range(i, j))
        pad = grp + [grp[0]] * (3 - len(grp))
        W0 = Ws[i]
        block = _KBLOCK[W0.qtype][0]
        if block not in acts:
            acts[block] = _quantize_act(x, block, ws, prologue)
        xq, xd, xs, xi = acts[block]
        Ms = [Ws[k].shape[0] for k in grp] + [0] * (3 - len(grp))
        rpw = _rpw_int8(n, max(Ms), W0.qtype, K)
        name = _int8_name(W0.qtype, n, max(Ms), K)
        f = _mods.get(W0.qtype)[name]
        if name.startswith("mvk"):
            if xi is not None:
                xs = xi             # mvk reads the packed int16 run sums in xs's place
            tasks = sum((m + rpw - 1) // rpw for m in Ms)
            grid = (max(1, min((tasks + MVK_WARPS - 1) // MVK_WARPS, _mvk_blocks(f, name))),)
        else:
            grid = ((max(Ms) + rpw * MVS_WARPS - 1) // (rpw * MVS_WARPS), len(grp))
        args = ([Ws[k].data for k in pad] + [outs[k] for k in pad]
                + [biases[k] if biases[k] is not None else np.uint64(0) for k in pad]
                + [np.int32(m) for m in Ms]
                + [np.int32(K), np.int64(W0.row_nbytes), xq, xd, xs]
                + [np.int32(outs[k].strides[0] // 4) for k in pad] + [np.int32(1 if accumulate else 0)])
        f(grid, (32 * MVS_WARPS,), tuple(args))
        i = j


# ---------------------------------------------------------------- mixture of experts
def moe_ids_ok(experts, top_k: int) -> bool:
    """True when a decode step's moe op can run on the device alone (moe_route,
    matvec_ids, moe_combine): every expert tensor one DeviceExperts buffer of a type with an
    integer matvec, the router's width and top_k within the routing kernel's.  Not for
    float experts (F16/BF16/F32: no id-indexed mvf) or LLAMBA_CUDA_INT8=0."""
    return (INT8_MATVEC and all(isinstance(e, DeviceExperts) and int8_ok(e) for e in experts)
            and 1 <= top_k <= min(MOE_MAX_TOPK, len(experts[0])) and len(experts[0]) <= MOE_MAX_EXPERTS
            and experts[0].shape == experts[1].shape and experts[2].shape[1] == experts[0].shape[0])


def act_block(W) -> int:
    """Values a block of the integer path's activations for W's type (32 or 256)."""
    return _KBLOCK[W.qtype][0]


def moe_route(x, logits, top_k: int, norm: bool, ids, w, block: int, ws: Workspace):
    """Each row's top_k experts from the router's logits [n, E] (softmax, renormalized over
    the k when norm; runtime/backend/moe.py's route bit for bit) into ids int32 [n * top_k]
    (ascending a row) and w float32 [n * top_k], and x [n, K] (float32, C-contiguous) rounded
    for the integer path in blocks of `block`, in one launch (moe_route_q8).  Returns the
    activations as matvec_ids takes them ({block: (xq, xd, xs, xi)})."""
    n, K = x.shape
    E = logits.shape[1]
    assert logits.flags.c_contiguous and 1 <= top_k <= MOE_MAX_TOPK and E <= MOE_MAX_EXPERTS
    xq, xd, xs, xi = _act_buffers(n, K, block, ws)
    _mods.fn(f"moe_route_q8<{block}>")(
        ((K + 2047) // 2048, n), (ROUTE_THREADS,),
        (x, np.int32(x.strides[0] // 4), np.int32(K), xq, xd, xs, xi if xi is not None else np.uint64(0),
         logits, np.int32(E), np.int32(top_k), np.int32(1 if norm else 0), ids, w))
    return {block: (xq, xd, xs, xi)}


def _ids_name(qtype, M: int, K: int) -> str:
    """The id-indexed matvec for experts of M x K: the kernel family the host-routed path
    runs on one expert's matrix (_int8_name: mvk4k, mvkt or mvs, with their lanes and
    orders), so both give the same sums."""
    R = _rpw_int8(1, M, qtype, K)
    if _mvk_applies(qtype, K, M):
        if qtype != GGMLType.Q4_K:
            return f"mvkt_id<{MVK_TYPES[qtype]},{R},{MVK_STAGES},{MVK_V & 1}>"
        v = MVK_V if K >= MVK_WIDE_K else MVK_V & ~2
        return f"mvk4k_id<{R},{MVK_STAGES},{v}>"
    return f"mvs_id<{INT8_STRUCT[qtype]},{R}>"


def matvec_ids(x, Es, ids, outs, xdiv: int, ws: Workspace, prologue=None, acts=None):
    """outs[i][p] = f(x)[p // xdiv] @ Es[i][ids[p]].T for the P = len(ids) (row, slot) pairs
    p: each pair one row of x by its expert's matrix, the expert read from device memory
    (ids int32 [P]); outs[i] float32 [P, M] C-contiguous.  x float32 [n, K] on the device,
    rounded here with the prologue (as matmul's) unless acts (moe_route's) holds its
    rounding.  Es: DeviceExperts; two of one type and layout (gate and up) in one launch."""
    n, K = x.shape
    P = int(ids.shape[0])
    acts = dict(acts or {})
    i = 0
    while i < len(Es):
        E0 = Es[i]
        nsel = 2 if (i + 1 < len(Es) and Es[i + 1].qtype == E0.qtype and Es[i + 1].shape == E0.shape
                     and Es[i + 1].stride == E0.stride and Es[i + 1].row_nbytes == E0.row_nbytes) else 1
        M = E0.shape[0]
        assert E0.shape[1] == K and all(o.flags.c_contiguous and o.shape == (P, M) for o in outs[i:i + nsel])
        block = _KBLOCK[E0.qtype][0]
        if block not in acts:
            acts[block] = _quantize_act(x, block, ws, prologue)[:4]
        xq, xd, xs, xi = acts[block]
        name = _ids_name(E0.qtype, M, K)
        f = _mods.ids(E0.qtype)[name]
        R = _rpw_int8(1, M, E0.qtype, K)
        if name.startswith("mvk"):
            if xi is not None:
                xs = xi             # mvk reads the packed int16 run sums in xs's place
            tasks = nsel * P * ((M + R - 1) // R)
            grid = (max(1, min((tasks + MVK_WARPS - 1) // MVK_WARPS, _mvk_blocks(f, name))),)
        else:
            grid = ((M + R * MVS_WARPS - 1) // (R * MVS_WARPS), nsel * P)
        E1, y1 = Es[i + nsel - 1], outs[i + nsel - 1]
        f(grid, (32 * MVS_WARPS,),
          (E0.data, E1.data, outs[i], y1, np.int32(nsel), np.int32(M), np.int32(K), np.int64(E0.row_nbytes),
           np.int64(E0.stride), ids, np.int32(P), np.int32(xdiv), xq, xd, xs))
        i += nsel


def moe_combine(y, w, top_k: int, out, pos=None, accumulate=False):
    """out[t] (+)= sum over j < top_k, in order, of w[t * top_k + j] * y[r] with r =
    pos[t * top_k + j] (the host-routed path's grouped rows) or t * top_k + j (pos None):
    a row's experts in ascending order.  out float32 [n, d] C-contiguous."""
    n, d = out.shape
    assert out.flags.c_contiguous and y.flags.c_contiguous and y.shape[1] == d
    _launch1d(_mods.fn("moe_combine"), n * d,
              (y, pos if pos is not None else np.uint64(0), w, np.int32(n), np.int32(top_k), np.int32(d), out,
               np.int32(1 if accumulate else 0)))


def _launch1d(f, n, args, block=256):
    f(((n + block - 1) // block,), (block,), args)


def _parts(qtype, K: int) -> int:
    """Work items a row of K values takes in the dequantizing kernels (mv, deq_f16,
    deq_rows): one a quant block, eight a 256-value K-quant block."""
    qk = _KBLOCK[qtype][0]
    return K // qk * (8 if qk == QK_K else 1)


def _deq_f16(qtype, W, rows: int, K: int, row_bytes: int, out, mats=np.uint64(0), Me: int | None = None,
             mat_bytes: int = 0):
    """deq_f16: rows x K values of W (a device buffer or address) into out, fp16 [rows, K];
    with mats (device int32 address), out's rows are matrices mats[0], mats[1], ... of Me
    rows each, matrix i at W + i * mat_bytes (a layer's chosen experts)."""
    _launch1d(_mods.get(qtype)[f"deq_f16<{STRUCT[qtype]}>"], rows * _parts(qtype, K),
              (W, np.int32(rows), np.int32(K), np.int64(row_bytes), out, mats, np.int32(rows if Me is None else Me),
               np.int64(mat_bytes)), block=DEQ_THREADS)


def _gemms(x, Ws, outs, biases, accumulate, ws: Workspace, prologue=None):
    """The prompt path: x (after the prologue) converted to fp16 once for all of Ws, then
    each W dequantized to fp16 a tile of rows at a time for cuBLAS (fp16 x fp16 -> fp32)."""
    n, K = x.shape
    x16 = f16_activations(x, prologue, ws.get("x16", n * K))
    blas = _blas()
    handle = blas.on(cp.cuda.get_current_stream().ptr)
    for W, y, b in zip(Ws, outs, biases):
        _gemm(blas.gemm_ex, handle, x16, n, K, W, y, b, accumulate, ws)


def f16_activations(x, prologue, out):
    """out (fp16, n * K) = x [n, K] after the prologue, each value rounded to fp16 once
    (f16_act: the prompt GEMM's operand)."""
    n, K = x.shape
    pro, pw, pu, eps = _prologue_args(prologue)
    assert pu is None or pu.strides[0] == x.strides[0]
    assert K % 32 == 0, "f16_act converts whole 32-value groups (kernel_supports admits no other width)"
    _mods.fn(f"f16_act<{pro}>")(((K + 2047) // 2048, n), (256,),
                                (x, np.int32(x.strides[0] // 4), pw if pw is not None else np.uint64(0),
                                 pu if pu is not None else np.uint64(0), np.float32(eps), np.int32(K), out))
    return out


class _Cublas:
    """The cuBLAS calls of the prompt path, called through ctypes into the cuBLAS CuPy
    loaded: CuPy's bindings refuse to run while a stream is being captured (prompt chunks
    are replayed from CUDA graphs), cuBLAS itself does not.  Where the library is not
    found by name, CuPy's bindings (and prompt chunks stay eager: their capture fails).
    gemm_ex: one GEMM; gemm_batched: cublasGemmStridedBatchedEx (a mixture of experts'
    prompt, one call for many experts)."""

    def __init__(self):
        import ctypes
        import sys
        from cupy_backends.cuda.libs import cublas      # (loads the library)
        self.handles: dict = {}     # device -> [our handle, the stream it was last given]
        major = cp.cuda.runtime.runtimeGetVersion() // 1000
        try:
            lib = ctypes.CDLL(f"cublas64_{major}.dll" if sys.platform == "win32" else f"libcublas.so.{major}")
        except OSError:
            self.create, self.set_stream, self.gemm_ex = cublas.create, cublas.setStream, cublas.gemmEx
            self.gemm_batched = cublas.gemmStridedBatchedEx
            return
        v, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        create, set_stream, gemm = lib.cublasCreate_v2, lib.cublasSetStream_v2, lib.cublasGemmEx
        batched = lib.cublasGemmStridedBatchedEx
        create.argtypes, set_stream.argtypes = [ctypes.POINTER(v)], [v, v]
        gemm.argtypes = [v, i, i, i, i, i, v, v, i, i, v, i, i, v, v, i, i, i, i]
        batched.argtypes = [v, i, i, i, i, i, v, v, i, i, ll, v, i, i, ll, v, v, i, i, ll, i, i, i]
        create.restype = set_stream.restype = gemm.restype = batched.restype = i

        def check(rc, what):
            if rc != 0:
                raise RuntimeError(f"{what} failed (cublasStatus {rc})")

        def make():
            h = v()
            check(create(ctypes.byref(h)), "cublasCreate")
            return h.value
        self.create = make
        self.set_stream = lambda h, s: check(set_stream(h, s), "cublasSetStream")
        self.gemm_ex = lambda *a: check(gemm(*a), "cublasGemmEx")
        self.gemm_batched = lambda *a: check(batched(*a), "cublasGemmStridedBatchedEx")

    def on(self, stream: int) -> int:
        """Our own handle (no other code sets its stream) on `stream`; the stream is set
        only when it changes, so a step's GEMMs cost one call each."""
        dev = cp.cuda.runtime.getDevice()
        h = self.handles.get(dev)
        if h is None:
            h = self.handles[dev] = [self.create(), None]
        if h[1] != stream:
            self.set_stream(h[0], stream)
            h[1] = stream
        return h[0]


_cublas = None


def _blas() -> _Cublas:
    global _cublas
    if _cublas is None:
        _cublas = _Cublas()
    return _cublas


def _gemm(gemm_ex, handle, x16, n, K, W, y, bias, accumulate, ws: Workspace):
    M = W.shape[0]
    tile = max(1, min(M, GEMM_TILE_ELEMS // K))
    w16 = ws.get("w16", tile * K)
    ldy = y.strides[0] // 4
    beta = ws._one if accumulate else ws._zero
    base = W.data.data.ptr
    for r0 in range(0, M, tile):
        tm = min(tile, M - r0)
        _deq_f16(W.qtype, np.uint64(base + r0 * W.row_nbytes), tm, K, W.row_nbytes, w16)
        # row-major y[n, M] = x[n, K] @ w[M, K]^T  ==  column-major y^T = w^T(op T) x
        gemm_ex(handle, 1, 0, tm, n, K,
                ws._one.ctypes.data, w16.data.ptr, 2, K,
                x16.data.ptr, 2, K,
                beta.ctypes.data, y.data.ptr + 4 * r0, 0, ldy,
                68, -1)
        pdl.fence()         # cuBLAS's kernels never trigger: the next of ours goes out plain
    if bias is not None and not accumulate:
        _launch1d(_mods.fn("add_bias"), n * M, (y, bias, np.int32(n), np.int32(M), np.int32(ldy)))


def matmul_experts(x16, E: DeviceExperts, plan, y, ws: Workspace):
    """A mixture of experts' prompt: y [rows, M] = x16 [rows, K] @ E[e].T, the rows laid out
    in chunks of experts (plan: moe.ExpertChunks for E's M * K): chunk c's experts
    plan.experts[j0:j1] (device int32) hold plan.pad[c] rows each from row plan.base[c] on.
    A chunk is one launch dequantizing its experts to fp16 and one strided-batched cuBLAS
    GEMM (fp16 x fp16 -> fp32, as the dense prompt path's), not a matmul an expert: a
    128-expert layer was hundreds of launches from Python."""
    M, K = E.shape
    assert y.shape[1] == M and x16.size >= plan.rows * K
    blas = _blas()
    handle = blas.on(cp.cuda.get_current_stream().ptr)
    w16 = ws.get("w16", plan.most * M * K)
    ldy = y.strides[0] // 4
    ids = plan.experts_d
    for (j0, j1), base, pad in zip(plan.chunks, plan.base, plan.pad):
        ne = j1 - j0
        _deq_f16(E.qtype, E.data, ne * M, K, E[0].row_nbytes, w16, np.uint64(ids.data.ptr + 4 * j0), M, E.stride)
        # column-major y_e^T [M, pad] = w_e (op T) [M, K] x_e^T [K, pad], for each expert e of the chunk
        blas.gemm_batched(handle, 1, 0, M, pad, K,
                          ws._one.ctypes.data, w16.data.ptr, 2, K, M * K,
                          x16.data.ptr + 2 * base * K, 2, K, pad * K,
                          ws._zero.ctypes.data, y.data.ptr + 4 * base * ldy, 0, ldy, pad * ldy,
                          ne, 68, -1)
        pdl.fence()         # cuBLAS's kernels never trigger: the next of ours goes out plain


def embed_rows(W: DeviceWeight, ids, out, scale: float = 1.0):
    """out[i] = W[ids[i]] * scale; ids int32 on the device, out float32 [len(ids), K]."""
    n = ids.shape[0]
    K = W.shape[1]
    f = _mods.get(W.qtype)[f"deq_rows<{STRUCT[W.qtype]}>"]
    _launch1d(f, n * _parts(W.qtype, K), (W.data, ids, np.int32(n), np.int32(K), np.int64(W.row_nbytes),
                              np.float32(scale), out), block=128)


def dequantize_f16(W: DeviceWeight):
    """The whole of W as fp16 [M, K] (tests and debugging only: it is a full copy)."""
    M, K = W.shape
    out = cp.empty((M, K), cp.float16)
    _deq_f16(W.qtype, W.data, M, K, W.row_nbytes, out)
    return out
