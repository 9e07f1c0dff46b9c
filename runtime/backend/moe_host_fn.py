"""The CPU half of a `--cpu-moe` layer as one native function that CUDA calls from the
stream itself (a host node: cuLaunchHostFunc), so a decode step with its experts in
system memory is still one CUDA graph: the router on the GPU, its logits and the rows
copied down, this function, the sum copied up, the next layer, with no Python between.

`moe_rows` is CPUBackend._moe_fused (quant/moe_cpu.py's kernels, the same calls in the
same order on buffers of the same shapes, so the same bits) as a single Numba function;
`host_fn` (a C callback: no GIL, no Python) reads a descriptor of int64 words (`Desc`:
pointers and sizes, one a layer and row count) and calls it.  CUDA runs host functions
on a thread of its own, one at a time in stream order: the pinned staging rows are
shared by every layer, each layer's copy down, call and copy up ordered by the stream.
A host function must not call CUDA; this one touches only host memory.  Numba's thread
count is per calling thread, so the function sets its own (the backend's -t) each call.
"""
from __future__ import annotations

import numpy as np
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from quant import moe_cpu
from quant.act_quant import quantize_q8_256_i8, quantize_q8_32_i8  # noqa: F401  (kernels' callees)

from . import cpu_kernels as K
from . import moe

GLU_CODES = {"silu": 0, "gelu": 1, "swiglu_oai": 2}

# descriptor words
(N, D, E, FF, TOPK, NORM, KG, KU, KD, GLU, THREADS, HAS_BIAS,
 X, LOGITS, OUT, GW, UW, DW, GW_ROWB, UW_ROWB, DW_ROWB, GB, UB, DB, NDESC) = range(25)


# Numba's threading layer's own setter by its symbol (registered when the layer starts:
# host_fn starts it), not numba.set_num_threads, whose jitted form holds a ctypes pointer
# and so cannot be cached
_set_num_threads = types.ExternalFunction("set_num_threads", types.void(types.intc))


@intrinsic
def _ptr(typingctx, addr):
    """An int64 address as a void pointer (for carray)."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


@njit(cache=True, nogil=True)
def _act_bufs(fam, m, K_):
    """moe_cpu.act_buffers's six flat buffers, allocated here."""
    if fam == moe_cpu.K_FAM:
        return (np.empty(m * K_, np.int8), np.empty(m * K_, np.int8), np.empty(m * K_ // 256, np.float32),
                np.empty(m * K_ // 32, np.int32), np.empty(m * K_ // 16, np.int32), np.empty(m * K_ // 32, np.float32))
    xq, xsum = np.empty(m * K_, np.int8), np.empty(m * K_ // 32, np.int32)
    return xq, xq, np.empty(m * K_ // 32, np.float32), xsum, xsum, np.empty(m * K_ // 32, np.float32)


@njit(cache=True, nogil=True)
def _grp_bufs(fam, P, E_, K_):
    """moe_cpu.grp_buffers's, allocated here."""
    if fam == moe_cpu.K_FAM:
        return (np.empty(0, np.int8), np.empty(0, np.float32), np.empty(0, np.int32), np.empty(0, np.float32),
                np.empty(E_, np.int64))
    ng = P // 16 + E_ + 1
    nb = K_ // 32
    return (np.empty(ng * 16 * K_, np.int8), np.empty(ng * nb * 16, np.float32), np.empty(ng * nb * 16, np.int32),
            np.empty(ng * nb * 16, np.float32), np.empty(E_, np.int64))


@njit(cache=True, nogil=True)
def _rounded(fam, a, threads):
    """a's rows rounded into new flat buffers of family fam (CPUBackend._moe_fused's q8: rows
    in parallel chunks from 64 on; a row's codes depend on that row alone)."""
    bufs = _act_bufs(fam, a.shape[0], a.shape[1])
    nch = min(a.shape[0] // 32, 4 * threads)
    none = np.empty(0, np.int32)
    if nch > 1:
        moe_cpu.q8_rows_par(fam, a, none, bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5], nch)
    else:
        moe_cpu.q8_rows(fam, a, none, bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5])
    return bufs


@njit(cache=True, nogil=True)
def _glu(code, g, u):
    if code == 0:
        K.silu_mul(g, u)
    elif code == 1:
        K.gelu_mul(g, u)
    else:
        K.swiglu_oai_mul(g, u)


@njit(cache=True, nogil=True)
def moe_rows(x, logits, gw, uw, dw, kg, ku, kd, top_k, norm, glu, threads, gb, ub, db, has_bias, out):
    """out [n, d] = the moe op's weighted sum of the chosen experts for rows x [n, d]
    given the router's logits [n, E]: CPUBackend._moe_fused's calls, in its order."""
    n, d = x.shape
    E_ = logits.shape[1]
    ff = gw.shape[0] // E_
    P = n * top_k
    ids, w, pos = np.empty((n, top_k), np.int32), np.empty((n, top_k), np.float32), np.empty((n, top_k), np.int32)
    tokens, starts = np.empty(P, np.int32), np.empty(E_ + 1, np.int64)
    act, nact = np.empty(E_, np.int64), np.empty(1, np.int64)
    moe.route_group(logits, top_k, norm, ids, w, tokens, starts, pos, act, nact)
    target = 8 * threads
    res = np.empty((target + 2 * P + 16, 16), np.float32)
    fx = moe_cpu.K_FAM if kg == 10 or kg == 11 else moe_cpu.LEG_FAM      # (moe_cpu.family)
    fh = moe_cpu.K_FAM if kd == 10 or kd == 11 else moe_cpu.LEG_FAM
    # x rounded once a token, then gathered a pair
    sq, sq4, sd, sb, sb16, sbf = _rounded(fx, x, threads)
    xq, xq4, xd, xb, xb16, xbf = _act_bufs(fx, P, d)
    nch = min(P // 32, 4 * threads)
    if nch > 1:
        moe_cpu.q8_gather_par(fx, tokens, d, sq, sq4, sd, sb, sb16, sbf, xq, xq4, xd, xb, xb16, xbf, nch)
    else:
        moe_cpu.q8_gather(fx, tokens, d, sq, sq4, sd, sb, sb16, sbf, xq, xq4, xd, xb, xb16, xbf)
    gx = _grp_bufs(fx, P, E_, d)
    if fx == moe_cpu.LEG_FAM:
        moe_cpu.group_runs(d, starts, act, nact, xq, xd, xb16, xbf, gx[0], gx[1], gx[2], gx[3], gx[4])
    g, u = np.empty((P, ff), np.float32), np.empty((P, ff), np.float32)
    moe_cpu.gate_up(kg, ku, gw, uw, ff, d, xq, xq4, xd, xb16, xbf, gx, starts, act, nact, g, u, res, target)
    if has_bias:
        moe.add_run_bias(g, gb, starts, act, nact)
        moe.add_run_bias(u, ub, starts, act, nact)
    _glu(glu, g, u)
    hq, hq4, hd, hb, hb16, hbf = _rounded(fh, g, threads)
    gh = _grp_bufs(fh, P, E_, ff)
    if fh == moe_cpu.LEG_FAM:
        moe_cpu.group_runs(ff, starts, act, nact, hq, hd, hb16, hbf, gh[0], gh[1], gh[2], gh[3], gh[4])
    y = np.empty((P, d), np.float32)
    moe_cpu.down(kd, dw, d, ff, hq, hq4, hd, hb16, hbf, gh, starts, act, nact, y, res, target)
    if has_bias:
        moe.add_run_bias(y, db, starts, act, nact)
    moe.combine(y, pos, w, out)


@njit(cache=True, nogil=True)
def run_desc(dsc):
    """moe_rows on the arrays a descriptor (module docstring) names."""
    n, d, E_, ff = dsc[N], dsc[D], dsc[E], dsc[FF]
    _set_num_threads(np.intc(dsc[THREADS]))
    x = carray(_ptr(dsc[X]), (n, d), np.float32)
    logits = carray(_ptr(dsc[LOGITS]), (n, E_), np.float32)
    out = carray(_ptr(dsc[OUT]), (n, d), np.float32)
    gw = carray(_ptr(dsc[GW]), (E_ * ff, dsc[GW_ROWB]), np.uint8)
    uw = carray(_ptr(dsc[UW]), (E_ * ff, dsc[UW_ROWB]), np.uint8)
    dw = carray(_ptr(dsc[DW]), (E_ * d, dsc[DW_ROWB]), np.uint8)
    nb = 1 if dsc[HAS_BIAS] == 0 else E_
    gb = carray(_ptr(dsc[GB]), (nb, ff if dsc[HAS_BIAS] else 1), np.float32)
    ub = carray(_ptr(dsc[UB]), (nb, ff if dsc[HAS_BIAS] else 1), np.float32)
    db = carray(_ptr(dsc[DB]), (nb, d if dsc[HAS_BIAS] else 1), np.float32)
    moe_rows(x, logits, gw, uw, dw, dsc[KG], dsc[KU], dsc[KD], dsc[TOPK], dsc[NORM] != 0, dsc[GLU], dsc[THREADS],
             gb, ub, db, dsc[HAS_BIAS] != 0, out)


_NO_BIAS = np.zeros(1, np.float32)


def descriptor(n: int, x, logits, out, experts, top_k: int, norm: bool, kinds, glu: str, threads: int,
               biases=None) -> np.ndarray:
    """The int64 words run_desc reads for n rows: x, logits, out are host buffers (pinned,
    C-contiguous, at least n rows) that must outlive every use of the descriptor, as must
    the expert tensors (the CPU backend's `_Experts`) and biases ([E, cols] float32)."""
    gw, uw, dw = (e.whole.data for e in experts)
    E_ = len(experts[0])
    d, ff = x.shape[1], gw.shape[0] // E_
    assert logits.shape[1] == E_ and out.shape[1] == d and dw.shape[0] == E_ * d
    assert all(a.flags.c_contiguous and a.dtype == np.float32 and a.shape[0] >= n for a in (x, logits, out))
    if biases is not None:
        biases = [np.ascontiguousarray(b, np.float32) for b in biases]
        assert [b.shape for b in biases] == [(E_, ff), (E_, ff), (E_, d)]
    bp = [b.ctypes.data for b in biases] if biases is not None else [_NO_BIAS.ctypes.data] * 3
    words = {N: n, D: d, E: E_, FF: ff, TOPK: top_k, NORM: int(bool(norm)), KG: kinds[0], KU: kinds[1], KD: kinds[2],
             GLU: GLU_CODES[glu], THREADS: threads, HAS_BIAS: int(biases is not None),
             X: x.ctypes.data, LOGITS: logits.ctypes.data, OUT: out.ctypes.data,
             GW: gw.ctypes.data, UW: uw.ctypes.data, DW: dw.ctypes.data,
             GW_ROWB: gw.shape[1], UW_ROWB: uw.shape[1], DW_ROWB: dw.shape[1], GB: bp[0], UB: bp[1], DB: bp[2]}
    dsc = np.zeros(NDESC, np.int64)
    for k, v in words.items():
        dsc[k] = v
    return dsc


_FN = None


def host_fn():
    """The C callback `void fn(void *descriptor)` (compiled on first use, then cached)."""
    global _FN
    if _FN is None:
        from numba.np.ufunc.parallel import _launch_threads
        _launch_threads()                   # (the set_num_threads symbol)
        @cfunc(types.void(types.voidptr), cache=True, nogil=True)
        def _host_fn(p):
            run_desc(carray(p, (NDESC,), np.int64))
        _FN = _host_fn
    return _FN
