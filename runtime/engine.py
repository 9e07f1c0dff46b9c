"""The Engine: a loaded model, a backend and a paged KV cache, driven one step at a time.

`Engine.step` runs one forward for a set of sequences each contributing 1..n new
tokens.  Prefill, decode, speculative verification and batched decoding are all
this one call with different inputs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from models import model_class

from .backend import make_backend
from .kv_cache import CacheFull, PagedKVCache, Sequence
from .loader import LoadedModel, load_model


class ContextOverflow(RuntimeError):
    """A sequence would grow past the context length."""


@dataclass
class Step:
    """Everything a forward pass needs to know about the tokens it processes."""
    tokens: np.ndarray         # int32 [N]
    positions: np.ndarray      # int32 [N]
    slots: np.ndarray          # int32 [N] cache slot of each new token
    seq_of_token: np.ndarray   # int32 [N] row of block_tables for each token
    block_tables: np.ndarray   # int32 [S, max_blocks]
    logit_rows: np.ndarray     # int64 rows of the batch whose logits are wanted
    block_size: int
    attn_scale: float
    attn_splits: int
    windows: list = field(default_factory=list)   # per layer; 0 = full attention

    def window(self, layer: int) -> int:
        return self.windows[layer]


class Engine:
    def __init__(self, model: str | LoadedModel, *, device: str = "cpu", n_ctx: int = 0,
                 block_size: int = 16, cache_blocks: int = 0, threads: int | None = None,
                 announce=None):
        self.backend = make_backend(device, threads=threads, announce=announce)
        lm = model if isinstance(model, LoadedModel) else load_model(model)
        self.loaded = lm
        self.config = cfg = lm.config
        self.tokenizer = lm.tokenizer
        self.model = model_class(cfg.arch)(cfg, {n: self.backend.upload(t) for n, t in lm.tensors.items()})
        self.n_ctx = min(n_ctx or 4096, cfg.context_length)
        self.block_size = block_size
        n_blocks = cache_blocks or 2 * math.ceil(self.n_ctx / block_size)
        storage = self.backend.alloc_kv(cfg.n_layers, n_blocks * block_size, cfg.n_kv_heads, cfg.head_dim)
        self.cache = PagedKVCache(n_blocks, block_size, storage.bytes_per_token,
                                  copy_block=lambda s, d: storage.copy_block(s, d, block_size))
        self.windows = [cfg.sliding_window if cfg.is_local_layer(i) else 0 for i in range(cfg.n_layers)]
        self.attn_scale = cfg.attn_scale or 1.0 / math.sqrt(cfg.head_dim)

    # ---- sequences ---------------------------------------------------------------
    def new_sequence(self) -> Sequence:
        return self.cache.new_sequence()

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq)

    # ---- one forward -------------------------------------------------------------
    def step(self, seqs: list[Sequence], new_tokens: list[list[int]], all_logits: bool = False) -> np.ndarray:
        """Append new_tokens[i] to seqs[i] and return logits: the last row of each
        sequence, or every new row when all_logits (speculative verification)."""
        for seq, toks in zip(seqs, new_tokens):
            if len(seq) + len(toks) > self.n_ctx:
                raise ContextOverflow(f"context full: {len(seq)} + {len(toks)} tokens exceed the "
                                      f"context length {self.n_ctx}")
        slots, positions, owner, rows = [], [], [], []
        n = 0
        for i, (seq, toks) in enumerate(zip(seqs, new_tokens)):
            slots.append(self.cache.reserve(seq, len(toks)))
            positions.append(np.arange(len(seq), len(seq) + len(toks), dtype=np.int32))
            owner.append(np.full(len(toks), i, np.int32))
            rows.extend(range(n, n + len(toks)) if all_logits else [n + len(toks) - 1])
            n += len(toks)
        max_blocks = max(len(s.blocks) for s in seqs)
        tables = np.zeros((len(seqs), max_blocks), np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s.blocks)] = s.blocks
        ctx = max(len(s) + len(t) for s, t in zip(seqs, new_tokens))
        step = Step(
            tokens=np.concatenate([np.asarray(t, np.int32) for t in new_tokens]),
            positions=np.concatenate(positions), slots=np.concatenate(slots),
            seq_of_token=np.concatenate(owner), block_tables=tables,
            logit_rows=np.asarray(rows, np.int64), block_size=self.block_size,
            attn_scale=self.attn_scale, attn_splits=self._splits(n, ctx), windows=self.windows)
        logits = self.backend.forward(self.model, step)
        for seq, toks in zip(seqs, new_tokens):
            self.cache.commit(seq, toks)
        return logits

    def _splits(self, n_tokens: int, ctx: int) -> int:
        """Context splits for flash-decoding: enough work items to feed every thread
        when few tokens attend over a long context, none for short contexts."""
        threads = getattr(self.backend, "threads", 1)
        items = n_tokens * self.config.n_kv_heads
        if ctx < 256 or items >= 2 * threads:
            return 1
        return max(1, min(ctx // 128, math.ceil(2 * threads / items)))

    def prefill(self, seq: Sequence, tokens: list[int], chunk: int = 512) -> np.ndarray:
        """Feed a prompt (reusing cached prefix blocks) and return the last token's logits."""
        if not seq.tokens and tokens:
            self.cache.reuse_prefix(seq, tokens)
        if tokens[:len(seq)] != seq.tokens:
            raise ValueError("prompt does not continue the sequence's cached tokens")
        if len(seq) == len(tokens):           # all cached: recompute the last token for its logits
            self.cache.truncate(seq, len(tokens) - 1)
        todo = tokens[len(seq):]
        logits = None
        for i in range(0, len(todo), chunk):
            logits = self.step([seq], [todo[i:i + chunk]])
        return logits[0]

    def stats(self) -> dict:
        return self.cache.stats().as_dict()
