"""Tiled paged attention against a float64 naive softmax(QK^T)V.

The kernel reads K/V back from the cache (f16, or q8_0), so the reference uses
the same stored values: the comparison isolates the tiling, the online softmax,
the split merge and the masking.  Tolerance: 2e-5 absolute on outputs of size ~1
(f32 accumulation over a few hundred keys), 2e-3 for q8_0 (the reference then
uses exact K/V, so it also bounds the quantization error); k16v8 (K f16, V q8_0)
against both.
"""
from __future__ import annotations

import numpy as np
import pytest

from quant.half import f16_to_f32  # noqa: F401  (ensures the intrinsics import)
from runtime.backend.cpu import CPUBackend
from runtime.engine import Step

TOL = 2e-5


def naive(q, K, V, positions, window, scale, sinks=None):
    """q [N, H, D] for one sequence; K, V [T, KVH, D] by position; float64.  sinks [H]:
    a logit per head that joins the softmax (its weight dropped: gpt-oss, as transformers'
    eager_attention_forward computes it)."""
    n, h, d = q.shape
    kvh = K.shape[1]
    g = h // kvh
    out = np.zeros((n, h, d))
    for t in range(n):
        p = positions[t]
        lo = max(0, p - window + 1) if window else 0
        for hh in range(h):
            k = K[lo:p + 1, hh // g].astype(np.float64)
            v = V[lo:p + 1, hh // g].astype(np.float64)
            s = k @ q[t, hh].astype(np.float64) * scale
            if sinks is not None:
                s = np.append(s, sinks[hh])
            w = np.exp(s - s.max())
            out[t, hh] = w[:len(v)] @ v / w.sum()
    return out


def run_case(lengths, new, h, kvh, d=64, bs=16, window=0, splits=1, cache_type="f16", seed=0,
             reference=True, k_outlier=1.0, sinks=None):
    """Sequences of lengths[i] tokens, the last new[i] of them computed in this step
    (the earlier ones written to the cache by a first step).  k_outlier: K's channel 5
    that many times larger (Qwen2.5's keys have such channels).  sinks: attention sinks
    [h] (gpt-oss)."""
    rng = np.random.default_rng(seed)
    be = CPUBackend()
    n_blocks = sum((L + bs - 1) // bs for L in lengths) + 3
    kv = be.alloc_kv(1, n_blocks * bs, kvh, d, cache_type=cache_type)
    perm = rng.permutation(n_blocks)           # scattered, non-contiguous block ids
    tables, used = [], 0
    for L in lengths:
        nb = (L + bs - 1) // bs
        tables.append(perm[used:used + nb]); used += nb
    table_arr = np.zeros((len(lengths), max(len(t) for t in tables)), np.int32)
    for i, t in enumerate(tables):
        table_arr[i, :len(t)] = t
    Ks = [rng.standard_normal((L, kvh, d)).astype(np.float32) for L in lengths]
    Vs = [rng.standard_normal((L, kvh, d)).astype(np.float32) for L in lengths]
    for k_ in Ks:
        k_[:, :, 5] *= np.float32(k_outlier)
    scale = 1.0 / np.sqrt(d)

    def step_for(ranges, q_rows):
        pos = np.concatenate([np.arange(a, b) for a, b in ranges]).astype(np.int32)
        owner = np.concatenate([np.full(b - a, i) for i, (a, b) in enumerate(ranges)]).astype(np.int32)
        slots = np.concatenate([tables[i][np.arange(a, b) // bs] * bs + np.arange(a, b) % bs
                                for i, (a, b) in enumerate(ranges)]).astype(np.int32)
        st = Step(tokens=np.zeros(len(pos), np.int32), positions=pos, slots=slots, seq_of_token=owner,
                  block_tables=table_arr, logit_rows=np.zeros(0, np.int64), block_size=bs,
                  attn_scale=scale, attn_splits=splits, windows=[window])
        k = np.concatenate([Ks[i][a:b] for i, (a, b) in enumerate(ranges)])
        v = np.concatenate([Vs[i][a:b] for i, (a, b) in enumerate(ranges)])
        return st, k, v

    first = [(0, L - m) for L, m in zip(lengths, new)]
    if any(b > a for a, b in first):
        st, k, v = step_for(first, None)
        be.arena.reset()
        be.attention(rng.standard_normal((len(st.positions), h, d)).astype(np.float32), k, v, 0, st)
    last = [(L - m, L) for L, m in zip(lengths, new)]
    st, k, v = step_for(last, None)
    q = rng.standard_normal((len(st.positions), h, d)).astype(np.float32)
    be.arena.reset()
    got = be.attention(q, k, v, 0, st, sinks=sinks).reshape(q.shape).copy()
    if not reference:
        yield got, None
        return
    row = 0
    for i, (a, b) in enumerate(last):
        # the values an f16 pool holds; a q8_0 pool's are left exact (the tolerance bounds them)
        Kc = Ks[i].astype(np.float16).astype(np.float32) if cache_type in ("f16", "k16v8") else Ks[i]
        Vc = Vs[i].astype(np.float16).astype(np.float32) if cache_type == "f16" else Vs[i]
        ref = naive(q[row:row + b - a], Kc, Vc, np.arange(a, b), window, scale, sinks)
        yield got[row:row + b - a], ref
        row += b - a


CASES = {
    # name: (lengths, new tokens, heads, kv heads, extra)
    "prefill-odd": ([37], [37], 4, 4, {}),
    "prefill-block-boundaries": ([16, 32, 48], [16, 32, 48], 4, 2, {}),
    "prefill-long-gqa": ([301], [301], 14, 2, {}),
    "mqa": ([77], [77], 8, 1, {}),
    "decode-after-prefill": ([129, 17, 1], [1, 1, 1], 9, 3, {}),
    "chunk-after-cache": ([200], [33], 6, 2, {}),
    "decode-split-context": ([517], [1], 14, 2, {"splits": 4}),
    "decode-split-uneven": ([95], [1], 4, 1, {"splits": 3, "bs": 8}),
    "sliding-window-prefill": ([150], [150], 4, 1, {"window": 40}),
    "sliding-window-decode": ([300], [1], 4, 2, {"window": 64, "splits": 2}),
    "window-not-block-aligned": ([99], [20], 6, 3, {"window": 23, "bs": 16}),
    "block-size-1": ([13], [13], 2, 1, {"bs": 1}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiled_attention_matches_naive(name):
    lengths, new, h, kvh, extra = CASES[name]
    for got, ref in run_case(lengths, new, h, kvh, **extra):
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["prefill-long-gqa", "decode-after-prefill", "decode-split-context",
                                  "decode-split-uneven", "sliding-window-prefill", "sliding-window-decode"])
def test_attention_sinks_match_naive(name):
    """gpt-oss's sinks: a logit per head in each row's softmax denominator, with one
    context split and merged over several; sinks from well below to well above the
    scores (the largest takes most of the weight: the max shifts to the sink)."""
    lengths, new, h, kvh, extra = CASES[name]
    sinks = np.linspace(-6.0, 12.0, h).astype(np.float32)
    for got, ref in run_case(lengths, new, h, kvh, sinks=sinks, **extra):
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    plain = np.concatenate([g.ravel() for g, _ in run_case(lengths, new, h, kvh, reference=False, **extra)])
    sunk = np.concatenate([g.ravel() for g, _ in run_case(lengths, new, h, kvh, reference=False, sinks=sinks,
                                                          **extra)])
    assert np.abs(plain - sunk).max() > 0.1        # the sinks do change the result


@pytest.mark.parametrize("name", ["prefill-long-gqa", "decode-split-context", "sliding-window-prefill"])
def test_q8_0_cache_attention_close_to_exact(name):
    lengths, new, h, kvh, extra = CASES[name]
    for got, ref in run_case(lengths, new, h, kvh, cache_type="q8_0", **extra):
        err = np.abs(got - ref).max()
        assert err < 2e-2, err
        assert np.abs(got - ref).mean() < 2e-3


@pytest.mark.parametrize("name", ["prefill-long-gqa", "decode-split-context", "sliding-window-prefill",
                                  "decode-after-prefill"])
def test_k16v8_cache_attention_close_to_exact_and_to_f16(name):
    """K in f16, V in q8_0: against the exact-V reference and against the f16 cache's
    own output on the same inputs.  A value's q8_0 rounding is at most amax/254 of its
    block (~0.014 here): a token that sees few keys shows it nearly whole.  Measured max
    |err| 1.3e-2, mean over a case's outputs <= 2.1e-3 (q8_0: 1.7e-2, 2.1e-3; with
    Gaussian keys q8_0's K rounding costs little: see the outlier test below)."""
    lengths, new, h, kvh, extra = CASES[name]
    f16 = [got for got, _ in run_case(lengths, new, h, kvh, cache_type="f16", **extra)]
    errs = []
    for (got, ref), g16 in zip(run_case(lengths, new, h, kvh, cache_type="k16v8", **extra), f16):
        for i, other in enumerate((ref, g16)):
            errs.append((i, np.abs(got - other)))
    for i in (0, 1):
        e = np.concatenate([x.ravel() for j, x in errs if j == i])
        assert e.max() < 1.5e-2 and e.mean() < 3e-3, (i, e.max(), e.mean())


@pytest.mark.parametrize("name", ["prefill-long-gqa", "decode-split-context"])
def test_k16v8_keeps_keys_with_an_outlier_channel(name):
    """K with one channel 20x the rest (as Qwen2.5's): q8_0 rounds the block's other 31
    channels to the outlier's step and the scores move (measured max |err| 0.10-0.34,
    mean 7e-3-1.1e-2); k16v8 keeps K in f16 and only V's rounding remains (max 8e-3-1.3e-2,
    mean 8e-4-1.7e-3)."""
    lengths, new, h, kvh, extra = CASES[name]
    err = {}
    for t in ("q8_0", "k16v8"):
        err[t] = np.concatenate([np.abs(g - r).ravel()
                                 for g, r in run_case(lengths, new, h, kvh, cache_type=t, k_outlier=20.0, **extra)])
    assert err["k16v8"].max() < 1.5e-2 and err["k16v8"].mean() < 2e-3
    assert err["k16v8"].mean() * 4 < err["q8_0"].mean()


def _decode_rows(cache_type, lengths, h=14, kvh=2, d=64, bs=16, splits=3, seed=5):
    """Sequences of lengths[i] cached tokens (written once); returns decode(rows): one
    decode step of the sequences `rows` (a token each at its next position, the same
    token's K/V every time), their outputs [len(rows), h, d]."""
    rng = np.random.default_rng(seed)
    be = CPUBackend()
    nblk = [(L + 1 + bs - 1) // bs for L in lengths]
    be.alloc_kv(1, sum(nblk) * bs, kvh, d, cache_type=cache_type)
    perm = rng.permutation(sum(nblk)).astype(np.int32)
    tables = np.zeros((len(lengths), max(nblk)), np.int32)
    o = 0
    for i, nb_ in enumerate(nblk):
        tables[i, :nb_] = perm[o:o + nb_]; o += nb_
    Q = rng.standard_normal((len(lengths), h, d)).astype(np.float32)
    Ks = [rng.standard_normal((L + 1, kvh, d)).astype(np.float32) for L in lengths]
    Vs = [(rng.standard_normal((L + 1, kvh, d)) * 3).astype(np.float32) for L in lengths]

    def step(seqs, starts, ends, q):
        pos = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]).astype(np.int32)
        own = np.concatenate([np.full(b - a, i) for i, a, b in zip(seqs, starts, ends)]).astype(np.int32)
        st = Step(tokens=np.zeros(len(pos), np.int32), positions=pos, slots=tables[own, pos // bs] * bs + pos % bs,
                  seq_of_token=own, block_tables=tables, logit_rows=np.zeros(0, np.int64), block_size=bs,
                  attn_scale=0.125, attn_splits=splits if len(pos) <= be.exact_rows else 1, windows=[0])
        k = np.concatenate([Ks[i][a:b] for i, a, b in zip(seqs, starts, ends)])
        v = np.concatenate([Vs[i][a:b] for i, a, b in zip(seqs, starts, ends)])
        be.arena.reset()
        return be.attention(q, k, v, 0, st).copy()

    seqs = list(range(len(lengths)))
    step(seqs, [0] * len(lengths), lengths, rng.standard_normal((sum(lengths), h, d)).astype(np.float32))

    def decode(rows):
        rows = list(rows)
        return step(rows, [lengths[i] for i in rows], [lengths[i] + 1 for i in rows], Q[rows]).reshape(len(rows), h, d)
    return decode


@pytest.mark.parametrize("cache_type", ["f16", "q8_0", "k16v8"])
def test_decode_row_bit_identical_alone_or_in_batches_up_to_exact_rows(cache_type):
    """Batched decode (the CPU's exact_rows, 31): a sequence's decode row gives the same bits
    alone as in a step with 1..30 other sequences' rows (context lengths on both sides
    of block and split boundaries)."""
    from runtime.backend.cpu import CPUBackend
    m = CPUBackend.exact_rows
    lengths = [5, 16, 17, 31, 47, 64, 65, 100, 127, 128, 129, 200, 255, 256, 300, 333]
    lengths += [7 + 23 * i for i in range(m - len(lengths))]
    decode = _decode_rows(cache_type, lengths)
    batches = {b: decode(range(b)) for b in range(2, m + 1)}
    for i in range(m):
        alone = decode([i])[0]
        for b in range(i + 1, m + 1):
            if b >= 2:
                assert np.array_equal(batches[b][i], alone), (cache_type, i, b)


def test_prefill_peak_memory_grows_linearly():
    """Attention memory for an N-token prefill is O(N): compare N=2048 and N=8192
    (a score matrix would grow 16x; the cache, inputs and outputs grow 4x).
    tracemalloc sees the numpy side; inside the kernel each work item holds only
    O(tile * G * (D + block)) floats."""
    import tracemalloc
    peaks = {}
    for n in (2048, 8192):
        tracemalloc.start()
        for _ in run_case([n], [n], 2, 1, d=64, bs=16, seed=1, reference=False):
            pass
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[8192] / peaks[2048] < 5.0, peaks


@pytest.mark.parametrize("splits", [2, 3])
def test_verify_tile_rounds_like_single_queries(splits):
    """A query's attention is bit-identical whether it comes alone (decode) or
    in a tile with the next few (speculative verify): the context split is the
    query's own, also when the tile crosses a block boundary that a single
    query's split would not (Qwen2.5-1.5B greedy drafted output drifted at
    such a step before)."""
    rng = np.random.default_rng(1)
    bs, h, kvh, d, k = 16, 6, 2, 64, 4
    for length in (31, 34, 47, 50, 64, 97):
        be = CPUBackend()
        n_blocks = (length + bs - 1) // bs + 1
        kv = be.alloc_kv(1, n_blocks * bs, kvh, d)
        table = rng.permutation(n_blocks).astype(np.int32)
        K = rng.standard_normal((length, kvh, d)).astype(np.float32)
        V = rng.standard_normal((length, kvh, d)).astype(np.float32)
        q = rng.standard_normal((k, h, d)).astype(np.float32)

        def attend(p0, n):
            pos = np.arange(p0, p0 + n, dtype=np.int32)
            st = Step(tokens=np.zeros(n, np.int32), positions=pos, slots=(table[pos // bs] * bs + pos % bs),
                      seq_of_token=np.zeros(n, np.int32), block_tables=table[None, :],
                      logit_rows=np.zeros(0, np.int64), block_size=bs, attn_scale=0.125,
                      attn_splits=splits, windows=[0])
            be.arena.reset()
            return be.attention(q[p0 - (length - k):][:n].copy(), K[p0:p0 + n], V[p0:p0 + n], 0, st).copy()

        p0 = length - k
        first = np.arange(p0, dtype=np.int32)      # the context before the tile, written once
        st = Step(tokens=np.zeros(p0, np.int32), positions=first, slots=(table[first // bs] * bs + first % bs),
                  seq_of_token=np.zeros(p0, np.int32), block_tables=table[None, :],
                  logit_rows=np.zeros(0, np.int64), block_size=bs, attn_scale=0.125, attn_splits=1,
                  windows=[0])
        be.arena.reset()
        be.attention(rng.standard_normal((p0, h, d)).astype(np.float32), K[:p0], V[:p0], 0, st)
        tile = attend(p0, k)
        singles = np.concatenate([attend(p0 + i, 1) for i in range(k)])
        assert np.array_equal(tile, singles), (length, np.abs(tile - singles).max())
def _attend_steps(L, chunks, h, kvh, d=64, bs=16, window=0, splits=1, seed=3, cache_type="f16"):
    """Fill a cache with L tokens, then run the last sum(chunks) tokens as steps of
    the given sizes; returns the concatenated outputs (same q, k, v either way)."""
    rng = np.random.default_rng(seed)
    be = CPUBackend()
    nblk = (L + bs - 1) // bs + 1
    be.alloc_kv(1, nblk * bs, kvh, d, cache_type=cache_type)
    table = rng.permutation(nblk)[None, :].astype(np.int32)
    K = rng.standard_normal((L, kvh, d)).astype(np.float32)
    V = rng.standard_normal((L, kvh, d)).astype(np.float32)
    Q = rng.standard_normal((L, h, d)).astype(np.float32)
    outs = []
    a = 0
    for size in [L - sum(chunks)] + list(chunks):
        b = a + size
        pos = np.arange(a, b, dtype=np.int32)
        st = Step(tokens=np.zeros(size, np.int32), positions=pos,
                  slots=(table[0][pos // bs] * bs + pos % bs).astype(np.int32),
                  seq_of_token=np.zeros(size, np.int32), block_tables=table, logit_rows=np.zeros(0, np.int64),
                  block_size=bs, attn_scale=1.0 / np.sqrt(d), attn_splits=splits, windows=[window])
        be.arena.reset()
        o = be.attention(Q[a:b], K[a:b], V[a:b], 0, st).copy()
        if a >= L - sum(chunks):
            outs.append(o)
        a = b
    return np.concatenate(outs)


@pytest.mark.parametrize("L,splits,window", [
    (323, 2, 0),      # rows 318..322: their split lengths differ (160 vs 176 keys)
    (300, 2, 0),
    (517, 4, 0),
    (300, 4, 64),     # sliding window: every row starts its keys elsewhere
    (40, 1, 0),
])
def test_small_step_rows_bit_identical_to_single_steps(L, splits, window):
    """Speculative verification relies on it: a token's attention output in a step
    of k <= 16 tokens equals, bit for bit, stepping the tokens one at a time."""
    batched = _attend_steps(L, [5], 14, 2, splits=splits, window=window)
    single = _attend_steps(L, [1] * 5, 14, 2, splits=splits, window=window)
    assert np.array_equal(batched, single)


@pytest.mark.parametrize("L,splits,window", [(323, 2, 0), (300, 4, 64)])
def test_small_step_rows_bit_identical_to_single_steps_k16v8(L, splits, window):
    batched = _attend_steps(L, [5], 14, 2, splits=splits, window=window, cache_type="k16v8")
    single = _attend_steps(L, [1] * 5, 14, 2, splits=splits, window=window, cache_type="k16v8")
    assert np.array_equal(batched, single)


def test_glu_kernels_match_float64():
    from runtime.backend import cpu_kernels as K
    rng = np.random.default_rng(0)
    g = (rng.standard_normal((7, 301)) * 6).astype(np.float32)
    g[0, :4] = [0.0, -100.0, 100.0, -1e-6]
    u = rng.standard_normal((7, 301)).astype(np.float32)
    x = g.astype(np.float64)
    silu = x / (1 + np.exp(-x)) * u
    gelu = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))) * u
    a = g.copy(); K.silu_mul(a, u)
    b = g.copy(); K.gelu_mul(b, u)
    np.testing.assert_allclose(a, silu, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(b, gelu, rtol=2e-5, atol=2e-5)
