"""The CUDA backend's attention plan for a step (context splits, key tiles), checked
without a GPU: it may depend on the context width and the model, never on how many
rows a step of up to exact_rows tokens has, or a speculative verify row would be
summed in another order than its one-token step (an 8-row verify of an 8-KV-head
model once took one split where its decode steps took 16-64)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.backend import cuda as cb


def _plan(n, ctx, kvh, hd):
    model = SimpleNamespace(cfg=SimpleNamespace(n_kv_heads=kvh, head_dim=hd))
    be = SimpleNamespace(use_mega=False)
    be._splits = lambda n_, c_, m_: cb.CUDABackend._splits(be, n_, c_, m_)
    return cb.CUDABackend._attn_plan(be, n, ctx, model)


@pytest.mark.parametrize("kvh", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("hd", [64, 96, 128, 256])
def test_plan_of_a_verify_step_is_a_one_token_steps(kvh, hd):
    assert cb.CUDABackend.exact_rows == cb.GRAPH_ROWS == cb.MV_MAX_ROWS
    for width in (8, 16, 32, 64, 128, 256, 512, 1024):      # the decode graph's block-table widths
        ctx = width * 16
        one = _plan(1, ctx, kvh, hd)
        for n in range(2, cb.CUDABackend.exact_rows + 1):
            assert _plan(n, ctx, kvh, hd) == one, (n, ctx)


def test_long_contexts_take_key_tiles_short_ones_do_not():
    assert _plan(1, 8192, 8, 128) == (64, True)         # 128 keys a split
    assert _plan(1, 128, 8, 128) == (16, False)         # 8 keys a split
    assert _plan(1, 8192, 8, 96) == (64, False)         # the tile kernel wants head dims of 64 k
    assert _plan(512, 600, 8, 128)[0] == 1              # a prompt: one split, its own kernel
