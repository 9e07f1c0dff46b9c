"""Numba kernels for the non-matmul ops of a transformer step on the CPU.

The quantized matmuls live in quant/; these are the small ops between them.
All take preallocated outputs so the token loop allocates nothing.
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np

from quant.half import f16_to_f32, f32_to_f16

_JIT = dict(cache=True, nogil=True, fastmath=True)


@nb.njit(**_JIT)
def rmsnorm(x, w, eps, out):
    """out[i] = x[i] / rms(x[i]) * w, row by row (rows may be heads: x is [R, D])."""
    n, d = x.shape
    for i in range(n):
        ss = np.float32(0.0)
        for j in range(d):
            ss += x[i, j] * x[i, j]
        r = np.float32(1.0) / np.sqrt(ss / d + eps)
        for j in range(d):
            out[i, j] = x[i, j] * r * w[j]


@nb.njit(**_JIT)
def rope(x, positions, inv_freq, neox, pos_scale):
    """Rotate x [N, H, D] in place by each token's position (first 2*len(inv_freq) dims)."""
    n, h, d = x.shape
    half = inv_freq.shape[0]
    for t in range(n):
        p = positions[t] / pos_scale
        for i in range(half):
            ang = p * inv_freq[i]
            c = np.float32(math.cos(ang))
            s = np.float32(math.sin(ang))
            for hh in range(h):
                if neox:
                    a = x[t, hh, i]
                    b = x[t, hh, i + half]
                    x[t, hh, i] = a * c - b * s
                    x[t, hh, i + half] = a * s + b * c
                else:
                    a = x[t, hh, 2 * i]
                    b = x[t, hh, 2 * i + 1]
                    x[t, hh, 2 * i] = a * c - b * s
                    x[t, hh, 2 * i + 1] = a * s + b * c


@nb.njit(**_JIT)
def silu_mul(g, u):
    """g = silu(g) * u (SwiGLU), in place."""
    n, d = g.shape
    for i in range(n):
        for j in range(d):
            v = g[i, j]
            g[i, j] = v / (np.float32(1.0) + np.exp(-v)) * u[i, j]


@nb.njit(**_JIT)
def gelu_mul(g, u):
    """g = gelu_tanh(g) * u (GeGLU), in place."""
    n, d = g.shape
    c = np.float32(math.sqrt(2.0 / math.pi))
    for i in range(n):
        for j in range(d):
            v = g[i, j]
            g[i, j] = np.float32(0.5) * v * (np.float32(1.0) + np.tanh(c * (v + np.float32(0.044715) * v * v * v))) * u[i, j]


@nb.njit(**_JIT)
def add_inplace(x, y):
    n, d = x.shape
    for i in range(n):
        for j in range(d):
            x[i, j] += y[i, j]


@nb.njit(**_JIT)
def kv_write(k, v, k_pool, v_pool, slots):
    """Store the new tokens' K and V (f32 [N, KVH, D]) as f16 bits at their cache slots."""
    n, kvh, d = k.shape
    for t in range(n):
        s = slots[t]
        for h in range(kvh):
            for j in range(d):
                k_pool[s, h, j] = f32_to_f16(k[t, h, j])
                v_pool[s, h, j] = f32_to_f16(v[t, h, j])


@nb.njit(parallel=True, **_JIT)
def paged_attention(q, k_pool, v_pool, block_size, block_tables, seq_of_token, positions, window,
                    scale, n_splits, part_m, part_l, part_acc, out):
    """Tiled attention with an online softmax over a paged f16 KV cache.

    q [N, H, D]; pools [n_slots, KVH, D] (uint16 f16 bits, slot = block*block_size + offset);
    token t of sequence seq_of_token[t] at position positions[t] attends to cache
    positions max(0, pos-window+1)..pos (window 0 = all).  Work is split over
    (token, kv head, context split): each item keeps a running max / sum / weighted
    V for its GQA group of query heads, so every K and V row is converted once per
    group, and a final pass merges the splits (flash-decoding).  No score matrix.
    part_m, part_l [N, KVH, n_splits, G] and part_acc [N, KVH, n_splits, G, D] are scratch.
    """
    n, h, d = q.shape
    kvh = k_pool.shape[1]
    g = h // kvh
    for it in nb.prange(n * kvh * n_splits):
        t = it // (kvh * n_splits)
        kh = (it // n_splits) % kvh
        sp = it % n_splits
        pos = positions[t]
        lo = 0
        if window > 0 and pos - window + 1 > 0:
            lo = pos - window + 1
        chunk = (pos + 1 - lo + n_splits - 1) // n_splits
        j0 = lo + sp * chunk
        j1 = min(pos + 1, j0 + chunk)
        table = block_tables[seq_of_token[t]]
        m = part_m[t, kh, sp]
        l = part_l[t, kh, sp]
        acc = part_acc[t, kh, sp]
        qs = np.empty((g, d), np.float32)
        kf = np.empty(d, np.float32)
        vf = np.empty(d, np.float32)
        for gi in range(g):
            m[gi] = -np.inf
            l[gi] = 0.0
            for x in range(d):
                acc[gi, x] = 0.0
                qs[gi, x] = q[t, kh * g + gi, x] * scale
        for j in range(j0, j1):
            slot = table[j // block_size] * block_size + j % block_size
            for x in range(d):
                kf[x] = f16_to_f32(k_pool[slot, kh, x])
                vf[x] = f16_to_f32(v_pool[slot, kh, x])
            for gi in range(g):
                s = np.float32(0.0)
                for x in range(d):
                    s += qs[gi, x] * kf[x]
                if s > m[gi]:
                    corr = np.exp(m[gi] - s)
                    l[gi] = l[gi] * corr + 1.0
                    for x in range(d):
                        acc[gi, x] = acc[gi, x] * corr + vf[x]
                    m[gi] = s
                else:
                    p = np.exp(s - m[gi])
                    l[gi] += p
                    for x in range(d):
                        acc[gi, x] += p * vf[x]
    # merge the context splits of each (token, query head)
    for it in nb.prange(n * kvh):
        t = it // kvh
        kh = it % kvh
        for gi in range(g):
            mx = -np.inf
            for sp in range(n_splits):
                if part_l[t, kh, sp, gi] > 0.0 and part_m[t, kh, sp, gi] > mx:
                    mx = part_m[t, kh, sp, gi]
            tot = np.float32(0.0)
            o = out[t, kh * g + gi]
            for x in range(d):
                o[x] = 0.0
            for sp in range(n_splits):
                if part_l[t, kh, sp, gi] == 0.0:
                    continue
                w = np.exp(part_m[t, kh, sp, gi] - mx)
                tot += part_l[t, kh, sp, gi] * w
                for x in range(d):
                    o[x] += part_acc[t, kh, sp, gi, x] * w
            inv = np.float32(1.0) / tot
            for x in range(d):
                o[x] *= inv
