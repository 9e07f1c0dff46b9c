"""moe.ExpertChunks: how the CUDA backend lays a prompt's (token, expert) pairs out for
batched expert GEMMs (quant.cuda.matmul_experts).  Every pair gets a row of its own that
holds its token and expert; a chunk holds at most `cap` experts with the same row count,
its largest run, and no expert in it has half that or less (padding at most doubles a
chunk); pad rows repeat a token of their own expert."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.backend import moe


@pytest.mark.parametrize("n,E,k,cap", [(100, 128, 8, 40), (512, 32, 4, 7), (9, 8, 2, 1), (50, 16, 2, 100),
                                       (1, 4, 1, 3), (300, 60, 6, 2)])
def test_every_pair_has_its_own_row_with_its_token_and_expert(n, E, k, cap):
    rng = np.random.default_rng(n + E)
    logits = rng.standard_normal((n, E)).astype(np.float32)
    logits[:, 3] += 3                                  # a hot expert: skewed runs
    w, tokens, starts, pos = moe.plan(logits, k, True)
    ids = np.empty((n, k), np.int32)
    moe.route(logits, k, True, ids, np.empty((n, k), np.float32))
    ck = moe.ExpertChunks(starts, tokens, pos, cap)
    assert ck.pos.shape == (n, k) and len(np.unique(ck.pos)) == n * k and ck.pos.max() < ck.rows
    assert np.array_equal(ck.src[ck.pos], np.broadcast_to(np.arange(n)[:, None], (n, k)))
    assert np.array_equal(ck.eid[ck.pos], ids)
    counts = np.diff(starts)
    assert sorted(ck.experts.tolist()) == np.flatnonzero(counts).tolist()
    rows = 0
    for (j0, j1), base, pad in zip(ck.chunks, ck.base, ck.pad):
        assert base == rows and 1 <= j1 - j0 <= min(cap, ck.most)
        run = counts[ck.experts[j0:j1]]
        assert pad == run.max() == run[0] and (2 * run > pad).all()
        for j, e in enumerate(ck.experts[j0:j1]):
            r = slice(base + j * pad, base + (j + 1) * pad)
            assert (ck.eid[r] == e).all()
            assert set(ck.src[r]) == set(tokens[starts[e]:starts[e + 1]])     # pads repeat its tokens
        rows += (j1 - j0) * pad
    assert rows == ck.rows <= 2 * n * k
    assert ck.most == max(j1 - j0 for j0, j1 in ck.chunks)


def test_chunks_go_most_pairs_first():
    logits = np.zeros((64, 8), np.float32)
    logits[:, 5] = 2.0                                 # every token's first choice
    logits[:40, 2] = 1.0                               # 40 tokens' second; the other 24 tie: expert 0
    w, tokens, starts, pos = moe.plan(logits, 2, False)
    ck = moe.ExpertChunks(starts, tokens, pos, 8)
    assert ck.experts.tolist() == [5, 2, 0]
    assert ck.chunks == [(0, 2), (2, 3)] and ck.pad == [64, 24]     # 24 is not over half of 64
    assert ck.rows == 2 * 64 + 24
