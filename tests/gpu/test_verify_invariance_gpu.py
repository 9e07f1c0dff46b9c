"""Speculative verify steps of up to the backend's exact_rows (8) equal one-token steps
bit for bit on models with many KV heads, where the attention's context splits once
depended on rows x KV heads (an 8-row verify of an 8-KV-head model took one split, its
decode steps sixteen: the same token summed in another order).  Longer all-logits steps
(16 rows, once captured as a graph around cuBLAS calls, which crashed) run op by op."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_env import greedy_drafted, greedy_plain

pytestmark = pytest.mark.gpu

SHAPES = {     # head dim 64; n_heads / n_kv_heads = 1 and 4
    "kv8": dict(arch="llama", n_layers=2, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=8, vocab=1000,
                tied=False, rope_theta=1e4),
    "kv4": dict(arch="llama", n_layers=2, d_model=1024, d_ff=1024, n_heads=16, n_kv_heads=4, vocab=1000,
                tied=True, rope_theta=1e4),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def engine(request, tmp_path_factory):
    from lab.synth import load_weights_only, write_random_gguf
    from runtime.engine import Engine
    p = write_random_gguf(tmp_path_factory.mktemp("inv") / f"{request.param}.gguf", mix="Q4_K_M", seed=3,
                          **SHAPES[request.param])
    return Engine(load_weights_only(p), device="cuda", n_ctx=2048)


def _verify_and_singles(engine, plen, rows, seed):
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(1, 1000, plen)]
    extra = [int(t) for t in rng.integers(1, 1000, rows)]
    seq = engine.new_sequence()
    try:
        engine.prefill(seq, prompt)
        engine.step([seq], [[prompt[-1]]])
        base = len(seq)
        batched = engine.step([seq], [extra], all_logits=True)
        engine.cache.truncate(seq, base)
        single = np.stack([engine.step([seq], [[t]])[0] for t in extra])
        assert len(seq) == base + rows
    finally:
        engine.release(seq)
    assert np.all(np.isfinite(single)) and np.all(np.isfinite(batched))
    return batched, single


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_verify_rows_equal_single_steps_many_kv_heads(engine, rows):
    import runtime.backend.cuda as cb
    assert engine.backend.exact_rows == 8
    assert cb.ATT_TILE_KEYS and 2048 // 64 >= cb.ATT_TILE_KEYS     # plen 1500 takes attn_tiles
    # decode steps of 16 and 64 context splits, and of 64 splits by key tiles (attn_tiles)
    for plen in (40, 300, 1500):
        batched, single = _verify_and_singles(engine, plen, rows, rows)
        assert np.array_equal(batched, single), (plen, rows, float(np.abs(batched - single).max()))


def test_longer_all_logits_step_runs_op_by_op(engine):
    """16 rows: past the integer matvec (cuBLAS on fp16 tiles), so not bit-exact, but run
    and close to the one-token steps."""
    batched, single = _verify_and_singles(engine, 300, 16, 16)
    rel = np.abs(batched - single).max() / np.abs(single).max()
    assert rel < 0.05, rel


def test_drafted_greedy_equals_target_alone_at_eight_rows(engine, monkeypatch):
    """The Drafter caps k at exact_rows - 1 on the GPU; fixed k = 7 (8-row verify steps,
    the draft the target itself: every draft accepted) gives the target's greedy tokens."""
    import runtime.speculative as sp
    from runtime.engine import Engine
    monkeypatch.setattr(sp, "check_same_vocab", lambda d, t: None)   # one file (no tokenizer): one vocabulary
    draft = Engine(engine.loaded, device="cuda", n_ctx=2048)
    assert sp.Drafter(draft, engine, k=15).k == 7
    drafter = sp.Drafter(draft, engine, k=7, adaptive=False)
    ids = [int(t) for t in np.random.default_rng(5).integers(1, 1000, 200)]
    plain = greedy_plain(engine, ids, 40)
    out = greedy_drafted(engine, drafter, ids, 40)
    drafter.release()
    assert out == plain
    assert drafter.stats.verify_forwards > 0 and drafter.stats.accepted >= 7 * (drafter.stats.verify_forwards - 1)
