"""Context overflow policies: stop (default), drop-turns (chats), shift (re-rotated keys)."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.context import ContextOverflow, rope_for_layer
from runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def smol(model_path):
    from runtime.loader import load_model
    return load_model(model_path("smollm2-135m"))


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def test_stop_policy_refuses_with_a_clear_message(smol):
    from runtime.engine import Engine
    from runtime.generate import Generation
    eng = Engine(smol, n_ctx=48)
    with pytest.raises(ContextOverflow, match="exceed the context length 48"):
        eng.prefill(eng.new_sequence(), _prompt(49))
    gen = Generation(eng, _prompt(40), GREEDY, max_tokens=100).run()
    assert gen.stats.stop_reason == "context"
    assert len(gen.seq) == 48 and len(gen.ids) == 9      # 8 decode steps fill it; the 9th token is not fed


def _rope_np(x, delta, inv_freq, neox, pos_scale):
    """float64 reference rotation of x [..., D] by delta positions."""
    x = x.astype(np.float64)
    ang = delta / pos_scale * inv_freq.astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    out = x.copy()
    half = len(inv_freq)
    if neox:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half], out[..., half:2 * half] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = a * c - b * s, a * s + b * c
    return out


def _slots(seq, bs, positions):
    t = np.asarray(seq.blocks)
    return t[np.asarray(positions) // bs] * bs + np.asarray(positions) % bs


def test_shift_moves_values_and_rerotates_keys(smol):
    from runtime.engine import Engine
    eng = Engine(smol, n_ctx=128, overflow="shift")
    bs = eng.block_size
    P = _prompt(60, seed=3)
    seq = eng.new_sequence()
    seq.keep = 5
    eng.prefill(seq, P)
    n_discard = 21
    before_k = [k.copy() for k in eng.storage.k]
    before_v = [v.copy() for v in eng.storage.v]
    src = _slots(seq, bs, np.arange(5 + n_discard, 60))
    keep_slots = _slots(seq, bs, np.arange(5))
    eng.shift(seq, n_discard)
    assert seq.tokens == P[:5] + P[5 + n_discard:] and seq.history == P and seq.shifted == n_discard
    dst = _slots(seq, bs, np.arange(5, 60 - n_discard))
    for layer in (0, smol.config.n_layers - 1):
        k, v = eng.storage.k[layer], eng.storage.v[layer]
        np.testing.assert_array_equal(v[dst], before_v[layer][src])            # values move as they are
        np.testing.assert_array_equal(k[_slots(seq, bs, np.arange(5))], before_k[layer][keep_slots])
        inv_freq, neox, ps = rope_for_layer(smol.config, layer)
        want = _rope_np(before_k[layer][src].view(np.float16).astype(np.float32), -n_discard, inv_freq, neox, ps)
        got = k[dst].view(np.float16).astype(np.float64)
        np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=2e-3)
    # layer 0's keys depend only on token and position: they must match a fresh prefill
    fresh = Engine(smol, n_ctx=128)
    s2 = fresh.new_sequence()
    fresh.step([s2], [seq.tokens])
    k_fresh = fresh.storage.k[0][_slots(s2, bs, np.arange(len(seq)))].view(np.float16).astype(np.float32)
    k_shift = eng.storage.k[0][_slots(seq, bs, np.arange(len(seq)))].view(np.float16).astype(np.float32)
    np.testing.assert_allclose(k_shift, k_fresh, atol=0.02 * np.abs(k_fresh).max())
    # shifted blocks are never offered for prefix reuse
    assert len(seq.hashes) == 0 and seq.hash_limit == 0
    eng.release(seq)
    probe = eng.new_sequence()
    assert eng.cache.reuse_prefix(probe, P[:5] + P[5 + n_discard:]) == 0


def test_shift_policy_keeps_generating_past_the_context(smol):
    from runtime.engine import Engine
    from runtime.generate import Generation
    eng = Engine(smol, n_ctx=64, overflow="shift")
    seq = eng.new_sequence()
    seq.keep = 4
    P = _prompt(50, seed=4)
    gen = Generation(eng, P, GREEDY, max_tokens=40, seq=seq).run()
    assert gen.stats.stop_reason == "length" and len(gen.ids) == 40
    assert seq.shifted > 0 and len(seq) <= 64
    assert seq.tokens[:4] == P[:4] and seq.history == P + gen.ids[:-1]
    st = eng.stats()
    assert st["tokens_per_sequence"][seq.seq_id] == len(seq)
    assert st["blocks_used"] == len(seq.blocks) == -(-len(seq) // eng.block_size)


def test_drop_turns_keeps_system_prompt_and_drops_oldest(smol):
    from runtime.chat import ChatSession
    from runtime.engine import Engine
    eng = Engine(smol, n_ctx=112)
    history = []
    for i in range(5):      # an earlier conversation, longer than the context
        history += [{"role": "user", "content": f"Message number {i}: please say something about {i * 7}."},
                    {"role": "assistant", "content": f"The number {i * 7} is a number."}]
    chat = ChatSession(eng, system="You are terse.", params=GREEDY, max_tokens=4, overflow="drop-turns")
    chat.messages = list(history)
    system_ids = chat._render([])[:5]
    "".join(chat.send("And the number 42?"))
    assert chat.dropped_turns > 0 and chat.last_stats.stop_reason in ("eos", "length")
    ids = chat.prompt_ids()
    assert len(ids) + 4 <= 112 and ids[:5] == system_ids
    shown = chat.conversation()
    assert shown[0]["role"] == "system" and shown[1]["role"] == "user"
    assert shown[-2]["content"] == "And the number 42?"
    assert "Message number 0" not in str(shown) and len(chat.messages) == 12    # history is kept for display
    # stop (the default): the same conversation is refused with a clear message
    stop = ChatSession(eng, system="You are terse.", params=GREEDY, max_tokens=4)
    stop.messages = list(history)
    with pytest.raises(ContextOverflow, match="context length 112"):
        "".join(stop.send("And the number 42?"))


def test_policy_helpers():
    from runtime.context import check_policy, fit_turns, shift_amount
    with pytest.raises(ValueError, match="drop-turns"):
        check_policy("truncate")
    assert shift_amount(100, 10, 1, 100) == 45          # half of what may go, as llama.cpp
    assert shift_amount(100, 10, 80, 100) == 80         # at least what the new tokens need
    assert shift_amount(50, 10, 1, 100) == 0
    with pytest.raises(ContextOverflow):
        shift_amount(100, 10, 95, 100)
    msgs = [{"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b" * 10},
            {"role": "user", "content": "c" * 10}, {"role": "assistant", "content": "d" * 10},
            {"role": "user", "content": "e" * 10}]
    render = lambda ms: [0] * (3 + sum(len(m["content"]) for m in ms))   # 3 system tokens
    assert fit_turns(msgs, render, 60, 5) == (0, [0] * 53)
    first, ids = fit_turns(msgs, render, 40, 5)
    assert first == 2 and len(ids) == 33                 # the oldest user+assistant pair went
    with pytest.raises(ContextOverflow, match="last message"):
        fit_turns(msgs, render, 12, 5)
