"""Paged KV cache: reference-counted block pools, per-sequence block tables, and
hash-chained full blocks for prefix reuse (after vLLM's design).

This module only does the bookkeeping; the K/V arrays themselves belong to the
Backend (numpy on the CPU, CuPy on the GPU) and are indexed by *slot*:
slot = block_id * block_size + offset.

- Layers are split into *groups* that share a block table: all layers in one
  group for most models; for Gemma 3, the global layers and the sliding-window
  (local) layers.  Each group has its own pool, so a local group can release the
  blocks that fell out of its window while the global group keeps everything.
  A released entry in a block table is -1 (never read: it lies outside the window).
- A block is *in use* while a sequence holds it (ref > 0).
- A full block gets a content hash, chained from its parent block's hash, so
  equal prefixes map to equal hashes.  When its last user lets go, a hashed
  block stays *cached* (ref 0, contents intact) until the pool needs room; then
  the least-recently-used cached block is evicted.  `limit_cached` bounds the
  cached blocks too (a server: the pools are mapped lazily, so the blocks ever
  used are the memory it holds).
- Blocks that hold no reusable content go straight back to the *free* list.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

# KV cache types: (K in q8_0, V in q8_0), f16 where False.  q8_0: int8 values and an f16
# scale per block of 32 (34 bytes for 32 values), f16: 64.  k16v8 keeps K in f16: Qwen2.5's
# K has outlier channels, which cost its q8_0 cache +5.9% perplexity; V quantizes well.
CACHE_KV_QUANT = {"f16": (False, False), "q8_0": (True, True), "k16v8": (False, True)}
CACHE_TYPES = tuple(CACHE_KV_QUANT)
QK8 = 32


def kv_bytes_per_token_layer(n_kv_heads: int, head_dim: int, cache_type: str = "f16") -> int:
    """Bytes one token's K and V take in one layer (every backend stores them so)."""
    if cache_type not in CACHE_KV_QUANT:
        raise ValueError(f"unknown KV cache type '{cache_type}' (choose from {', '.join(CACHE_TYPES)})")
    if any(CACHE_KV_QUANT[cache_type]) and head_dim % QK8:
        raise ValueError(f"{cache_type} KV cache needs head_dim divisible by {QK8} (got {head_dim})")
    return sum(n_kv_heads * (head_dim + 2 * head_dim // QK8) if qz else 2 * n_kv_heads * head_dim
               for qz in CACHE_KV_QUANT[cache_type])

RELEASED = -1     # block-table entry of a block released by a sliding window


class CacheFull(RuntimeError):
    """No free block is left for a sequence that needs one."""


def _block_hash(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


def prefix_hashes(tokens, block_size: int) -> list[bytes]:
    """The hash chain of the full blocks a prompt may reuse (all but its last token, which
    is always computed for its logits)."""
    out, parent = [], b""
    for i in range((len(tokens) - 1) // block_size):
        parent = _block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@dataclass
class LayerGroup:
    """Layers that share one block table (and one window)."""
    name: str
    layers: list[int]
    window: int = 0               # 0: full attention; else keys older than `window` positions are not read
    bytes_per_token: int = 0      # K+V bytes of one token over all layers of the group


@dataclass
class Sequence:
    """One stream of tokens whose K/V live in the cache."""
    seq_id: int
    tokens: list[int] = field(default_factory=list)    # ids whose K/V are in the cache, in position order
    tables: list[list[int]] = field(default_factory=list)   # one block table per layer group
    hashes: list[bytes] = field(default_factory=list)  # hash of each full, committed block
    reused_tokens: int = 0                             # leading tokens taken from the prefix cache
    keep: int = 0          # leading tokens a context shift never drops (system prompt, BOS)
    shifted: int = 0       # tokens dropped by context shifts so far
    history: list[int] = field(default_factory=list)   # every id fed, dropped ones included
    hash_limit: int | None = None   # blocks from this index on hold shifted K/V: never hashed
    released: list[int] = field(default_factory=list)  # per group: leading blocks released by the window

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def blocks(self) -> list[int]:
        """Block table of the first (global) layer group."""
        return self.tables[0]


class BlockPool:
    """One group's blocks: ref counts, free list, LRU of cached (hashed, unused) blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, np.int32)
        # a stack: a freed block is handed out again first, so blocks never used (whose pages
        # the lazily mapped pools have not touched yet) are taken only when no used one is free
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() gives 0, 1, ...
        self.cached: OrderedDict[int, None] = OrderedDict()           # ref 0, hashed, LRU first
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.max_cached: int | None = None      # at most this many cached blocks (None: the whole pool)
        # blocks ever handed out: the stack gives never-used blocks in order, so these are blocks
        # 0..touched-1, the part of a lazily mapped pool that holds memory
        self.touched = 0

    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def allocate(self) -> int:
        if self.free:
            b = self.free.pop()
        elif self.cached:
            b, _ = self.cached.popitem(last=False)      # evict the least recently used
            self.by_hash.pop(self.hash_of.pop(b), None)
        else:
            raise CacheFull("KV cache full")
        self.ref[b] = 1
        self.touched = max(self.touched, b + 1)
        return b

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.cached.pop(b, None)
        self.ref[b] += 1

    def decref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.cached[b] = None          # most recently used end
                self.trim()
            else:
                self.free.append(b)

    def trim(self) -> None:
        """Evict the least recently used cached blocks beyond max_cached onto the free stack."""
        if self.max_cached is None:
            return
        while len(self.cached) > self.max_cached:
            b, _ = self.cached.popitem(last=False)
            self.by_hash.pop(self.hash_of.pop(b), None)
            self.free.append(b)

    def register(self, b: int, h: bytes) -> None:
        if h not in self.by_hash and b not in self.hash_of:
            self.by_hash[h] = b
            self.hash_of[b] = h

    def forget(self, b: int) -> None:
        """The block's contents are about to change: its hash no longer describes it."""
        h = self.hash_of.pop(b, None)
        if h is not None and self.by_hash.get(h) == b:
            del self.by_hash[h]


@dataclass
class CacheStats:
    block_size: int
    bytes_per_block: int
    bytes_per_token: int
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    tokens_per_sequence: dict
    bytes_total: int = 0
    bytes_used: int = 0
    bytes_cached: int = 0
    bytes_free: int = 0
    cache_type: str = "f16"
    groups: list = field(default_factory=list)
    reserved_unused_slots: dict = field(default_factory=dict)   # per sequence, per group

    def as_dict(self) -> dict:
        return {
            "cache_type": self.cache_type, "block_size": self.block_size,
            "bytes_per_token": self.bytes_per_token,
            "blocks_total": self.blocks_total, "blocks_used": self.blocks_used,
            "blocks_cached": self.blocks_cached, "blocks_free": self.blocks_free,
            "bytes_total": self.bytes_total, "bytes_used": self.bytes_used,
            "bytes_cached": self.bytes_cached, "bytes_free": self.bytes_free,
            "tokens_per_sequence": dict(self.tokens_per_sequence),
            "reserved_unused_slots": dict(self.reserved_unused_slots),
            "groups": list(self.groups),
        }


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, bytes_per_token: int = 0, copy_block=None,
                 groups: list[LayerGroup] | None = None, cache_type: str = "f16", window_slack: int = 0):
        """copy_block(src, dst, group) copies one block's K/V in the group's layers
        (copy-on-write of shared blocks).  window_slack: extra tokens a windowed group
        keeps behind its window so that a short rollback (speculative decoding) stays possible."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.groups = groups or [LayerGroup("all", [], 0, bytes_per_token)]
        self.bytes_per_token = sum(g.bytes_per_token for g in self.groups)
        self.cache_type = cache_type
        self.window_slack = window_slack or block_size
        self.pools = [BlockPool(num_blocks) for _ in self.groups]
        self._copy_block = copy_block
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0

    @property
    def ref(self) -> np.ndarray:
        return self.pools[0].ref

    def limit_cached(self, max_blocks: int | None) -> None:
        """Keep at most max_blocks unused blocks cached for prefix reuse (None: as many as the
        pool holds, evicted only when it runs dry).  The pools are mapped lazily, so a block
        costs memory from its first use: without a limit a server's memory grows with every
        distinct prompt until the whole pool has been used; with one, the blocks ever used
        stay within the most in use at once plus max_blocks."""
        for pool in self.pools:
            pool.max_cached = None if max_blocks is None else max(0, int(max_blocks))
            pool.trim()

    # ---- sequences -------------------------------------------------------------
    def new_sequence(self) -> Sequence:
        seq = Sequence(self._next_id, tables=[[] for _ in self.groups], released=[0] * len(self.groups))
        self._next_id += 1
        self._seqs[seq.seq_id] = seq
        return seq

    def release(self, seq: Sequence, keep_cached: bool = True) -> None:
        """Let go of all of a sequence's blocks (hashed ones stay cached for reuse,
        unless keep_cached is False and no other sequence shares them)."""
        for pool, table in zip(self.pools, seq.tables):
            for b in reversed(table):
                if b != RELEASED:
                    if not keep_cached and pool.ref[b] == 1:
                        pool.forget(b)
                    pool.decref(b)
            table.clear()
        seq.hashes.clear(); seq.tokens.clear(); seq.history.clear()
        seq.released = [0] * len(self.groups)
        seq.shifted, seq.hash_limit = 0, None
        self._seqs.pop(seq.seq_id, None)

    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _first_needed(self, group: LayerGroup, n_tokens: int) -> int:
        """Lowest position a windowed group must still hold for a sequence of n_tokens."""
        if not group.window:
            return 0
        return max(0, n_tokens - group.window + 1 - self.window_slack)

    # ---- prefix reuse ----------------------------------------------------------
    def reuse_prefix(self, seq: Sequence, tokens: list[int]) -> int:
        """Attach cached blocks matching the start of `tokens` to an empty sequence.

        At most len(tokens)-1 tokens are reused, so the last prompt token is always
        computed and yields logits.  A windowed group only needs the blocks inside
        its window.  Returns the number of tokens reused.
        """
        assert not seq.tokens, "prefix reuse starts from an empty sequence"
        bs = self.block_size
        hashes = prefix_hashes(tokens, bs)
        n = len(hashes)
        for gi, (g, pool) in enumerate(zip(self.groups, self.pools)):
            if not g.window:
                n = next((i for i, h in enumerate(hashes[:n]) if h not in pool.by_hash), n)
        while n > 0:       # the windowed groups must hold every block inside the window at n
            if all(all(hashes[i] in pool.by_hash for i in range(self._first_needed(g, n * bs) // bs, n))
                   for g, pool in zip(self.groups, self.pools) if g.window):
                break
            n -= 1
        for g, pool, table in zip(self.groups, self.pools, seq.tables):
            lo = self._first_needed(g, n * bs) // bs
            for i in range(n):
                if i < lo:
                    table.append(RELEASED)
                else:
                    b = pool.by_hash[hashes[i]]
                    pool.incref(b)
                    table.append(b)
        seq.released = [self._first_needed(g, n * bs) // bs for g in self.groups]
        seq.hashes = hashes[:n]
        seq.tokens = list(tokens[:n * bs])
        seq.history = list(seq.tokens)
        seq.reused_tokens = len(seq.tokens)
        return seq.reused_tokens

    # ---- growth, commit and rollback ------------------------------------------
    def reserve(self, seq: Sequence, n_new: int) -> np.ndarray:
        """Make room for n_new tokens after the sequence's current ones; return their
        slots, one row per layer group ([n_groups, n_new])."""
        bs = self.block_size
        start = len(seq.tokens)
        n_blocks = (start + n_new + bs - 1) // bs
        for pool, table in zip(self.pools, seq.tables):
            need = n_blocks - len(table)
            if need > pool.available():
                raise CacheFull(f"KV cache full: {n_new} more tokens need {need} blocks, "
                                f"{pool.available()} free of {pool.num_blocks}")
        out = np.empty((len(self.groups), n_new), np.int32)
        pos = np.arange(start, start + n_new)
        for gi, (pool, table) in enumerate(zip(self.pools, seq.tables)):
            if start % bs and table and table[-1] != RELEASED and pool.ref[table[-1]] > 1:
                self._copy_on_write(gi, table, len(table) - 1)
            while len(table) < n_blocks:
                table.append(pool.allocate())
            blocks = np.asarray(table, np.int64)
            out[gi] = blocks[pos // bs] * bs + pos % bs
        return out

    def commit(self, seq: Sequence, token_ids) -> None:
        """Record that K/V for token_ids were written at the reserved slots; hash full
        blocks; let windowed groups release blocks that fell out of their window."""
        ids = [int(t) for t in token_ids]
        seq.tokens.extend(ids)
        seq.history.extend(ids)
        bs = self.block_size
        limit = len(seq.tokens) // bs if seq.hash_limit is None else min(seq.hash_limit, len(seq.tokens) // bs)
        while len(seq.hashes) < limit:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else b""
            h = _block_hash(parent, seq.tokens[i * bs:(i + 1) * bs])
            seq.hashes.append(h)
            for pool, table in zip(self.pools, seq.tables):
                if table[i] != RELEASED:
                    pool.register(table[i], h)
        for gi, (g, pool, table) in enumerate(zip(self.groups, self.pools, seq.tables)):
            if g.window:
                upto = self._first_needed(g, len(seq.tokens)) // bs
                for i in range(seq.released[gi], upto):
                    if table[i] != RELEASED:
                        pool.decref(table[i])
                        table[i] = RELEASED
                seq.released[gi] = max(seq.released[gi], upto)

    def truncate(self, seq: Sequence, n_tokens: int) -> None:
        """Roll the sequence back to its first n_tokens (speculative rejection, edits)."""
        bs = self.block_size
        n_tokens = min(n_tokens, len(seq.tokens))
        for g, table in zip(self.groups, seq.tables):
            lo = max(0, (n_tokens - g.window + 1) // bs) if g.window else 0
            if any(b == RELEASED for b in table[lo:(n_tokens + bs - 1) // bs]):
                raise RuntimeError(f"cannot roll back to {n_tokens} tokens: layer group '{g.name}' "
                                   f"already released those blocks (sliding window)")
        if seq.shifted and n_tokens < seq.keep:
            raise RuntimeError("cannot roll back into the kept prefix of a shifted sequence")
        del seq.history[n_tokens + seq.shifted:]
        del seq.tokens[n_tokens:]
        del seq.hashes[n_tokens // bs:]
        keep = (n_tokens + bs - 1) // bs
        for gi, (g, pool, table) in enumerate(zip(self.groups, self.pools, seq.tables)):
            while len(table) > keep:
                b = table.pop()
                if b != RELEASED:
                    pool.decref(b)
            seq.released[gi] = min(seq.released[gi], len(table))
            if n_tokens % bs and table and table[-1] != RELEASED:
                b = table[-1]
                if pool.ref[b] > 1:
                    self._copy_on_write(gi, table, len(table) - 1)
                else:   # sole owner of a once-full block: its hash no longer holds
                    pool.forget(b)
        seq.reused_tokens = min(seq.reused_tokens, len(seq.tokens))

    # ---- context shift -----------------------------------------------------------
    def shift(self, seq: Sequence, n_discard: int, move) -> None:
        """Drop n_discard tokens after the sequence's first `keep` and close the gap.

        move(group_index, src_slots, dst_slots, delta) must copy K/V from src to dst
        slots in that group's layers (reading all sources before writing) and
        re-rotate the keys by delta positions.  Blocks that change are made private
        first (copy-on-write) and lose their prefix hashes: shifted K/V differ from
        what a fresh prefill of the same ids would give, so they are never reused.
        """
        bs = self.block_size
        n, keep = len(seq.tokens), seq.keep
        if n_discard <= 0 or keep + n_discard > n:
            raise ValueError(f"cannot shift {n_discard} tokens out of {n} keeping {keep}")
        n2 = n - n_discard
        first_changed = keep // bs
        n_blocks = (n2 + bs - 1) // bs
        for gi, (g, pool) in enumerate(zip(self.groups, self.pools)):
            old = list(seq.tables[gi])
            for b in old:                         # hold every old block until the move is done
                if b != RELEASED:
                    pool.incref(b)
            lo = self._first_needed(g, n2)
            j0 = max(keep, lo)
            new = old[:n_blocks]
            for i in range(first_changed, n_blocks):
                if (i + 1) * bs <= lo:           # entirely outside the window after the shift
                    if new[i] != RELEASED:
                        pool.decref(new[i])
                    new[i] = RELEASED
                    continue
                b = new[i]
                if b != RELEASED and pool.ref[b] == 2:      # ours alone (plus the hold)
                    pool.forget(b)
                    continue
                fresh = pool.allocate()
                if b != RELEASED:
                    if i * bs < keep:            # kept tokens share this block: copy them along
                        self._copy_block(b, fresh, gi)
                    pool.decref(b)
                new[i] = fresh
            for b in old[n_blocks:]:
                if b != RELEASED:
                    pool.decref(b)
            for i in range(min(first_changed, n_blocks)):
                if (i + 1) * bs <= lo and new[i] != RELEASED:
                    pool.decref(new[i])
                    new[i] = RELEASED
            if j0 < n2:
                pos = np.arange(j0, n2)
                src = np.asarray(old, np.int64)[(pos + n_discard) // bs] * bs + (pos + n_discard) % bs
                dst = np.asarray(new, np.int64)[pos // bs] * bs + pos % bs
                move(gi, src.astype(np.int32), dst.astype(np.int32), -n_discard)
            for b in old:
                if b != RELEASED:
                    pool.decref(b)
            seq.tables[gi] = new
            seq.released[gi] = lo // bs if g.window else 0
        seq.tokens = seq.tokens[:keep] + seq.tokens[keep + n_discard:]
        seq.shifted += n_discard
        seq.hash_limit = first_changed
        del seq.hashes[first_changed:]
        seq.reused_tokens = min(seq.reused_tokens, keep)

    # ---- accounting ------------------------------------------------------------
    def free_blocks(self) -> int:
        return min(p.available() for p in self.pools)

    def stats(self) -> CacheStats:
        bs = self.block_size
        groups = []
        for g, p in zip(self.groups, self.pools):
            bpb = g.bytes_per_token * bs
            used = int(np.count_nonzero(p.ref))
            groups.append({"name": g.name, "layers": len(g.layers) or None, "window": g.window,
                           "bytes_per_block": bpb, "blocks_total": p.num_blocks, "blocks_used": used,
                           "blocks_cached": len(p.cached), "blocks_free": len(p.free),
                           "bytes_used": used * bpb, "bytes_cached": len(p.cached) * bpb,
                           "bytes_free": len(p.free) * bpb, "bytes_total": p.num_blocks * bpb})
        waste = {}
        for s in self._seqs.values():
            waste[s.seq_id] = [sum(1 for b in t if b != RELEASED) * bs
                               - (len(s.tokens) - min(r * bs, len(s.tokens)))
                               for t, r in zip(s.tables, s.released)]
        tot = lambda k: sum(x[k] for x in groups)
        return CacheStats(
            block_size=bs, bytes_per_block=self.bytes_per_token * bs, bytes_per_token=self.bytes_per_token,
            blocks_total=tot("blocks_total"), blocks_used=tot("blocks_used"),
            blocks_cached=tot("blocks_cached"), blocks_free=tot("blocks_free"),
            tokens_per_sequence={s.seq_id: len(s.tokens) for s in self._seqs.values()},
            bytes_total=tot("bytes_total"), bytes_used=tot("bytes_used"), bytes_cached=tot("bytes_cached"),
            bytes_free=tot("bytes_free"), cache_type=self.cache_type,
            groups=groups if len(groups) > 1 else [], reserved_unused_slots=waste)

    # ---- block pool ------------------------------------------------------------
    def _copy_on_write(self, gi: int, table: list[int], i: int) -> None:
        if self._copy_block is None:
            raise RuntimeError("shared KV block needs copy-on-write but the backend gave no copier")
        pool = self.pools[gi]
        src = table[i]
        dst = pool.allocate()
        self._copy_block(src, dst, gi)
        pool.decref(src)
        table[i] = dst
