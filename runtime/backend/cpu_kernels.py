"""Numba kernels for the non-matmul ops of a transformer step on the CPU.

The quantized matmuls live in quant/; these are the small ops between them.
All take preallocated outputs so the token loop allocates nothing.
"""
from __future__ import annotations

import math

import numba as nb
import numpy as np

from quant.half import bits_to_f32, f16_to_f32, f32_to_f16

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


# ---- KV cache: write, attention, shift ---------------------------------------------
#
# K/V pools are [n_slots, KVH, D] per layer, slot = block * block_size + offset.
# f16 cache: uint16 f16 bits.  q8_0 cache: int8 values plus one f16 scale per 32
# values ([n_slots, KVH, D // 32] uint16), the GGML Q8_0 layout split in two arrays
# so the int8 rows stay contiguous.  Kernels take a `quantized` flag and both pool
# kinds compile from the same source (the branch is per block, not per value).

QK8 = 32
# fastmath without nnan/ninf: attention masks with -inf and must compare against it
_JIT_INF = dict(cache=True, nogil=True, fastmath={"reassoc", "contract", "arcp", "nsz", "afn"})


@nb.njit(inline="always")
def _q8_store(x, pool, scales, s, h):
    d = x.shape[0]
    for b0 in range(0, d, QK8):
        amax = np.float32(0.0)
        for j in range(b0, b0 + QK8):
            a = abs(x[j])
            if a > amax:
                amax = a
        dq = amax / np.float32(127.0)
        inv = np.float32(1.0) / dq if dq > 0 else np.float32(0.0)
        scales[s, h, b0 // QK8] = f32_to_f16(dq)
        for j in range(b0, b0 + QK8):
            v = x[j] * inv      # round half away from zero, as GGML's roundf
            pool[s, h, j] = np.int8(int(v + np.float32(0.5)) if v >= 0 else -int(np.float32(0.5) - v))


@nb.njit(inline="always")
def _exp_le0(x):
    """exp(x) for x <= 0 (0 for x < -87), branch-free so loops over it vectorize:
    2^(x log2 e) = 2^n * 2^f with a degree-6 polynomial for 2^f, f in [0, 1)
    (relative error ~2e-7; libm's scalar expf call was half of decode attention)."""
    t = max(x, np.float32(-87.0)) * np.float32(1.4426950408889634)
    n = np.floor(t)
    f = t - n
    p = np.float32(1.5403530e-4)
    p = p * f + np.float32(1.3333558e-3)
    p = p * f + np.float32(9.6181291e-3)
    p = p * f + np.float32(5.5504109e-2)
    p = p * f + np.float32(2.4022651e-1)
    p = p * f + np.float32(6.9314718e-1)
    p = p * f + np.float32(1.0)
    return p * bits_to_f32(np.uint32((np.int32(n) + 127) << 23))


@nb.njit(inline="always")
def _load_row(pool, scales, quantized, s, h, out, r):
    """out[r, :] = K or V row (slot s, kv head h) as float32."""
    d = out.shape[1]
    if quantized:
        for b0 in range(0, d, QK8):
            dq = f16_to_f32(np.uint16(scales[s, h, b0 // QK8]))
            for j in range(b0, b0 + QK8):
                out[r, j] = np.float32(pool[s, h, j]) * dq
    else:
        for j in range(d):
            out[r, j] = f16_to_f32(np.uint16(pool[s, h, j]))


@nb.njit(**_JIT)
def kv_write(k, v, k_pool, v_pool, k_scale, v_scale, quantized, slots):
    """Store the new tokens' K and V (f32 [N, KVH, D]) at their cache slots
    (f16 bits, or q8_0 values + scales when quantized)."""
    n, kvh, d = k.shape
    for t in range(n):
        s = slots[t]
        for h in range(kvh):
            if quantized:
                _q8_store(k[t, h], k_pool, k_scale, s, h)
                _q8_store(v[t, h], v_pool, v_scale, s, h)
            else:
                for j in range(d):
                    k_pool[s, h, j] = f32_to_f16(k[t, h, j])
                    v_pool[s, h, j] = f32_to_f16(v[t, h, j])


@nb.njit(**_JIT)
def attention_tiles(seq_of_token, positions, max_tile, tile_t0, tile_n):
    """Cut the step's tokens into query tiles: runs of consecutive positions of
    one sequence, at most max_tile long.  Returns the number of tiles."""
    n = seq_of_token.shape[0]
    nt = 0
    t = 0
    while t < n:
        e = t + 1
        while (e < n and e - t < max_tile and seq_of_token[e] == seq_of_token[t]
               and positions[e] == positions[e - 1] + 1):
            e += 1
        tile_t0[nt] = t
        tile_n[nt] = e - t
        nt += 1
        t = e
    return nt


@nb.njit(inline="always")
def _split_range(pos, window, n_splits, sp, block_size):
    """Keys [a, b) that split sp of the query at pos attends: its causal window
    cut into n_splits block-aligned chunks."""
    lo = 0
    if window > 0 and pos - window + 1 > 0:
        lo = pos - window + 1
    hi = pos + 1
    chunk = (hi - lo + n_splits - 1) // n_splits
    chunk = (chunk + block_size - 1) // block_size * block_size
    a = lo + sp * chunk
    return a, min(hi, a + chunk)


@nb.njit(parallel=True, **_JIT_INF)
def paged_attention(q, k_pool, v_pool, k_scale, v_scale, quantized, block_size, block_tables,
                    seq_of_token, positions, window, scale, n_splits, tile_t0, tile_n, n_tiles,
                    part_m, part_l, part_acc, out):
    """Causal-tiled attention with an online softmax over a paged KV cache.

    q [N, H, D]; token t of sequence seq_of_token[t] at position positions[t]
    attends to cache positions max(0, pos-window+1)..pos (window 0 = all).

    Work items are (query tile, kv head, context split).  An item holds the
    tile's queries of one GQA group as a [tile*G, D] matrix, walks the keys one
    cache block at a time (each K/V block converted to f32 once per item, not once
    per query or per head), computes the [tile*G, block] scores, and folds them
    into a running max / sum / weighted V with one rescale per block.  Memory is
    O(tile*G*(D + block)) per item: no N x N score matrix.  Decode (tile of one
    token over a long context) splits the context across items, and a second pass
    merges their partial softmax results (flash-decoding); part_m, part_l
    [N, KVH, n_splits, G] and part_acc [N, KVH, n_splits, G, D] hold those partials
    (unused when n_splits == 1: items then write `out` directly).
    """
    n, h, d = q.shape
    kvh = k_pool.shape[1]
    g = h // kvh
    per_tile = kvh * n_splits
    for it in nb.prange(n_tiles * per_tile):
        # zig-zag over tiles so that contiguous chunks of items (one per thread)
        # mix short early tiles with long late ones under causal masking
        k_ = it // per_tile
        ti = k_ // 2 if k_ % 2 == 0 else n_tiles - 1 - k_ // 2
        kh = (it // n_splits) % kvh
        sp = it % n_splits
        t0 = tile_t0[ti]
        nq = tile_n[ti]
        p0 = positions[t0]
        p_last = p0 + nq - 1
        # each query's own context range is split alone (block-aligned chunks of
        # its own span), so a query's partial sums do not depend on which other
        # queries share its tile: a k+1-token verify step then rounds exactly as
        # k+1 one-token steps do.  The item walks the union of its rows' ranges.
        j0 = 1 << 62
        j1 = 0
        for r in range(nq):
            a, b = _split_range(p0 + r, window, n_splits, sp, block_size)
            if b > a:
                j0 = min(j0, a)
                j1 = max(j1, b)
        table = block_tables[seq_of_token[t0]]
        rows = nq * g
        qs = np.empty((rows, d), np.float32)
        acc = np.zeros((rows, d), np.float32)
        m = np.full(rows, -np.inf, np.float32)
        l = np.zeros(rows, np.float32)
        kf = np.empty((block_size, d), np.float32)
        vf = np.empty((block_size, d), np.float32)
        sc = np.empty(block_size, np.float32)
        for r in range(rows):
            for x in range(d):
                qs[r, x] = q[t0 + r // g, kh * g + r % g, x] * scale
        j = j0
        while j < j1:
            blk = j // block_size
            jb_end = min(j1, (blk + 1) * block_size)
            nk = jb_end - j
            base = table[blk] * block_size + (j - blk * block_size)
            for c in range(nk):
                _load_row(k_pool, k_scale, quantized, base + c, kh, kf, c)
                _load_row(v_pool, v_scale, quantized, base + c, kh, vf, c)
            for r in range(rows):
                # keys of this block inside the row's own split: c in [c0, c1)
                ra, rb = _split_range(p0 + r // g, window, n_splits, sp, block_size)
                c0 = max(0, ra - j)
                c1 = min(nk, rb - j)
                if c1 <= c0:
                    continue
                mb = -np.inf
                for c in range(c0, c1):
                    s = np.float32(0.0)
                    for x in range(d):
                        s += qs[r, x] * kf[c, x]
                    sc[c] = s
                    mb = max(mb, s)
                if mb > m[r]:
                    corr = np.exp(m[r] - mb)
                    m[r] = mb
                    l[r] *= corr
                    for x in range(d):
                        acc[r, x] *= corr
                mr = m[r]
                lsum = np.float32(0.0)
                for c in range(c0, c1):
                    p = _exp_le0(sc[c] - mr)
                    sc[c] = p
                    lsum += p
                l[r] += lsum
                for c in range(c0, c1):
                    p = sc[c]
                    for x in range(d):
                        acc[r, x] += p * vf[c, x]
            j = jb_end
        for r in range(rows):
            t = t0 + r // g
            gi = r % g
            if n_splits == 1:
                inv = np.float32(1.0) / l[r] if l[r] > 0 else np.float32(0.0)
                for x in range(d):
                    out[t, kh * g + gi, x] = acc[r, x] * inv
            else:
                part_m[t, kh, sp, gi] = m[r]
                part_l[t, kh, sp, gi] = l[r]
                for x in range(d):
                    part_acc[t, kh, sp, gi, x] = acc[r, x]
    if n_splits == 1:
        return
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


@nb.njit(**_JIT)
def kv_shift(k_pool, v_pool, k_scale, v_scale, quantized, src, dst, delta, inv_freq, neox, pos_scale):
    """Move cached K/V from slots src to slots dst (context shift) and re-rotate the
    keys by `delta` positions: RoPE rotations compose, so R(p + delta) = R(delta) R(p).
    All sources are read before any destination is written, so src and dst may overlap."""
    n = src.shape[0]
    kvh = k_pool.shape[1]
    d = k_pool.shape[2]
    kt = np.empty((n, kvh, d), np.float32)
    vt = np.empty((n, kvh, d), np.float32)
    for t in range(n):
        for hh in range(kvh):
            _load_row(k_pool, k_scale, quantized, src[t], hh, kt[t], hh)
            _load_row(v_pool, v_scale, quantized, src[t], hh, vt[t], hh)
    half = inv_freq.shape[0]
    ang0 = np.float64(delta) / pos_scale
    for i in range(half):
        ang = ang0 * inv_freq[i]
        c = np.float32(math.cos(ang))
        s = np.float32(math.sin(ang))
        for t in range(n):
            for hh in range(kvh):
                if neox:
                    a = kt[t, hh, i]
                    b = kt[t, hh, i + half]
                    kt[t, hh, i] = a * c - b * s
                    kt[t, hh, i + half] = a * s + b * c
                else:
                    a = kt[t, hh, 2 * i]
                    b = kt[t, hh, 2 * i + 1]
                    kt[t, hh, 2 * i] = a * c - b * s
                    kt[t, hh, 2 * i + 1] = a * s + b * c
    kv_write(kt, vt, k_pool, v_pool, k_scale, v_scale, quantized, dst)
