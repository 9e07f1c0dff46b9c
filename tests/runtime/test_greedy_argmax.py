"""Greedy decoding's argmax seam: Engine.step(argmax=True) gives np.argmax of the logits
Engine.step returns (the CPU backend's forward_argmax; the CUDA backend computes it on
the device, tests/gpu/test_greedy_argmax_gpu.py), greedy generation takes it and yields
what the logits path yields, and the CUDA decode graph's in-place step fill writes what
_pack_step packs (host-side code: runs here)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from runtime.engine import Engine
from runtime.generate import Generation, _plain_tokens
from runtime.sampling import Sampler, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class LogitsGreedy(SamplingParams):
    """Greedy, but the token loop takes the logits and np.argmax (the path before the seam)."""

    @property
    def argmax_only(self) -> bool:
        return False


@pytest.fixture(scope="module")
def smol(model_path):
    return Engine(str(model_path("smollm2-135m")), n_ctx=512, threads=2)


def test_argmax_only_means_greedy_without_penalty():
    assert SamplingParams(temperature=0.0).argmax_only
    assert not SamplingParams(temperature=0.0, repeat_penalty=1.1).argmax_only
    assert not SamplingParams(temperature=0.7).argmax_only
    assert not LogitsGreedy(temperature=0.0).argmax_only


def test_step_argmax_equals_argmax_of_logits(smol):
    """One sequence and two at once, last rows and all rows: the ids are np.argmax of the
    rows the logits step returns for the same inputs (rolled back between the two)."""
    eng = smol
    rng = np.random.default_rng(0)
    a, b = eng.new_sequence(), eng.new_sequence()
    try:
        eng.prefill(a, rng.integers(5, 1000, 21).tolist())
        eng.prefill(b, rng.integers(5, 1000, 7).tolist())
        for new, all_logits in (([[17]], False), ([[17], [99]], False), ([[3, 4, 5], [6]], True),
                                ([[3, 4, 5], [6, 7]], False)):
            seqs = [a, b][:len(new)]
            lens = [len(s) for s in seqs]
            logits = eng.step(seqs, new, all_logits=all_logits)
            for s, n in zip(seqs, lens):
                eng.cache.truncate(s, n)
            ids = eng.step(seqs, new, all_logits=all_logits, argmax=True)
            for s, n in zip(seqs, lens):
                eng.cache.truncate(s, n)
            assert ids.dtype == np.int64 and ids.shape == (logits.shape[0],)
            np.testing.assert_array_equal(ids, np.argmax(logits, axis=-1))
    finally:
        eng.release(a)
        eng.release(b)


def _ids(eng, params, prompt, n):
    sampler = Sampler(params)
    seq = eng.new_sequence()
    history = list(prompt)
    try:
        src = _plain_tokens(eng, seq, eng.prefill(seq, prompt), history, sampler)
        out = []
        for t in src:
            out.append(t)
            history.append(t)
            if len(out) == n:
                return out
    finally:
        eng.release(seq)


def test_greedy_generation_same_with_and_without_argmax_seam(smol):
    eng = smol
    prompt = eng.tokenizer.encode("def fibonacci(n):\n    ")
    calls = {"argmax": 0}
    fwd = eng.backend.forward_argmax

    def counting(model, step):
        calls["argmax"] += 1
        return fwd(model, step)
    eng.backend.forward_argmax = counting
    try:
        fast = _ids(eng, GREEDY, prompt, 24)
        assert calls["argmax"] == 23          # every decode step took the argmax seam
        slow = _ids(eng, LogitsGreedy(temperature=0.0), prompt, 24)
        assert calls["argmax"] == 23          # and the logits path none
    finally:
        del eng.backend.forward_argmax
    assert fast == slow
    gen = Generation(eng, prompt, GREEDY, max_tokens=24).run()
    assert gen.ids == fast[:len(gen.ids)] and len(gen.ids) > 0


def test_bench_tg_takes_the_greedy_seam(smol):
    """bench's tg decodes as generation does: through Engine.step(argmax=True)."""
    from runtime.bench.speed import time_tg
    eng = smol
    seen = []
    fwd = eng.backend.forward_argmax
    eng.backend.forward_argmax = lambda model, step: seen.append(len(step.tokens)) or fwd(model, step)
    try:
        assert time_tg(eng, 5, np.random.default_rng(0)) > 0
    finally:
        del eng.backend.forward_argmax
    assert seen == [1] * 5


def _fill_each_equals_pack(steps):
    """Fill one graph buffer (starting as another step's) with each step in turn: it
    must then hold what _pack_step packs for that step."""
    from runtime.backend.cuda import _decode_fill_views, _fill_decode, _pack_step, CUDABackend
    mb = CUDABackend._graph_width(max(s.block_tables.shape[1] for s in steps))
    flat, layout = _pack_step(steps[-1], mb)
    host = flat.copy()
    fill = _decode_fill_views(host, layout)
    for s in steps:
        want, lay = _pack_step(s, mb)
        assert lay == layout
        _fill_decode(fill, s)
        np.testing.assert_array_equal(host, want)


def _recording_engine(path):
    """An engine whose backend keeps every Step it is given (the list comes back with it)."""
    eng = Engine(str(path), n_ctx=512, threads=2)
    steps = []
    fwd = eng.backend.forward

    def record(model, step):
        steps.append(step)
        return fwd(model, step)
    eng.backend.forward = record
    return eng, steps


def test_decode_fill_in_place_equals_pack(model_path):
    """The CUDA decode graph writes each one-token step (and a verify graph each step of
    its k rows) into its packed host buffer in place (_fill_decode); the buffer must then
    hold what _pack_step packs for that step, whatever step was there before: block
    tables that grow, shrink (rollback) and, with gemma3, two layer groups (global and
    sliding window)."""
    for name in ("smollm2-135m", "gemma3-270m"):
        eng, steps = _recording_engine(model_path(name))
        seq = eng.new_sequence()
        eng.prefill(seq, list(range(5, 40)))
        for t in range(6):
            eng.step([seq], [[50 + t]])
        eng.cache.truncate(seq, 30)                  # back across a block edge
        for t in range(20):
            eng.step([seq], [[70 + t]])
        for k in (3, 4, 4, 3):                      # speculative verify steps, rolled back
            base = len(seq)
            eng.step([seq], [list(range(90 + k, 90 + 2 * k))], all_logits=True)
            eng.cache.truncate(seq, base + 1)
        eng.release(seq)
        for k in (3, 4):                            # a verify step's graph: k rows in place
            ks = [s for s in steps if len(s.tokens) == k]
            assert len(ks) == 2 and list(ks[0].logit_rows) == list(range(k))
            _fill_each_equals_pack(ks)
        one = [s for s in steps if len(s.tokens) == 1]
        assert len(one) == 26
        if name == "gemma3-270m":
            assert len(one[0].group_tables) == 2
        _fill_each_equals_pack(one)


def test_decode_fill_in_place_equals_pack_several_sequences(model_path):
    """A decode graph of several sequences (a token each, the server's batches) is filled in
    place too: each sequence's row of the block tables, tables that grow and a sequence that
    finishes and is replaced by a shorter one, two layer groups with gemma3."""
    for name in ("smollm2-135m", "gemma3-270m"):
        eng, steps = _recording_engine(model_path(name))
        seqs = [eng.new_sequence() for _ in range(3)]
        for i, s in enumerate(seqs):
            eng.prefill(s, list(range(5, 5 + 10 + 13 * i)))
        for t in range(20):
            if t == 10:                              # the longest finishes; a short one takes its place
                eng.release(seqs[2])
                seqs[2] = eng.new_sequence()
                eng.prefill(seqs[2], [7, 8, 9])
            eng.step(seqs, [[60 + t]] * 3)
        batched = [s for s in steps if s.block_tables.shape[0] == 3]
        assert len(batched) == 20
        for part in (batched[:10], batched[10:]):
            _fill_each_equals_pack(part)
        for s in seqs:
            eng.release(s)
