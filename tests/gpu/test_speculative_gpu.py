"""Speculative decoding on the CUDA backend: the verify step's rows equal one-token
steps bit for bit (decode steps replay the captured graph, verify runs eager),
so greedy drafted decoding equals the target alone."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_env import greedy_drafted, greedy_plain, model_files

pytestmark = pytest.mark.gpu

MODELS = model_files()


@pytest.fixture(scope="module", params=MODELS[:2] or [None], ids=lambda p: p.name if p else "none")
def gpu_pair(request):
    if request.param is None:
        pytest.skip("no model files: set LLAMBA_GPU_TEST_MODELS or fetch the catalog models")
    from lab.synth import load_weights_only
    from runtime.engine import Engine
    lm = load_weights_only(request.param)
    return Engine(lm, device="cuda", n_ctx=512), Engine(lm, device="cuda", n_ctx=512), lm


def test_verify_rows_equal_single_steps(gpu_pair):
    eng = gpu_pair[0]
    rng = np.random.default_rng(0)
    vocab = eng.config.vocab_size
    for plen in (12, 29, 30, 47, 61):            # verify tiles inside a block and across block edges
        prompt = [int(t) for t in rng.integers(1, vocab, plen)]
        extra = [int(t) for t in rng.integers(1, vocab, 4)]
        seq = eng.new_sequence()
        try:
            eng.prefill(seq, prompt)
            eng.step([seq], [[prompt[-1]]])   # a graph-replayed decode step first
            base = len(seq)
            batched = eng.step([seq], [extra], all_logits=True)
            eng.cache.truncate(seq, base)
            single = np.stack([eng.step([seq], [[t]])[0] for t in extra])
            assert np.array_equal(batched, single), (plen, float(np.abs(batched - single).max()))
        finally:
            eng.release(seq)


@pytest.mark.parametrize("draft_vocab", [0, 500])
def test_greedy_drafted_equals_target_alone(gpu_pair, draft_vocab, monkeypatch):
    """draft_vocab 0: the draft is the target on the GPU (accepts everything);
    500: a CPU draft that only proposes ids < 500 (the GPU's output layer is not
    cut), so it is often rejected and both caches roll back."""
    import runtime.speculative as sp
    from runtime.engine import Engine
    monkeypatch.setattr(sp, "check_same_vocab", lambda d, t: None)   # one file: one vocabulary
    target, draft, lm = gpu_pair
    if draft_vocab:
        draft = Engine(lm, device="cpu", n_ctx=512)
    ids = np.random.default_rng(3).integers(1, target.config.vocab_size, 9).tolist()
    plain = greedy_plain(target, ids, 40)
    drafter = sp.Drafter(draft, target, k=4, adaptive=False, draft_vocab=draft_vocab)
    spec = greedy_drafted(target, drafter, ids, 40)
    st = drafter.stats.as_dict()
    print(f"{lm.path.name} draft_vocab={draft_vocab}: drafted {st['drafted']} accepted {st['accepted']}")
    assert spec == plain
    if draft_vocab:
        assert st["accepted"] < st["drafted"] / 2           # rejections and rollbacks happened
    else:
        assert st["accepted"] > st["drafted"] / 2
    drafter.release()
    assert target.stats()["blocks_used"] == 0 and draft.stats()["blocks_used"] == 0
