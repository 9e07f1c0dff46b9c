"""Mixture-of-experts FFN on the CPU in a fixed number of kernel calls (llama.cpp's
mul_mat_id): the chosen experts' rows are read straight from the 3-D expert tensor's
bytes (expert e's matrix is rows e*M..e*M+M-1 of its [E*M, row_nbytes] block array),
so a step runs the same kernels on the same buffers whichever experts its tokens
chose, and the CPU backend can record it once and replay it (cpu_plan.py).

The step's (token, expert) pairs come sorted by expert (runtime/backend/moe.py's
route_group: the run of rows a[e]..a[e+1]-1 of expert e, tokens ascending); the
activations are gathered in that order and rounded to int8 once for all pairs
(act_quant.quantize_q8_256_i8, row by row: a row's codes do not depend on the other
rows).  Each parallel work item is one W-row chunk of one chosen expert's matrix,
against that expert's run of rows, computed by the same VNNI row kernels
(vnni.rows_q4_k / rows_q6_k, up to 8 rows per decode of a W row) that matmul_cpu
runs for a 2-D matrix of a run's rows: every output is bit for bit what the
expert-by-expert path (one matmul per expert) gives, whatever the other tokens are.

Experts of the VNNI kernels' types on CPUs with AVX512-VNNI or AVX2 (`fused_kinds` says None
otherwise: the backend then runs the expert-by-expert path): K-quants (Q4_K, Q6_K: Q4_K_M
files) and the 32-element formats (Q4_0 ... Q8_0 and MXFP4: gpt-oss's experts).  Gate and up
share one rounding of x, so they must be of one family; down has its own (of h).

The two families round activations differently (act_quant: one step per 256 values and
code sums per 16 / 32 for the K-quants; one step per 32 values, pair order, for the
others), into the same six flat buffers (`act_buffers`): (codes, codes in Q4_K's order,
steps, code sums per 32, code sums per 16, step x sum per 32) for the K-quants, and
(codes, the same codes, steps, code sums, the same sums, step x sum) per 32 for the others,
so every kernel here has one signature; `fam` (K_FAM or LEG_FAM) says which.  The
32-element family's runs of more than two rows go through vnni's row groups (`group_runs`
regroups each run's codes, `grp_buffers`), as the expert-by-expert path runs them.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .act_quant import group_q8_32, quantize_q8_256_i8, quantize_q8_32_i8
from .matmul_cpu import USE_VNNI, _VNNI_KIND
from .vnni import (LEG_KINDS, LEG_ROWS_MAX, grp_rows, rows_mxfp4, rows_q4_0, rows_q4_1, rows_q4_k, rows_q5_0,
                   rows_q5_1, rows_q6_k, rows_q8_0)

K_FAM, LEG_FAM = 0, 1       # activations in 256-value blocks (K-quants) / 32-value blocks


def family(kind) -> int:
    return K_FAM if kind in (10, 11) else LEG_FAM


def fused_kinds(gates, ups, downs):
    """(gate, up, down) VNNI kinds (10 Q4_K, 11 Q6_K; 0-4 and 6 the 32-element formats,
    vnni.LEG_KINDS) when all three expert tensors can take the fused kernels, else None.
    gates etc.: QTensor [E*M, K] block arrays."""
    if not USE_VNNI:
        return None
    kinds = tuple(_VNNI_KIND.get(t.qtype, -1) for t in (gates, ups, downs))
    if any(k not in (10, 11) + LEG_KINDS for k in kinds) or family(kinds[0]) != family(kinds[1]):
        return None
    return kinds


def act_buffers(fam: int, m: int, K: int, get):
    """The six flat activation buffers for m rows of K values of family fam (module
    docstring), from get(shape, dtype) (an arena's)."""
    if fam == K_FAM:
        return (get((m * K,), np.int8), get((m * K,), np.int8), get((m * K // 256,)),
                get((m * K // 32,), np.int32), get((m * K // 16,), np.int32), get((m * K // 32,)))
    xq, xsum = get((m * K,), np.int8), get((m * K // 32,), np.int32)
    return xq, xq, get((m * K // 32,)), xsum, xsum, get((m * K // 32,))


def grp_buffers(fam: int, P: int, E: int, K: int, get):
    """The row-group buffers of the 32-element family for P pairs of E experts (vnni's row
    groups: an expert's run of more than LEG_ROWS_MAX rows in groups of up to 16, each W
    block decoded once a group): (codes, steps, code sums, step x sums, first group of each
    expert's run); empty for the K-quants (their row kernel takes 8 rows a decode itself)."""
    if fam == K_FAM:
        return (get((0,), np.int8), get((0,)), get((0,), np.int32), get((0,)), get((E,), np.int64))
    ng = P // 16 + E + 1                     # every run's groups: at most one partial one a run
    nb = K // 32
    return (get((ng * 16 * K,), np.int8), get((ng * nb * 16,)), get((ng * nb * 16,), np.int32),
            get((ng * nb * 16,)), get((E,), np.int64))


@njit(cache=True, nogil=True)
def group_runs(K, starts, act, nact, xq, xd, xsum, xs, xg, xdg, xsumg, xsg, goff):
    """Each chosen expert's run of rows (more than LEG_ROWS_MAX of them) regrouped as
    act_quant.group_q8_32 does for a matrix of that many rows, into the group buffers from
    group goff[e] on: the row-group kernel then runs the run as the expert-by-expert path
    runs it."""
    nb = K // 32
    g = 0
    for i in range(nact[0]):
        e = act[i]
        a, b = starts[e], starts[e + 1]
        n = b - a
        goff[e] = g
        if n > LEG_ROWS_MAX:
            ng = (n + 15) // 16
            group_q8_32(n, K, xq[a * K:b * K], xd[a * nb:b * nb], xsum[a * nb:b * nb], xs[a * nb:b * nb],
                        xg[g * 16 * K:(g + ng) * 16 * K], xdg[g * nb * 16:(g + ng) * nb * 16],
                        xsumg[g * nb * 16:(g + ng) * nb * 16], xsg[g * nb * 16:(g + ng) * nb * 16])
            g += ng


@njit(inline="always")
def _leg_run(kind, w, xq, xd, xsum, xs, n, K, out, res, m0, m1):
    """vnni's row kernel of a 32-element kind (literal dispatch: each is its own function)."""
    if kind == 6:
        rows_mxfp4(w, xq, xd, xsum, xs, out, res, n, K, m0, m1)
    elif kind == 0:
        rows_q4_0(w, xq, xd, xsum, xs, out, res, n, K, m0, m1)
    elif kind == 4:
        rows_q8_0(w, xq, xd, xsum, xs, out, res, n, K, m0, m1)
    elif kind == 1:
        rows_q4_1(w, xq, xd, xsum, xs, out, res, n, K, m0, m1)
    elif kind == 2:
        rows_q5_0(w, xq, xd, xsum, xs, out, res, n, K, m0, m1)
    else:
        rows_q5_1(w, xq, xd, xsum, xs, out, res, n, K, m0, m1)


@njit(inline="always")
def _kq_run(kind, w, xq, xq4, xd, xb16, xbf, gx, e, a, b, K, out, res, m0, m1):
    """out[a:b, m] = x rows a..b-1 . W row m (m0 <= m < m1), x rounded into the flat
    xq/xq4/xd/xb16/xbf of its family; the rows a..b-1 as one matrix, exactly as
    matmul_cpu's VNNI path runs a matrix of b-a rows (the 32-element formats: up to
    LEG_ROWS_MAX rows by vnni.leg_rows, more by the row groups of gx, expert e's from
    group gx[4][e] on: group_runs)."""
    nsb = K // 256
    if kind != 10 and kind != 11:
        nb = K // 32
        n = b - a
        if n > LEG_ROWS_MAX:
            xg, xdg, xsumg, xsg, goff = gx
            g0 = goff[e]
            ng = (n + 15) // 16
            grp_rows(kind, w, xg[g0 * 16 * K:(g0 + ng) * 16 * K], xdg[g0 * nb * 16:(g0 + ng) * nb * 16],
                     xsumg[g0 * nb * 16:(g0 + ng) * nb * 16], xsg[g0 * nb * 16:(g0 + ng) * nb * 16],
                     out[a:b], res, n, K, m0, m1)
        else:
            _leg_run(kind, w, xq[a * K:b * K], xd[a * nb:b * nb], xb16[a * nb:b * nb], xbf[a * nb:b * nb],
                     n, K, out[a:b], res, m0, m1)
    elif kind == 10:
        rows_q4_k(w, xq4[a * K:b * K], xd[a * nsb:b * nsb], xbf[a * (K // 32):b * (K // 32)], xd,
                  out[a:b], res, b - a, K, m0, m1)
    else:
        rows_q6_k(w, xq[a * K:b * K], xd[a * nsb:b * nsb], xb16[a * (K // 16):b * (K // 16)], xd,
                  out[a:b], res, b - a, K, m0, m1)


@njit(parallel=True, cache=True, nogil=True)
def gate_up(kg, ku, gw, uw, M, K, xq, xq4, xd, xb16, xbf, gx, starts, act, nact, g, u, res, target):
    """g[p] = gate_e . x[p], u[p] = up_e . x[p] for every pair p of every chosen expert
    e = act[0..nact[0]-1] (its pairs starts[e]..starts[e+1]-1); gw, uw: [E*M, row_nbytes].
    Work items: (expert, gate or up, chunk of M rows), about `target` of them."""
    na = nact[0]
    nch = max(1, min(M // 16, (target + 2 * na - 1) // (2 * na)))
    per = (M + nch - 1) // nch
    for c in prange(na * 2 * nch):
        i = c // (2 * nch)
        r = c - i * 2 * nch
        which = r // nch
        ch = r - which * nch
        e = act[i]
        m0 = ch * per
        m1 = min(M, m0 + per)
        a = starts[e]
        b = starts[e + 1]
        if which == 0:
            _kq_run(kg, gw[e * M:(e + 1) * M], xq, xq4, xd, xb16, xbf, gx, e, a, b, K, g, res[c], m0, m1)
        else:
            _kq_run(ku, uw[e * M:(e + 1) * M], xq, xq4, xd, xb16, xbf, gx, e, a, b, K, u, res[c], m0, m1)


@njit(parallel=True, cache=True, nogil=True)
def down(kd, dw, M, K, xq, xq4, xd, xb16, xbf, gx, starts, act, nact, y, res, target):
    """y[p] = down_e . h[p] (h rounded into xq...), as gate_up for one matrix an expert."""
    na = nact[0]
    nch = max(1, min(M // 16, (target + na - 1) // na))
    per = (M + nch - 1) // nch
    for c in prange(na * nch):
        i = c // nch
        ch = c - i * nch
        e = act[i]
        m0 = ch * per
        m1 = min(M, m0 + per)
        _kq_run(kd, dw[e * M:(e + 1) * M], xq, xq4, xd, xb16, xbf, gx, e, starts[e], starts[e + 1], K, y, res[c],
                m0, m1)


@njit(inline="always")
def _q8_row(fam, x, r, p, xq, xq4, xd, xb, xb16, xbf):
    """x row r rounded into the flat buffers at row p (act_quant.quantize_q8_256_i8's
    or quantize_q8_32_i8's arithmetic: a row's codes depend on that row alone)."""
    K = x.shape[1]
    n32 = K // 32
    if fam == 0:
        quantize_q8_256_i8(x[r:r + 1], xq[p * K:(p + 1) * K], xq4[p * K:(p + 1) * K],
                           xd[p * (K // 256):(p + 1) * (K // 256)], xb[p * n32:(p + 1) * n32],
                           xb16[p * (K // 16):(p + 1) * (K // 16)], xbf[p * n32:(p + 1) * n32])
    else:
        quantize_q8_32_i8(x[r:r + 1], xq[p * K:(p + 1) * K], xd[p * n32:(p + 1) * n32], xb[p * n32:(p + 1) * n32],
                          xbf[p * n32:(p + 1) * n32])


@njit(parallel=True, cache=True, nogil=True)
def q8_rows_par(fam, x, rows, xq, xq4, xd, xb, xb16, xbf, nch):
    """Row p of the output = x[rows[p]] rounded (rows: the pairs' tokens; or None-like
    identity when rows.size == 0), in nch parallel chunks of rows (a prompt's pairs)."""
    P = rows.size if rows.size > 0 else x.shape[0]
    per = (P + nch - 1) // nch
    for c in prange(nch):
        for p in range(c * per, min(P, (c + 1) * per)):
            _q8_row(fam, x, rows[p] if rows.size > 0 else p, p, xq, xq4, xd, xb, xb16, xbf)


@njit(cache=True, nogil=True)
def q8_rows(fam, x, rows, xq, xq4, xd, xb, xb16, xbf):
    """q8_rows_par on the calling thread (a decode step's few pairs)."""
    P = rows.size if rows.size > 0 else x.shape[0]
    for p in range(P):
        _q8_row(fam, x, rows[p] if rows.size > 0 else p, p, xq, xq4, xd, xb, xb16, xbf)


@njit(inline="always")
def _gather_one(fam, tokens, p, K, sq, sq4, sd, sb, sb16, sbf, xq, xq4, xd, xb, xb16, xbf):
    t = tokens[p]
    n32 = K // 32
    xq[p * K:(p + 1) * K] = sq[t * K:(t + 1) * K]
    xb[p * n32:(p + 1) * n32] = sb[t * n32:(t + 1) * n32]
    xbf[p * n32:(p + 1) * n32] = sbf[t * n32:(t + 1) * n32]
    if fam == 0:
        xq4[p * K:(p + 1) * K] = sq4[t * K:(t + 1) * K]
        n256, n16 = K // 256, K // 16
        xd[p * n256:(p + 1) * n256] = sd[t * n256:(t + 1) * n256]
        xb16[p * n16:(p + 1) * n16] = sb16[t * n16:(t + 1) * n16]
    else:       # (xq4 and xb16 are xq and xb)
        xd[p * n32:(p + 1) * n32] = sd[t * n32:(t + 1) * n32]


@njit(parallel=True, cache=True, nogil=True)
def q8_gather_par(fam, tokens, K, sq, sq4, sd, sb, sb16, sbf, xq, xq4, xd, xb, xb16, xbf, nch):
    """Row p of the flat int8 activations (xq...) = row tokens[p] of the rounded rows
    (sq...: q8_rows' output): a token's row is rounded once, whatever its k experts."""
    P = tokens.size
    per = (P + nch - 1) // nch
    for c in prange(nch):
        for p in range(c * per, min(P, (c + 1) * per)):
            _gather_one(fam, tokens, p, K, sq, sq4, sd, sb, sb16, sbf, xq, xq4, xd, xb, xb16, xbf)


@njit(cache=True, nogil=True)
def q8_gather(fam, tokens, K, sq, sq4, sd, sb, sb16, sbf, xq, xq4, xd, xb, xb16, xbf):
    """q8_gather_par on the calling thread."""
    for p in range(tokens.size):
        _gather_one(fam, tokens, p, K, sq, sq4, sd, sb, sb16, sbf, xq, xq4, xd, xb, xb16, xbf)
