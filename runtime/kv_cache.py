"""Paged KV cache: a reference-counted block pool, per-sequence block tables,
and hash-chained full blocks for prefix reuse (after vLLM's design).

This module only does the bookkeeping; the K/V arrays themselves belong to the
Backend (numpy on the CPU, CuPy on the GPU) and are indexed by *slot*:
slot = block_id * block_size + offset.

- A block is *in use* while a sequence holds it (ref > 0).
- A full block gets a content hash, chained from its parent block's hash, so
  equal prefixes map to equal hashes.  When its last user lets go, a hashed
  block stays *cached* (ref 0, contents intact) until the pool needs room; then
  the least-recently-used cached block is evicted.
- Blocks that hold no reusable content go straight back to the *free* list.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


class CacheFull(RuntimeError):
    """No free block is left for a sequence that needs one."""


def _block_hash(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, np.int32).tobytes(), digest_size=16).digest()


@dataclass
class Sequence:
    """One stream of tokens whose K/V live in the cache."""
    seq_id: int
    tokens: list[int] = field(default_factory=list)    # ids whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # hash of each full, committed block
    reused_tokens: int = 0                             # leading tokens taken from the prefix cache

    def __len__(self) -> int:
        return len(self.tokens)


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

    @property
    def bytes_used(self): return self.blocks_used * self.bytes_per_block
    @property
    def bytes_cached(self): return self.blocks_cached * self.bytes_per_block
    @property
    def bytes_free(self): return self.blocks_free * self.bytes_per_block
    @property
    def bytes_total(self): return self.blocks_total * self.bytes_per_block

    def as_dict(self) -> dict:
        return {
            "block_size": self.block_size, "bytes_per_token": self.bytes_per_token,
            "blocks_total": self.blocks_total, "blocks_used": self.blocks_used,
            "blocks_cached": self.blocks_cached, "blocks_free": self.blocks_free,
            "bytes_total": self.bytes_total, "bytes_used": self.bytes_used,
            "bytes_cached": self.bytes_cached, "bytes_free": self.bytes_free,
            "tokens_per_sequence": dict(self.tokens_per_sequence),
        }


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, bytes_per_token: int, copy_block=None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.bytes_per_token = bytes_per_token
        self.ref = np.zeros(num_blocks, np.int32)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() gives 0, 1, ...
        self._cached: OrderedDict[int, None] = OrderedDict()           # ref 0, hashed, LRU first
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._copy_block = copy_block     # backend hook for copy-on-write of shared blocks
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0

    # ---- sequences -------------------------------------------------------------
    def new_sequence(self) -> Sequence:
        seq = Sequence(self._next_id)
        self._next_id += 1
        self._seqs[seq.seq_id] = seq
        return seq

    def release(self, seq: Sequence) -> None:
        """Let go of all of a sequence's blocks (hashed ones stay cached for reuse)."""
        for b in reversed(seq.blocks):
            self._unref(b)
        seq.blocks.clear(); seq.hashes.clear(); seq.tokens.clear()
        self._seqs.pop(seq.seq_id, None)

    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    # ---- prefix reuse ----------------------------------------------------------
    def reuse_prefix(self, seq: Sequence, tokens: list[int]) -> int:
        """Attach cached blocks matching the start of `tokens` to an empty sequence.

        At most len(tokens)-1 tokens are reused, so the last prompt token is always
        computed and yields logits.  Returns the number of tokens reused.
        """
        assert not seq.tokens, "prefix reuse starts from an empty sequence"
        bs = self.block_size
        parent = b""
        n_full = (len(tokens) - 1) // bs
        for i in range(n_full):
            chunk = tokens[i * bs:(i + 1) * bs]
            h = _block_hash(parent, chunk)
            b = self._by_hash.get(h)
            if b is None:
                break
            self._ref(b)
            seq.blocks.append(b); seq.hashes.append(h); seq.tokens.extend(chunk)
            parent = h
        seq.reused_tokens = len(seq.tokens)
        return seq.reused_tokens

    # ---- growth, commit and rollback ------------------------------------------
    def reserve(self, seq: Sequence, n_new: int) -> np.ndarray:
        """Make room for n_new tokens after the sequence's current ones; return their slots."""
        bs = self.block_size
        start = len(seq.tokens)
        need = (start + n_new + bs - 1) // bs - len(seq.blocks)
        if need > self.free_blocks():
            raise CacheFull(f"KV cache full: {n_new} more tokens need {need} blocks, "
                            f"{self.free_blocks()} free of {self.num_blocks}")
        if start % bs and seq.blocks and self.ref[seq.blocks[-1]] > 1:
            self._copy_on_write(seq, len(seq.blocks) - 1)
        for _ in range(need):
            seq.blocks.append(self._allocate())
        pos = np.arange(start, start + n_new)
        blocks = np.asarray(seq.blocks, np.int64)
        return (blocks[pos // bs] * bs + pos % bs).astype(np.int32)

    def commit(self, seq: Sequence, token_ids) -> None:
        """Record that K/V for token_ids were written at the reserved slots; hash full blocks."""
        seq.tokens.extend(int(t) for t in token_ids)
        bs = self.block_size
        while len(seq.hashes) < len(seq.tokens) // bs:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else b""
            h = _block_hash(parent, seq.tokens[i * bs:(i + 1) * bs])
            seq.hashes.append(h)
            b = seq.blocks[i]
            if h not in self._by_hash:
                self._by_hash[h] = b
                self._hash_of[b] = h

    def truncate(self, seq: Sequence, n_tokens: int) -> None:
        """Roll the sequence back to its first n_tokens (speculative rejection, edits)."""
        if n_tokens >= len(seq.tokens):
            # drop blocks reserved beyond the committed tokens
            keep = (len(seq.tokens) + self.block_size - 1) // self.block_size
        else:
            keep = (n_tokens + self.block_size - 1) // self.block_size
            del seq.tokens[n_tokens:]
            del seq.hashes[n_tokens // self.block_size:]
        while len(seq.blocks) > keep:
            self._unref(seq.blocks.pop())
        if seq.tokens and len(seq.tokens) % self.block_size:
            last = len(seq.blocks) - 1
            b = seq.blocks[last]
            if self.ref[b] > 1:
                self._copy_on_write(seq, last)
            elif b in self._hash_of:   # sole owner of a once-full block: its hash no longer holds
                self._by_hash.pop(self._hash_of.pop(b), None)
        seq.reused_tokens = min(seq.reused_tokens, len(seq.tokens))

    # ---- accounting ------------------------------------------------------------
    def free_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    def stats(self) -> CacheStats:
        used = int(np.count_nonzero(self.ref))
        return CacheStats(
            block_size=self.block_size, bytes_per_block=self.bytes_per_token * self.block_size,
            bytes_per_token=self.bytes_per_token, blocks_total=self.num_blocks,
            blocks_used=used, blocks_cached=len(self._cached), blocks_free=len(self._free),
            tokens_per_sequence={s.seq_id: len(s.tokens) for s in self._seqs.values()})

    # ---- block pool ------------------------------------------------------------
    def _allocate(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._cached:
            b, _ = self._cached.popitem(last=False)      # evict the least recently used
            self._by_hash.pop(self._hash_of.pop(b), None)
        else:
            raise CacheFull("KV cache full")
        self.ref[b] = 1
        return b

    def _ref(self, b: int) -> None:
        if self.ref[b] == 0:
            self._cached.pop(b, None)
        self.ref[b] += 1

    def _unref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self._hash_of:
                self._cached[b] = None          # most recently used end
            else:
                self._free.append(b)

    def _copy_on_write(self, seq: Sequence, i: int) -> None:
        if self._copy_block is None:
            raise RuntimeError("shared KV block needs copy-on-write but the backend gave no copier")
        src = seq.blocks[i]
        dst = self._allocate()
        self._copy_block(src, dst)
        self._unref(src)
        seq.blocks[i] = dst
