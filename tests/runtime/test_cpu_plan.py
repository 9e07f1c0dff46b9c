"""Recorded small steps on the CPU (runtime/backend/cpu_plan.py): replaying a step's
kernel calls gives the logits of the model's plain forward, bit for bit, on the three
architectures (llama, qwen2 with its q/k/v biases, gemma3 with sliding-window layers and
two block tables), for decode steps across several block-table widths and for
speculative verify steps; and a plan is dropped when the weights change under it."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.backend import cpu_plan
from runtime.engine import Engine

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]


@pytest.fixture(scope="module", params=MODELS)
def engine(request, model_path):
    return Engine(str(model_path(request.param)), threads=2, n_ctx=512)


def _walk(eng, prompt, n, planned: bool):
    """Logits of n greedy decode steps, then of three 4-row and three 3-row verify-like
    steps (a shape is recorded the second time it comes, replayed from the third); and
    the ids of a last greedy (argmax) step."""
    be = eng.backend
    saved = be.plans
    if not planned:
        be.plans = None
    seq = eng.new_sequence()
    out = []
    try:
        eng.prefill(seq, prompt)
        t = prompt[-1]
        for _ in range(n):
            logits = eng.step([seq], [[t]])
            out.append(logits[0])
            t = int(np.argmax(logits[0]))
        for i in range(3):
            out.extend(eng.step([seq], [[t + i, 11, 12, 13]], all_logits=True))
        for i in range(3):
            out.extend(eng.step([seq], [[14, 15 + i, 16]], all_logits=True))
        ids = eng.step([seq], [[17]], argmax=True)
    finally:
        eng.release(seq, keep_cached=False)
        be.plans = saved
    return np.stack(out), ids


@pytest.mark.parametrize("min_width", [cpu_plan.MIN_WIDTH, 4])
def test_replayed_steps_equal_plain_forward(engine, min_width, monkeypatch):
    eng = engine
    plans = eng.backend.plans
    assert plans is not None
    monkeypatch.setattr(cpu_plan, "MIN_WIDTH", min_width)
    plans.clear()
    prompt = eng.tokenizer.encode("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n")
    plain, plain_ids = _walk(eng, prompt, 70, planned=False)
    r0, p0 = plans.recorded, plans.replayed
    planned, planned_ids = _walk(eng, prompt, 70, planned=True)
    # the 1-row decode, then the 4- and 3-row shapes, recorded once each at the default width;
    # at width 4, 70 steps past a ~25-token prompt cross widths 4 and 8 (16-token blocks) too
    assert plans.recorded - r0 == (3 if min_width >= 8 else 4) and plans.replayed - p0 >= 60
    assert not plans.refused
    np.testing.assert_array_equal(planned, plain)
    assert planned_ids.tolist() == plain_ids.tolist()


def test_plan_dropped_when_weights_change(model_path):
    """restrict_draft_vocab swaps the output layer: the next step must use the new one."""
    from runtime.speculative import restrict_draft_vocab
    eng = Engine(str(model_path("smollm2-135m")), threads=2, n_ctx=256)
    prompt = eng.tokenizer.encode("The capital of France is")
    seq = eng.new_sequence()
    eng.prefill(seq, prompt)
    for t in (5, 6, 7):
        full = eng.step([seq], [[t]])
    assert eng.backend.plans.replayed >= 1
    restrict_draft_vocab(eng, 1000)
    n = len(seq)
    eng.cache.truncate(seq, n - 1)
    small = eng.step([seq], [[7]])
    assert small.shape[-1] == 1000
    np.testing.assert_array_equal(small[0], full[0][:1000])


def test_out_of_range_token_is_refused_on_replay(model_path):
    eng = Engine(str(model_path("smollm2-135m")), threads=2, n_ctx=256)
    seq = eng.new_sequence()
    eng.prefill(seq, eng.tokenizer.encode("Hello"))
    eng.step([seq], [[5]])
    eng.step([seq], [[6]])                      # recorded, then replayed
    with pytest.raises(IndexError):
        eng.step([seq], [[eng.config.vocab_size + 3]])


def test_op_outside_the_recording_turns_plans_off(model_path):
    """An op that bypasses Scratch.call (here: rmsnorm in NumPy, on a backend that claims
    its ops record) leaves stale buffers in a replay: the first replay's check against the
    plain forward catches it, plans go off for the model, and every step's logits are the
    plain forward's."""
    from runtime.backend.cpu import CPUBackend

    class Sloppy(CPUBackend):
        plans_ok = True

        def rmsnorm(self, x, w, eps):
            out = self.arena.get(x.shape)
            d = x.shape[-1]
            x2 = x.reshape(-1, d).astype(np.float64)
            out.reshape(-1, d)[:] = (x2 / np.sqrt((x2 * x2).mean(-1, keepdims=True) + eps) * w).astype(np.float32)
            return out

    eng = Engine(str(model_path("smollm2-135m")), threads=2, n_ctx=256)
    prompt = eng.tokenizer.encode("The capital of France is")
    ref = []
    seq = eng.new_sequence()
    eng.backend.__class__ = Sloppy
    eng.backend.plans = None
    eng.prefill(seq, prompt)
    for t in (5, 6, 7, 8):
        ref.append(eng.step([seq], [[t]])[0])
    eng.release(seq, keep_cached=False)
    from runtime.backend.cpu_plan import Plans
    eng.backend.plans = plans = Plans()
    seq = eng.new_sequence()
    eng.prefill(seq, prompt)
    got = [eng.step([seq], [[t]])[0] for t in (5, 6, 7, 8)]
    assert plans.broken and not plans.plans
    np.testing.assert_array_equal(np.stack(got), np.stack(ref))


def test_subclass_without_plans_ok_gets_no_plans(model_path):
    from runtime.backend.cpu import CPUBackend

    class Other(CPUBackend):
        def add(self, x, y):
            x += y

    eng = Engine(str(model_path("smollm2-135m")), threads=2, n_ctx=256)
    eng.backend.__class__ = Other
    seq = eng.new_sequence()
    eng.prefill(seq, eng.tokenizer.encode("Hello"))
    for t in (5, 6, 7):
        eng.step([seq], [[t]])
    assert eng.backend.plans.recorded == 0


def test_setup_events_mark_the_one_time_steps(model_path):
    """A shape's second step records its plan and its third is checked against the plain
    forward: Engine.setup_events counts those two, so speculative decoding's cost model
    (KController) leaves their times out."""
    eng = Engine(str(model_path("smollm2-135m")), threads=2, n_ctx=256)
    seq = eng.new_sequence()
    eng.prefill(seq, eng.tokenizer.encode("The capital of France is"))     # a 5-token step: another shape
    counts = []
    for t in (5, 6, 7, 8, 9):
        eng.step([seq], [[t]])
        counts.append(eng.setup_events)
    assert counts == [0, 1, 2, 2, 2]


def test_untimed_round_only_counts_acceptance():
    from runtime.speculative import KController
    ctl = KController()
    ctl.observe_plain(0.030)
    ctl.observe_round(3, 3, 0.008, 0.045, timed=False)
    assert ctl.t_verify == {} and ctl.t_draft is None and ctl.accepted == 3
    ctl.observe_round(3, 2, 0.008, 0.045)
    assert ctl.t_verify[3] == 0.045 and ctl.t_draft == 0.008
