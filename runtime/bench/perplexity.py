"""Perplexity as llama.cpp's `llama-perplexity` computes it: the text is cut into
chunks of n_ctx tokens (the first replaced by BOS when the model uses one), and
only the second half of each chunk is scored, so every scored token sees at
least n_ctx/2 tokens of context.
"""
from __future__ import annotations

import math

import numpy as np


def perplexity(engine, text: str, n_ctx: int = 512, max_chunks: int = 0, progress=None) -> dict:
    tok = engine.tokenizer
    ids = tok.encode(text, add_bos=False, parse_special=False)
    n_chunks = len(ids) // n_ctx
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise ValueError(f"text has {len(ids)} tokens: need at least {n_ctx} for one chunk of -c {n_ctx}")
    first = n_ctx // 2
    nll = []
    for c in range(n_chunks):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if tok.add_bos and tok.bos_id is not None:
            chunk[0] = tok.bos_id
        seq = engine.new_sequence()
        try:
            logits = engine.step([seq], [chunk], all_logits=True)
        finally:
            engine.release(seq)
        rows = logits[first - 1:n_ctx - 1].astype(np.float64)
        targets = np.asarray(chunk[first:], np.int64)
        mx = rows.max(axis=1)
        lse = mx + np.log(np.exp(rows - mx[:, None]).sum(axis=1))
        nll.extend(lse - rows[np.arange(len(targets)), targets])
        if progress:
            progress(c + 1, n_chunks, math.exp(float(np.mean(nll))))
    nll = np.asarray(nll)
    mean = float(nll.mean())
    stderr_nll = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    ppl = math.exp(mean)
    return {"ppl": ppl, "stderr": ppl * stderr_nll, "chunks": n_chunks, "tokens_scored": int(len(nll))}
