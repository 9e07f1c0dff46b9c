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
