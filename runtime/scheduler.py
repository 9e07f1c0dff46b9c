"""The scheduler: one loop that every request shares (after vLLM v1's scheduler).

Each request has *known* tokens (its prompt, then every token it generated) and a sequence
in the paged KV cache that holds the first `len(seq)` of them.  There are no prefill and
decode phases: each iteration the computed tokens catch up with the known ones.

- Requests that lack only their last token (decoding) advance one token each, all in one
  forward, in groups of at most the backend's `exact_rows`, where a row's result does not
  depend on the batch (so greedy output alone and beside others is the same).
- Requests still catching up (a prompt, or a recompute after preemption) advance by chunks
  cut at the same boundaries as they would be alone (`chunk` tokens from where the prefix
  cache left off), as many as fit in the iteration's `prompt_budget`, in one more forward.
  A long prompt therefore delays the others' next token by one chunk at most.
- Admission is FIFO and by free KV blocks; a waiting request whose prompt shares full
  blocks with a prompt still being computed waits for those blocks to be cached instead of
  computing them again (prefix-aware ordering).
- When decoding needs blocks that are not there, the most recently admitted request is
  preempted: its blocks go back (cached, so a recompute mostly reuses them) and it waits
  at the head of the queue to catch up again.  Nothing is refused for want of memory.
- A cancelled request (a client that went away) is dropped at the next iteration and its
  blocks return to the pool.

The engine is used from one thread only: the scheduler's (`start`), or the caller's
(`run_until_idle`).  `submit` and `Request.cancel` may be called from any thread.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .kv_cache import prefix_hashes
from .sampling import Sampler, SamplingParams
from .text_stream import TextStream

log = logging.getLogger("llamba.scheduler")
_ids = itertools.count(1)


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: try again later."""


@dataclass
class Event:
    """What a request's consumer receives: text as it is decoded, then one last event with
    `finish` set ("stop", "length", "cancelled" or "error")."""
    text: str = ""
    token: int | None = None
    logprob: dict | None = None       # {"token", "logprob", "top": [(token, logprob), ...]}
    finish: str | None = None
    error: str | None = None
    stop_reason: str | None = None    # why a "stop" came early (a constraint that allows nothing more)


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens taken from the prefix cache
    completion_tokens: int = 0
    arrival: float = 0.0
    first_token: float | None = None  # time of the first generated token
    finished: float | None = None
    preemptions: int = 0


class Request:
    """One generation: prompt ids in, Events out through `on_event` (called from the
    scheduler's thread; it must not block)."""

    def __init__(self, prompt_ids, params: SamplingParams | None = None, max_tokens: int = 128,
                 stop=(), logprobs: int | None = None, matcher=None, on_event=None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0):
        if not prompt_ids:
            raise ValueError("empty prompt")
        self.id = next(_ids)
        self.prompt = list(prompt_ids)
        self.known = list(prompt_ids)
        self.output: list[int] = []
        self.params = params or SamplingParams()
        self.sampler = Sampler(self.params)
        self.max_tokens = max_tokens
        self.stop = tuple(stop)
        self.logprobs = logprobs          # None: none; k >= 0: the chosen token's and k alternatives
        self.matcher = matcher            # a constraint's per-sequence matcher (runtime/constrain.py)
        self.presence_penalty, self.frequency_penalty = presence_penalty, frequency_penalty
        self.on_event = on_event or (lambda ev: None)
        self.seq = None
        self.base = 0                     # len(seq) at its first admission (after prefix reuse)
        self.text: TextStream | None = None
        self.finish_reason: str | None = None
        self.cancelled = False
        self.stop_reason: str | None = None
        self._mask: np.ndarray | None = None
        self.last_logprob: dict | None = None
        self.hashes: list[bytes] = []     # hash chain of the prompt's full blocks
        self.stats = RequestStats(prompt_tokens=len(self.prompt), arrival=time.monotonic())
        self.done = threading.Event()

    def mask_row(self) -> np.ndarray:
        """This request's allowed-token bitmask (uint32 words), reused every step."""
        if self._mask is None:
            self._mask = np.zeros(self.matcher.n_words, np.uint32)
        return self._mask

    def cancel(self) -> None:
        """Stop this request; safe from any thread (the scheduler drops it at its next iteration)."""
        self.cancelled = True

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing but the argmax needed (a constraint's mask goes with the step)."""
        return (self.params.argmax_only and self.logprobs is None
                and not self.presence_penalty and not self.frequency_penalty)


@dataclass
class SchedulerStats:
    running: int = 0
    waiting: int = 0
    steps: int = 0
    forwards: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0            # prompt tokens computed (cached ones not counted)
    generated_tokens: int = 0
    kv: dict = field(default_factory=dict)


class Scheduler:
    def __init__(self, engine, max_running: int = 8, max_waiting: int = 64, chunk: int = 512,
                 prompt_budget: int | None = None, prefix_cache: bool = True, on_step=None, drafter=None):
        self.engine = engine
        self.drafter = drafter            # speculative.Drafter: rounds for a request decoding alone
        self.cache = engine.cache
        self.tok = engine.tokenizer
        # (a weights-only model, as the GPU tests load, has no tokenizer: ids, no text, no stop ids)
        self.stop_ids = self.tok.stop_ids if self.tok is not None else frozenset()
        self.max_running, self.max_waiting = max_running, max_waiting
        self.chunk = chunk
        self.prompt_budget = prompt_budget or chunk
        self.prefix_cache = prefix_cache
        self.exact_rows = getattr(engine.backend, "exact_rows", 1)
        self.on_step = on_step            # called (in the engine thread) after each iteration
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._inbox: deque[Request] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._masks = None                # a thread pool for constraint masks, made on first use
        self._stop = False
        self.stats = SchedulerStats()
        self._snapshot()

    # ---- from any thread ---------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        with self._cond:
            # (requests not yet admitted, less the running slots still free, are the ones that wait)
            if len(self._inbox) + len(self.waiting) >= self.max_waiting + max(0, self.max_running - len(self.running)):
                raise QueueFull(f"{self.max_waiting} requests are already waiting")
            self._inbox.append(req)
            self._cond.notify()
        return req

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="llamba-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._inbox and not self.waiting and not self.running:
                    self._cond.wait()
                if self._stop:
                    break
            try:
                self.step()
            except Exception as e:    # never let the engine thread die: fail what was in flight
                log.exception("engine step failed")
                for r in list(self.running) + list(self.waiting):
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                self.waiting.clear()
        for r in list(self.running) + list(self.waiting) + list(self._inbox):
            self._finish(r, "cancelled")

    def run_until_idle(self) -> None:
        """Run iterations in this thread until every submitted request has finished."""
        while self._inbox or self.waiting or self.running:
            self.step()

    def step(self) -> None:
        """One iteration: take new requests, drop cancelled ones, advance decoding requests
        by a token and catching-up requests by a chunk."""
        with self._cond:
            while self._inbox:
                r = self._inbox.popleft()
                r.hashes = self._prompt_hashes(r.prompt)
                self.waiting.append(r)
        for r in [r for r in list(self.waiting) + self.running if r.cancelled]:
            self._finish(r, "cancelled")
        decoding, planned = self._room_for_decoding([r for r in self.running if len(r.seq) == len(r.known) - 1])
        if self._speculate(decoding):
            self._end_step()
            return
        chunks = self._chunks(planned)
        self.stats.prompt_tokens += sum(n for _, n in chunks)
        solo = self.drafter is not None and len(decoding) == 1 and not chunks
        t0 = time.perf_counter()
        for group in self._forwards([(r, 1) for r in decoding] + chunks):
            self._forward([r for r, _ in group], [r.known[len(r.seq):len(r.seq) + n] for r, n in group])
        if solo:
            self.drafter.observe_plain(time.perf_counter() - t0)
        self._end_step()

    def _end_step(self) -> None:
        self.stats.steps += 1
        self._snapshot()
        if self.on_step:
            self.on_step(self)

    def _speculate(self, decoding: list[Request]) -> bool:
        """Speculative decoding is a way a request advances: when one request decodes and
        nothing else is running or waiting, the draft proposes tokens and the target checks
        them in one forward of k + 1 rows (within exact_rows, so greedy output stays the
        target's own).  Returns whether a round ran."""
        if (self.drafter is None or len(decoding) != 1 or len(self.running) != 1 or self.waiting or self._inbox):
            return False
        r = decoding[0]
        if r.matcher is not None or r.logprobs is not None or r.presence_penalty or r.frequency_penalty:
            return False
        need = self._blocks_needed(r, self.drafter.k + 1)
        if need > self.cache.free_blocks():
            return False
        out = self.drafter.round(r.seq, r.known, r.sampler)
        if out is None:
            return False
        self.stats.forwards += 1
        for t in out:
            self._accept(r, t)
            if r.finish_reason is not None:
                break
        return True

    # ---- planning ----------------------------------------------------------------------
    def _forwards(self, work: list[tuple[Request, int]]) -> list[list[tuple[Request, int]]]:
        """Split an iteration's work into forwards that give every row the arithmetic it gets
        alone.  A backend's matmul and attention paths depend on a forward's row count; up to
        `exact_rows` rows a row's result does not depend on the others (speculative verify
        relies on it too), so decode tokens and short chunks share forwards of at most that
        many rows.  A longer chunk runs in a forward of its own, as it would alone, unless the
        engine computes chunks of its length alike alone and together (`Engine.merge_rows`:
        the CPU's bfloat16 prompt kernel from 32 rows): those of an iteration share one
        forward, which reads the weights once for all of them (2 cores, Qwen2.5-0.5B: a
        35-token prompt alone runs at about a third of a 512-token chunk's tokens/s)."""
        cap = max(1, self.exact_rows)
        merge = getattr(self.engine, "merge_rows", None)
        groups, cur, rows, big = [], [], 0, []
        for r, n in work:
            if n > cap:
                if merge is not None and n >= merge:
                    # chunks the engine computes alike alone and together share one forward
                    # (one pass over the weights), as many as keep the logits rows exact
                    if len(big) == cap:
                        groups.append(big)
                        big = []
                    big.append((r, n))
                else:
                    groups.append([(r, n)])
                continue
            if rows + n > cap:
                groups.append(cur)
                cur, rows = [], 0
            cur.append((r, n))
            rows += n
        if cur:
            groups.append(cur)
        if big:
            groups.append(big)
        return groups

    def _blocks_needed(self, r: Request, n: int) -> int:
        bs = self.cache.block_size
        return max(0, math.ceil((len(r.seq) + n) / bs) - len(r.seq.tables[0]))

    def _room_for_decoding(self, decoding: list[Request]) -> tuple[list[Request], int]:
        """Decoding requests that get their next token this iteration, and the blocks they
        take: preempt the most recently admitted requests while the pool lacks them."""
        while decoding:
            need = sum(self._blocks_needed(r, 1) for r in decoding)
            if need <= self.cache.free_blocks():
                return decoding, need
            victim = self.running[-1]
            if len(self.running) == 1:
                self._finish(victim, "length")      # the pool cannot hold even this one sequence
                return [], 0
            self._preempt(victim)
            if victim in decoding:
                decoding.remove(victim)
        return decoding, 0

    def _chunk_len(self, r: Request) -> int:
        """Tokens of r's next chunk, cut where they were cut when it ran: a prompt in chunks of
        `chunk` tokens from where the prefix cache left off at its first admission, and, when
        a preempted request recomputes, its generated tokens in exact groups as they were
        decoded (so the recomputed K/V are the ones it had)."""
        pos = len(r.seq)
        if pos >= len(r.prompt):
            return min(max(1, self.exact_rows), len(r.known) - pos)
        end = r.base if pos < r.base else r.base + ((pos - r.base) // self.chunk + 1) * self.chunk
        return min(end, len(r.prompt)) - pos

    def _chunks(self, planned: int) -> list[tuple[Request, int]]:
        """Chunks of catching-up requests, then of newly admitted ones, within the prompt
        budget and the free blocks (less `planned`, those this iteration already takes)."""
        budget = self.prompt_budget
        out = []
        for r in self.running:
            if len(r.seq) < len(r.known) - 1:
                n = self._chunk_len(r)
                need = self._blocks_needed(r, n)
                if n <= budget and planned + need <= self.cache.free_blocks():
                    out.append((r, n))
                    budget -= n
                    planned += need
        for r in list(self.waiting):
            if len(self.running) >= self.max_running or budget <= 0:
                break
            if self._shares_prefix_in_flight(r):
                continue            # its shared blocks are being computed: reuse them once cached
            r.seq = self.engine.new_sequence()
            if self.prefix_cache:
                self.cache.reuse_prefix(r.seq, r.known)
            if not r.stats.preemptions:
                r.base = len(r.seq)
            n = self._chunk_len(r)
            need = self._blocks_needed(r, n)
            # keep a block a running request in hand, so that admitting does not force a preemption
            if n > budget or planned + need + len(self.running) > self.cache.free_blocks():
                self.engine.release(r.seq)
                r.seq = None
                break               # FIFO: nothing behind it jumps the queue for memory
            if not r.stats.preemptions:
                r.stats.cached_tokens = r.base
            self.waiting.remove(r)
            self.running.append(r)
            out.append((r, n))
            budget -= n
            planned += need
        return out

    def _shares_prefix_in_flight(self, r: Request) -> bool:
        bs = self.cache.block_size
        for p in self.running:
            if len(p.seq) >= len(p.prompt) - 1 or not p.hashes or not r.hashes or p.hashes[0] != r.hashes[0]:
                continue
            shared = next((i for i, (a, b) in enumerate(zip(p.hashes, r.hashes)) if a != b),
                          min(len(p.hashes), len(r.hashes)))
            if len(p.seq) < shared * bs:
                return True
        return False

    def _prompt_hashes(self, ids: list[int]) -> list[bytes]:
        return prefix_hashes(ids, self.cache.block_size) if self.prefix_cache else []

    def _preempt(self, r: Request) -> None:
        self.engine.release(r.seq, keep_cached=self.prefix_cache)
        r.seq = None
        r.stats.preemptions += 1
        self.stats.preemptions += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    # ---- running -----------------------------------------------------------------------
    def _forward(self, reqs: list[Request], tokens: list[list[int]]) -> None:
        argmax = all(r.argmax_only for r in reqs)
        # the constrained rows' masks are computed by llguidance (which lets go of the GIL) while
        # the forward runs: they depend on the tokens so far, not on this step's logits
        masks = {i: self._pool().submit(r.matcher.fill_mask, r.mask_row())
                 for i, (r, t) in enumerate(zip(reqs, tokens))
                 if r.matcher is not None and len(r.seq) + len(t) == len(r.known)}
        # greedy rows take the argmax where the logits are, among the tokens their masks
        # allow: the masks go to the engine, which asks for them once the forward is under way
        out = self.engine.step([r.seq for r in reqs], tokens, argmax=argmax,
                               masks=(lambda: self._mask_rows(reqs, masks)) if argmax and masks else None)
        self.stats.forwards += 1
        for i, (r, row) in enumerate(zip(reqs, out)):
            if len(r.seq) != len(r.known):
                continue                        # still catching up
            if i in masks and not masks[i].result():
                self._finish(r, "stop", stop_reason=f"constraint: {r.matcher.error}")
                continue
            self._accept(r, int(row) if argmax else self._sample(r, row, masked=i in masks))

    @staticmethod
    def _mask_rows(reqs: list[Request], masks: dict) -> np.ndarray:
        """The step's masks, one row a request (all ones where it has none or it allows nothing:
        that row's token is not taken)."""
        words = next(reqs[i].mask_row().shape[0] for i in masks)
        rows = np.full((len(reqs), words), 0xFFFFFFFF, np.uint32)
        for i, f in masks.items():
            if f.result():
                rows[i] = reqs[i].mask_row()
        return rows

    def _pool(self):
        if self._masks is None:
            from concurrent.futures import ThreadPoolExecutor
            self._masks = ThreadPoolExecutor(2, thread_name_prefix="llamba-mask")
        return self._masks

    def _sample(self, r: Request, logits: np.ndarray, masked: bool = False) -> int:
        logits = np.array(logits, np.float32)       # (a copy: the mask writes into it)
        if r.presence_penalty or r.frequency_penalty:
            logits = penalize_presence(logits, r.output, r.presence_penalty, r.frequency_penalty)
        if masked:
            from .constrain import apply_mask
            apply_mask(logits, r.mask_row())
        tok = r.sampler.sample(logits, r.known)
        if r.logprobs is not None:
            r.last_logprob = token_logprobs(logits, tok, r.logprobs)
        return tok

    def _accept(self, r: Request, tok: int) -> None:
        if r.text is None:
            r.text = TextStream(self.tok, r.stop)
            r.stats.first_token = time.monotonic()
        if r.matcher is not None and not r.matcher.consume(tok):
            return self._finish(r, "stop", stop_reason=f"constraint: {r.matcher.error}")
        if tok in self.stop_ids:
            return self._finish(r, "stop")
        r.output.append(tok)
        r.known.append(tok)
        r.stats.completion_tokens = len(r.output)
        self.stats.generated_tokens += 1
        piece = r.text.feed(tok)
        r.on_event(Event(text=piece, token=tok, logprob=r.last_logprob))
        if r.text.stopped or (r.matcher is not None and r.matcher.done):
            self._finish(r, "stop")
        elif len(r.output) >= r.max_tokens or len(r.known) >= self.engine.n_ctx:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, error: str | None = None, stop_reason: str | None = None) -> None:
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        r.stop_reason = stop_reason
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if r.seq is not None:
            self.engine.release(r.seq, keep_cached=self.prefix_cache)
            r.seq = None
        tail = r.text.finish() if r.text is not None and reason != "error" else ""
        r.stats.finished = time.monotonic()
        r.on_event(Event(text=tail, finish=reason, error=error, stop_reason=stop_reason))
        r.done.set()

    def _snapshot(self) -> None:
        pools = self.cache.pools
        total = sum(p.num_blocks for p in pools)
        free = sum(len(p.free) for p in pools)
        cached = sum(len(p.cached) for p in pools)
        self.stats.running, self.stats.waiting = len(self.running), len(self.waiting) + len(self._inbox)
        self.stats.kv = {"blocks_total": total, "blocks_used": total - free - cached, "blocks_cached": cached,
                         "blocks_free": free}


def penalize_presence(logits: np.ndarray, output: list[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's presence and frequency penalties over the tokens generated so far:
    logit -= presence * [count > 0] + frequency * count."""
    if not output:
        return logits
    ids, counts = np.unique(np.asarray(output, np.int64), return_counts=True)
    logits = logits.copy()
    logits[ids] -= presence + frequency * counts.astype(np.float32)
    return logits


def token_logprobs(logits: np.ndarray, tok: int, top: int) -> dict:
    """The chosen token's log-probability under the model (log-softmax of its logits, before
    any sampling filter) and the `top` most likely tokens'."""
    x = logits.astype(np.float64)
    finite = np.isfinite(x)
    m = x[finite].max()
    lse = m + math.log(np.exp(x[finite] - m).sum())
    lp = x - lse
    alts = []
    if top:
        idx = np.argpartition(-x, top - 1)[:top]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        alts = [(int(i), float(lp[i])) for i in idx]
    return {"token": tok, "logprob": float(lp[tok]), "top": alts}
