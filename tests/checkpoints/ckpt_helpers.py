"""Helpers shared by the checkpoint tests: a prompt, our logits, KL divergence, an edited config."""
from __future__ import annotations

import json
import shutil

import numpy as np

PROMPT = ("The GNU General Public License is a free, copyleft license for software and other kinds of "
          "works. In 1905, Albert Einstein published four papers that")


def engine_logits(lm, ids, n_ctx=256):
    from runtime.engine import Engine
    eng = Engine(lm, n_ctx=n_ctx)
    return eng.step([eng.new_sequence()], [ids], all_logits=True)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl(p_logits, q_logits):
    """Per-row KL(P || Q) in nats."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def edit_config(src, dst, **changes):
    """A copy of the checkpoint folder src at dst with config.json's keys changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def assert_batch_invariant(eng, prompts, n_steps=6):
    """Sequences decoding together get bit for bit the logits each gets alone (any backend:
    the GPU tests call it too)."""
    def prefill(p):
        s = eng.new_sequence()
        return s, int(eng.prefill(s, p).argmax())

    alone = []
    for p in prompts:
        s, t = prefill(p)
        rows = []
        for _ in range(n_steps):
            rows.append(eng.step([s], [[t]])[0])
            t = int(rows[-1].argmax())
        alone.append(np.stack(rows))
        eng.release(s, keep_cached=False)
    started = [prefill(p) for p in prompts]
    seqs, last = [s for s, _ in started], [t for _, t in started]
    for i in range(n_steps):
        out = eng.step(seqs, [[t] for t in last])
        for b in range(len(seqs)):
            assert np.array_equal(out[b], alone[b][i]), f"sequence {b}, step {i}"
        last = [int(r.argmax()) for r in out]
    for s in seqs:
        eng.release(s, keep_cached=False)


def assert_verify_rows_equal_single_steps(eng, ids):
    """A k+1-token step (speculative verify) equals feeding its tokens one at a time, for a
    step of 7 tokens and one of the backend's exact_rows (31 on the CPU)."""
    for k in sorted({7, min(eng.backend.exact_rows, len(ids) - 40)}):
        _verify_rows(eng, ids, k)


def _verify_rows(eng, ids, k):
    extra = ids[40:40 + k]
    seq, other = eng.new_sequence(), eng.new_sequence()     # (no roll-back: a sliding window frees blocks)
    eng.step([seq], [ids[:40]])
    eng.step([other], [ids[:40]])
    batched = eng.step([seq], [extra], all_logits=True)
    single = np.stack([eng.step([other], [[t]])[0] for t in extra])
    for s in (seq, other):
        eng.release(s)
    assert np.array_equal(batched, single), k
