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
from .context import ContextOverflow, check_policy, rope_for_layer, shift_amount
from .kv_cache import RELEASED, CacheFull, LayerGroup, PagedKVCache, Sequence
from .loaded_model import LoadedModel
from .loader import load_model


@dataclass
class Step:
    """Everything a forward pass needs to know about the tokens it processes."""
    tokens: np.ndarray         # int32 [N]
    positions: np.ndarray      # int32 [N]
    slots: np.ndarray          # int32 [N] cache slot of each new token
    seq_of_token: np.ndarray   # int32 [N] row of block_tables for each token
    block_tables: np.ndarray   # int32 [S, max_blocks] (layer group 0)
    logit_rows: np.ndarray     # int64 rows of the batch whose logits are wanted
    block_size: int
    attn_scale: float
    attn_splits: int
    windows: list = field(default_factory=list)   # per layer; 0 = full attention
    # Layer groups (kv_cache.LayerGroup): layers of one group share a block table.
    # Gemma 3 has two (global, sliding-window); other models one.  `slots` and
    # `block_tables` above are group 0's; a backend reads a layer's own through
    # slots_for(layer) / tables_for(layer).  Table entries released by a sliding
    # window are 0 and lie outside the window, so attention never reads them.
    layer_group: list = field(default_factory=list)      # per layer: group index
    group_slots: np.ndarray | None = None                # int32 [n_groups, N]
    group_tables: list = field(default_factory=list)     # per group: int32 [S, max_blocks]

    def window(self, layer: int) -> int:
        return self.windows[layer]

    def slots_for(self, layer: int) -> np.ndarray:
        return self.group_slots[self.layer_group[layer]] if self.layer_group else self.slots

    def tables_for(self, layer: int) -> np.ndarray:
        return self.group_tables[self.layer_group[layer]] if self.layer_group else self.block_tables


class Engine:
    def __init__(self, model: str | LoadedModel, *, device: str = "cpu", n_ctx: int = 0,
                 block_size: int = 16, cache_blocks: int = 0, threads: int | None = None,
                 announce=None, cache_type: str = "f16", overflow: str = "stop", gpu_layers: int | None = None,
                 cpu_moe: int | None = 0):
        """cpu_moe: --cpu-moe (-1) / --n-cpu-moe N: the experts of every layer or of the
        first N in system memory, run on the CPU (cuda/auto; backend/cuda_host_moe.py)."""
        self.backend = make_backend(device, threads=threads, announce=announce, gpu_layers=gpu_layers,
                                    cpu_moe=cpu_moe)
        lm = model if isinstance(model, LoadedModel) else load_model(model)
        self.loaded = lm
        self.n_ctx = min(n_ctx or 4096, lm.config.context_length)
        # (LongRoPE picks its short or long factors by the context: keys are rotated once, when cached)
        self.config = cfg = lm.config.for_context(self.n_ctx)
        if cpu_moe and not cfg.n_experts and announce:      # (llama.cpp's flags match no tensor there either)
            announce(f"--cpu-moe / --n-cpu-moe: {lm.path.name} has no experts; the flag has no effect")
        self.tokenizer = lm.tokenizer
        if hasattr(self.backend, "check_fits"):     # GPU: refuse what will not fit, before uploading
            self.backend.check_fits(lm, self.n_ctx, block_size, cache_blocks, cache_type=cache_type)
        # the embedding table is streamed every token only where it doubles as the output layer
        tied = "output.weight" not in lm.tensors
        self.model = model_class(cfg.arch)(cfg, {n: self.backend.upload(t, streamed=tied or n != "token_embd.weight")
                                                 for n, t in lm.tensors.items()})
        self.block_size = block_size
        n_blocks = cache_blocks or 2 * math.ceil(self.n_ctx / block_size)
        self.cache_type = cache_type
        self.overflow = check_policy(overflow)
        self.storage = storage = self.backend.alloc_kv(cfg.n_layers, n_blocks * block_size, cfg.n_kv_heads,
                                                       cfg.head_dim, cache_type=cache_type)
        self.windows = [cfg.sliding_window if cfg.is_local_layer(i) else 0 for i in range(cfg.n_layers)]
        # one block table per distinct window: sliding-window layers release old blocks
        per_layer = storage.bytes_per_token // cfg.n_layers
        groups = []
        for w in sorted(set(self.windows)):
            layers = [i for i in range(cfg.n_layers) if self.windows[i] == w]
            groups.append(LayerGroup("global" if w == 0 else f"window{w}", layers, w, per_layer * len(layers)))
        self.layer_group = [next(gi for gi, g in enumerate(groups) if i in g.layers) for i in range(cfg.n_layers)]
        self.cache = PagedKVCache(n_blocks, block_size, groups=groups, cache_type=cache_type,
                                  copy_block=lambda s, d, gi: storage.copy_block(s, d, block_size, groups[gi].layers))
        self.attn_scale = cfg.attn_scale or 1.0 / math.sqrt(cfg.head_dim)
        self.merge_rows = self._merge_rows(lm)

    def _merge_rows(self, lm) -> int | None:
        """Chunks of at least this many tokens, of different sequences, may share a forward
        with each row's arithmetic unchanged (None: never).  On the CPU with the bfloat16
        prompt kernel every matmul of 32+ rows takes the same kernel, whose rows are
        independent and summed in a fixed order, and attention works a sequence at a time;
        the logits rows (one a sequence) stay within the batch-invariant 16.  Not where a
        weight takes the float sgemm path (its blocking may depend on the row count) or for
        experts (a merged forward changes the rows each expert gets, hence its path)."""
        if getattr(self.backend, "name", "") != "cpu" or self.config.n_experts:
            return None
        from quant.matmul_cpu import LARGE_BATCH_MIN, bf16_path
        for t in lm.tensors.values():
            if len(t.shape) == 2 and not bf16_path(LARGE_BATCH_MIN, t.qtype, t.shape[-1]):
                return None
        return LARGE_BATCH_MIN

    # ---- sequences ---------------------------------------------------------------
    def new_sequence(self) -> Sequence:
        return self.cache.new_sequence()

    @property
    def setup_events(self) -> int:
        """How many steps so far paid a backend's one-time cost (a CPU step plan recorded
        or checked, a CUDA graph captured): timings of those say nothing of later steps."""
        return getattr(self.backend, "setup_events", 0)

    def release(self, seq: Sequence, keep_cached: bool = True) -> None:
        self.cache.release(seq, keep_cached=keep_cached)

    # ---- one forward -------------------------------------------------------------
    def step(self, seqs: list[Sequence], new_tokens: list[list[int]], all_logits: bool = False,
             argmax: bool = False, masks=None) -> np.ndarray:
        """Append new_tokens[i] to seqs[i] and return logits: the last row of each
        sequence, or every new row when all_logits (speculative verification).

        argmax: return instead each of those rows' argmax (int64 [rows], np.argmax's
        tie-break: the first maximum), the greedy next token, for callers that need
        nothing else of the logits.  A backend with `forward_argmax` computes it where
        the logits are (the CUDA backend on the device: no logits cross to the host).
        masks (with argmax): a callable giving each logits row's allowed-token bitmask
        (uint32 [rows, words], constrain.apply_mask's layout); it is called once the
        forward is under way, so masks computed meanwhile on the host cost no step time,
        and each argmax is taken among the allowed tokens."""
        for seq, toks in zip(seqs, new_tokens):
            if len(seq) + len(toks) > self.n_ctx:
                if self.overflow != "shift":
                    raise ContextOverflow(f"context full: {len(seq)} + {len(toks)} tokens exceed the "
                                          f"context length {self.n_ctx}")
                self.shift(seq, shift_amount(len(seq), seq.keep, len(toks), self.n_ctx))
        slots, positions, owner, rows = [], [], [], []
        n = 0
        for i, (seq, toks) in enumerate(zip(seqs, new_tokens)):
            slots.append(self.cache.reserve(seq, len(toks)))
            positions.append(np.arange(len(seq), len(seq) + len(toks), dtype=np.int32))
            owner.append(np.full(len(toks), i, np.int32))
            rows.extend(range(n, n + len(toks)) if all_logits else [n + len(toks) - 1])
            n += len(toks)
        max_blocks = max(len(s.blocks) for s in seqs)
        group_tables = []
        for gi in range(len(self.cache.groups)):
            tables = np.zeros((len(seqs), max_blocks), np.int32)
            for i, s in enumerate(seqs):
                tables[i, :len(s.tables[gi])] = s.tables[gi]
            group_tables.append(np.maximum(tables, 0))    # RELEASED (-1) -> 0, never read
        group_slots = np.concatenate(slots, axis=1)
        ctx = max(len(s) + len(t) for s, t in zip(seqs, new_tokens))
        step = Step(
            tokens=np.concatenate([np.asarray(t, np.int32) for t in new_tokens]),
            positions=np.concatenate(positions), slots=group_slots[0],
            seq_of_token=np.concatenate(owner), block_tables=group_tables[0],
            logit_rows=np.asarray(rows, np.int64), block_size=self.block_size,
            attn_scale=self.attn_scale, attn_splits=self._splits(n, ctx), windows=self.windows,
            layer_group=self.layer_group, group_slots=group_slots, group_tables=group_tables)
        if not argmax:
            out = self.backend.forward(self.model, step)
        elif hasattr(self.backend, "forward_argmax"):
            out = (self.backend.forward_argmax(self.model, step) if masks is None
                   else self.backend.forward_argmax(self.model, step, masks))
        else:
            out = self.backend.forward(self.model, step)
            if masks is not None:
                from .constrain import apply_mask
                apply_mask(out, masks())
            out = np.argmax(out, axis=-1)
        for seq, toks in zip(seqs, new_tokens):
            self.cache.commit(seq, toks)
        return out

    def _splits(self, n_tokens: int, ctx: int) -> int:
        """Context splits for flash-decoding.

        Up to the backend's exact_rows new tokens (decode, speculative verify, batched
        decode) always get the same split count, fixed by the model and thread count: a
        token's attention is then summed in the same order whatever the batch, so verifying
        k+1 tokens in one step gives bit-identical logits to k+1 single steps.
        Larger (prefill) batches have work enough without splitting."""
        threads = getattr(self.backend, "threads", 1)
        if n_tokens <= getattr(self.backend, "exact_rows", 16):
            return max(1, math.ceil(2 * threads / self.config.n_kv_heads))
        return 1

    def prefill(self, seq: Sequence, tokens: list[int], chunk: int = 512) -> np.ndarray:
        """Feed a prompt (reusing cached prefix blocks) and return the last token's logits."""
        if not seq.tokens and tokens:
            self.cache.reuse_prefix(seq, tokens)
        fed = seq.history          # equals seq.tokens unless a context shift dropped some
        if tokens[:len(fed)] != fed:
            raise ValueError("prompt does not continue the sequence's cached tokens")
        if len(fed) == len(tokens):           # all cached: recompute the last token for its logits
            self.cache.truncate(seq, len(seq) - 1)
        todo = tokens[len(seq.history):]
        logits = None
        for i in range(0, len(todo), chunk):
            logits = self.step([seq], [todo[i:i + chunk]])
        return logits[0]

    def shift(self, seq: Sequence, n_discard: int) -> None:
        """Context shift: drop n_discard tokens after seq.keep, re-rotating the rest's keys."""
        ropes = [rope_for_layer(self.config, i) for i in range(self.config.n_layers)]

        def move(gi, src, dst, delta):
            for layer in self.cache.groups[gi].layers:
                inv_freq, neox, pos_scale = ropes[layer]
                self.storage.shift(layer, src, dst, delta, inv_freq, neox, pos_scale)
        self.cache.shift(seq, n_discard, move)

    def stats(self) -> dict:
        """KV-cache accounting: bytes/blocks in use, held for prefix reuse and free,
        tokens per sequence, bytes per token of this model and cache type."""
        return self.cache.stats().as_dict()
