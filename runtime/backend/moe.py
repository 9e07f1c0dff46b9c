"""Mixture-of-experts routing, shared by the backends' `moe` op.

The op (cpu.py, cuda.py) computes a step's router logits [n, E], then here, on the
host: each token's top-k experts by softmax probability (`route`), and the step's
(token, expert) pairs sorted by expert (`route_group`), so that each chosen expert runs once
a step on the contiguous run of rows that chose it: its weights are read once per step,
and an expert no token chose is not read at all (decode reads k experts' blocks).
Each token's output is then the sum of its experts' rows, weighted, in ascending
expert order (`combine`): a token's arithmetic never depends on the other tokens of
the step (batch invariance, with the matmuls' own up to exact_rows).

The CUDA backend routes decode steps on the device (quant/cuda/qmoe.cuh, moe_route_warp)
by the same operations in the same order, so its experts and weights equal `route`'s bit
for bit: softmax terms by `exp_det` (one fixed sequence of correctly rounded float64
operations, which CUDA repeats exactly; the C library's exp and CUDA's may differ in the
last bit), the sums in the same order, ties to the lower index.

The op's options (what a family's layer is):
- norm_topk: the chosen experts' probabilities renormalized to sum to 1.  gpt-oss's
  routing, top k of the router's logits and then a softmax over those k (llama.cpp's
  SOFTMAX_WEIGHT gating), is this one: softmax is monotonic, so the top k of the logits
  are the top k probabilities, and p_i / sum_topk p_j = exp(l_i) / sum_topk exp(l_j)
  (test_gpt_oss.py checks it against transformers' router).
- router_bias: added to the router's logits (gpt-oss).
- biases (gate, up, down), one row an expert each, added to the expert's outputs
  (`add_run_bias`, on the rows grouped by expert) (gpt-oss).
- glu: the experts' GLU, "silu" (SwiGLU) or "swiglu_oai" (gpt-oss's clamped form,
  cpu_kernels.swiglu_oai_mul).
"""
from __future__ import annotations

import math

import quant  # noqa: F401  (first: it points Numba's cache at quant/kernel_cache.py's folder)
import numba as nb
import numpy as np

_JIT = dict(cache=True, nogil=True)

# exp_det: x = k ln2 + r (k = rint(x / ln2), Cody and Waite's two-part ln2), exp(r) by
# its Taylor series to r^13 / 13! in Horner's order (|r| <= ln2 / 2: truncation ~4e-18),
# times 2^k.  Constants as hex literals, the same in qmoe.cuh.
_INV_LN2 = float.fromhex("0x1.71547652b82fep+0")
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_EXP_C = tuple(float.fromhex(h) for h in (
    "0x1.0000000000000p+0", "0x1.0000000000000p+0", "0x1.0000000000000p-1", "0x1.5555555555555p-3",
    "0x1.5555555555555p-5", "0x1.1111111111111p-7", "0x1.6c16c16c16c17p-10", "0x1.a01a01a01a01ap-13",
    "0x1.a01a01a01a01ap-16", "0x1.71de3a556c734p-19", "0x1.27e4fb7789f5cp-22", "0x1.ae64567f544e4p-26",
    "0x1.1eed8eff8d898p-29", "0x1.6124613a86d09p-33"))     # 1 / n!, n = 0..13


@nb.njit(**_JIT)
def exp_det(x):
    """exp(x) for float64 x by a fixed sequence of IEEE float64 operations (no fused
    multiply-add, which Numba does not form): within ~2e-16 of exp, and the same bits as
    qmoe.cuh's exp_det on the GPU.  0 below -745.2 (and for NaN), inf above 709.7."""
    if not (x > -745.2):
        return 0.0
    if x > 709.7:
        return np.inf
    k = np.rint(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    c = _EXP_C
    p = c[13]
    p = p * r + c[12]
    p = p * r + c[11]
    p = p * r + c[10]
    p = p * r + c[9]
    p = p * r + c[8]
    p = p * r + c[7]
    p = p * r + c[6]
    p = p * r + c[5]
    p = p * r + c[4]
    p = p * r + c[3]
    p = p * r + c[2]
    p = p * r + c[1]
    p = p * r + c[0]
    return math.ldexp(p, int(k))


@nb.njit(**_JIT)
def route(logits, k, norm, ids, w):
    """Per row of logits [n, E]: the k experts of highest softmax probability (the lower
    index first on a tie), written in ascending expert order to ids [n, k] with their
    probabilities in w [n, k], renormalized to sum to 1 when norm (HF norm_topk_prob;
    llama.cpp's qwen3moe always).  Softmax in float64 (exp_det), one row at a time; the
    GPU's moe_route_warp repeats every operation in this order."""
    n, E = logits.shape
    p = np.empty(E, np.float64)
    taken = np.zeros(E, np.bool_)
    for t in range(n):
        _route_row(logits, t, k, norm, ids, w, p, taken)


# a prompt's rows are routed in parallel from this many on (a row's operations are the same
# either way: 2.2 ms a layer for 512 rows of 128 experts on one core, most of it exp_det);
# at most warmup.WARMUP_ROWS' prompt (48), so route_par compiles in the warm-up, not in the
# first answer
ROUTE_PAR_ROWS = 32


@nb.njit(parallel=True, **_JIT)
def route_par(logits, k, norm, ids, w):
    """route, rows in parallel (each thread its own scratch)."""
    n, E = logits.shape
    for t in nb.prange(n):
        _route_row(logits, t, k, norm, ids, w, np.empty(E, np.float64), np.zeros(E, np.bool_))


@nb.njit(**_JIT)
def _route_row(logits, t, k, norm, ids, w, p, taken):
    """route's row t (p, taken: scratch of E)."""
    E = logits.shape[1]
    m = logits[t, 0]
    for e in range(1, E):
        m = max(m, logits[t, e])
    s = 0.0
    for e in range(E):
        p[e] = exp_det(np.float64(logits[t, e]) - np.float64(m))
        s += p[e]
    taken[:] = False
    for _ in range(k):
        best = -1
        for e in range(E):
            if not taken[e] and (best < 0 or p[e] > p[best]):
                best = e
        taken[best] = True
    j = 0
    tot = 0.0
    for e in range(E):
        if taken[e]:
            ids[t, j] = e
            w[t, j] = p[e] / s
            tot += p[e] / s
            j += 1
    if norm:
        for j in range(k):
            w[t, j] = np.float32(w[t, j] / tot)


def plan(logits: np.ndarray, top_k: int, norm: bool):
    """route_group for logits [n, E] (host float32) into fresh arrays: (weights [n, k],
    pair tokens, expert run starts, pair positions)."""
    logits = np.ascontiguousarray(logits, np.float32)
    n, E = logits.shape
    ids = np.empty((n, top_k), np.int32)
    w = np.empty((n, top_k), np.float32)
    tokens = np.empty(n * top_k, np.int32)
    starts = np.empty(E + 1, np.int64)
    pos = np.empty((n, top_k), np.int32)
    route_group(logits, int(top_k), bool(norm), ids, w, tokens, starts, pos, np.empty(E, np.int64),
                np.empty(1, np.int64))
    return w, tokens, starts, pos


@nb.njit(**_JIT)
def combine(y, pos, w, out):
    """out[t] = sum_j w[t, j] * y[pos[t, j]], j in ascending expert order."""
    n, k = pos.shape
    d = y.shape[1]
    for t in range(n):
        for c in range(d):
            out[t, c] = 0.0
        for j in range(k):
            r = pos[t, j]
            wj = w[t, j]
            for c in range(d):
                out[t, c] += wj * y[r, c]


@nb.njit(**_JIT)
def route_group(logits, k, norm, ids, w, tokens, starts, pos, act, nact):
    """route + group in one kernel with every output in a buffer of the caller's (a CPU
    step plan replays it: cpu_plan.py): ids, w [n, k] as route; the pairs sorted by
    expert, tokens ascending within one (tokens int32 [n*k], starts int64 [E+1] where
    expert e's run begins, pos int32 [n, k]: where pair (t, j) landed); the chosen experts ascending in act int64 [E], their count
    in nact[0]."""
    n, E = logits.shape
    if n >= ROUTE_PAR_ROWS:
        route_par(logits, k, norm, ids, w)
    else:
        route(logits, k, norm, ids, w)
    starts[:] = 0
    for t in range(n):
        for j in range(k):
            starts[ids[t, j] + 1] += 1
    na = 0
    for e in range(E):
        if starts[e + 1] > 0:
            act[na] = e
            na += 1
        starts[e + 1] += starts[e]
    nact[0] = na
    fill = starts[:E].copy()
    for t in range(n):
        for j in range(k):
            e = ids[t, j]
            p = fill[e]
            fill[e] = p + 1
            tokens[p] = t
            pos[t, j] = p


@nb.njit(**_JIT)
def add_run_bias(x, bias, starts, act, nact):
    """x[r] += bias[e] for every row r of expert e's run (starts[e] <= r < starts[e+1]),
    the active experts act[:nact[0]] (route_group's); bias [E, cols] float32."""
    d = x.shape[1]
    for i in range(nact[0]):
        e = act[i]
        for r in range(starts[e], starts[e + 1]):
            for c in range(d):
                x[r, c] += bias[e, c]


class ExpertChunks:
    """A prompt's (token, expert) pairs laid out for batched expert GEMMs (the CUDA
    backend's prompts: quant.cuda.matmul_experts).  The chosen experts, most pairs first,
    go in chunks of at most `cap` experts (what the fp16 tile holds); within a chunk every
    expert has `pad` rows, the chunk's largest run, so one strided-batched GEMM does the
    chunk.  A chunk closes early where an expert has at most half its pad (so padding at
    most doubles a chunk's rows; pad rows repeat a real token and are never combined).
    Host arrays: src [rows] the token of each laid-out row, eid [rows] its expert, pos
    [n, k] the row of pair (t, j), experts [used] the chosen experts in chunk order;
    chunks [(j0, j1)] into experts, base / pad: a chunk's first row and rows an expert;
    most: the largest chunk's experts.  experts_d: the device copy, set by the caller."""

    def __init__(self, starts, tokens, pos, cap: int):
        counts = np.diff(starts)
        used = np.flatnonzero(counts)
        order = used[np.argsort(-counts[used], kind="stable")]
        self.chunks, self.base, self.pad = [], [], []
        rows, j = 0, 0
        while j < len(order):
            pad = int(counts[order[j]])
            j1 = j + 1
            while j1 < len(order) and j1 - j < cap and 2 * counts[order[j1]] > pad:
                j1 += 1
            self.chunks.append((j, j1))
            self.base.append(rows)
            self.pad.append(pad)
            rows += (j1 - j) * pad
            j = j1
        self.rows = rows
        self.most = max((b - a for a, b in self.chunks), default=0)
        self.experts = order.astype(np.int32)
        self.src = np.empty(rows, np.int32)
        self.eid = np.empty(rows, np.int32)
        at = np.empty(len(tokens), np.int32)         # sorted pair -> laid-out row
        _lay_out(np.asarray(starts, np.int64), np.asarray(tokens, np.int32), self.experts,
                 np.asarray([c[0] for c in self.chunks], np.int64), np.asarray(self.base, np.int64),
                 np.asarray(self.pad, np.int64), self.src, self.eid, at)
        self.pos = at[pos]
        self.experts_d = None


@nb.njit(**_JIT)
def _lay_out(starts, tokens, experts, j0s, bases, pads, src, eid, at):
    """ExpertChunks' rows: expert experts[j] of the chunk starting at j0s[c] takes rows
    bases[c] + (j - j0s[c]) * pads[c] on; its pairs first (at[sorted pair] = row), then
    copies of its first token."""
    c = 0
    for j in range(len(experts)):
        while c + 1 < len(j0s) and j0s[c + 1] <= j:
            c += 1
        e = experts[j]
        r0 = bases[c] + (j - j0s[c]) * pads[c]
        a, b = starts[e], starts[e + 1]
        for i in range(pads[c]):
            r = r0 + i
            eid[r] = e
            if a + i < b:
                src[r] = tokens[a + i]
                at[a + i] = r
            else:
                src[r] = tokens[a]
