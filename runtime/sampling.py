"""Turning logits into the next token: llama.cpp's chain, in its order —
repetition penalty, top-k, top-p, min-p, temperature, then a seeded draw.
`temperature <= 0` is greedy.  `probs()` exposes the final distribution, which
speculative sampling needs for both models.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def argmax_only(self) -> bool:
        """The next token is the logits' argmax and nothing else of them is used (greedy,
        no repetition penalty): the engine can give the argmax alone (Engine.step's
        argmax=True), which the CUDA backend computes on the device."""
        return self.greedy and self.repeat_penalty == 1.0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def penalize(self, logits: np.ndarray, history) -> np.ndarray:
        p = self.p
        if p.repeat_penalty == 1.0 or not len(history):
            return logits
        logits = logits.copy()
        recent = np.unique(np.asarray(history[-p.repeat_last_n:], np.int64))
        vals = logits[recent]
        logits[recent] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        return logits

    def probs(self, logits: np.ndarray, history=()) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, their probabilities) after the whole filter chain."""
        p = self.p
        logits = self.penalize(np.asarray(logits, np.float32), history)
        k = p.top_k if 0 < p.top_k < logits.size else logits.size
        ids = np.argpartition(-logits, k - 1)[:k] if k < logits.size else np.arange(logits.size)
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        x = logits[ids].astype(np.float64)
        probs = np.exp(x - x[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, x, probs = ids[:keep], x[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = int(np.count_nonzero(probs >= p.min_p * probs[0])) or 1
            ids, x = ids[:keep], x[:keep]
        t = max(p.temperature, 1e-6)
        probs = np.exp((x - x[0]) / t)
        return ids, probs / probs.sum()

    def sample(self, logits: np.ndarray, history=()) -> int:
        if self.p.greedy:
            logits = self.penalize(np.asarray(logits), history)
            return int(np.argmax(logits))
        ids, probs = self.probs(logits, history)
        return int(ids[self.rng.choice(len(ids), p=probs)])
