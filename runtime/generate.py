"""The token loop: prefill a prompt, then sample, decode and stream text until
EOS/end-of-turn, a stop string, max_tokens, a stop request, or a full context.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .constrain import ConstraintDead
from .engine import ContextOverflow, Engine
from .kv_cache import Sequence
from .sampling import Sampler, SamplingParams
from .text_stream import TextStream


@dataclass
class GenStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    stop_reason: str = ""
    speculative: dict = field(default_factory=dict)
    constraint_error: str = ""      # stop_reason "constraint": why no token could follow

    @property
    def prompt_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.reused_tokens
        return computed / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        # the first token comes from the prefill's logits; the rest from decode steps
        n = self.generated_tokens - 1
        return n / self.generate_seconds if self.generate_seconds and n > 0 else 0.0


class Generation:
    """Iterate to get text pieces as they are decoded; `.ids`, `.text`, `.stats` after."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams | None = None,
                 max_tokens: int = 128, stop: tuple[str, ...] = (), seq: Sequence | None = None,
                 should_stop=None, on_step=None, drafter=None, constraint=None):
        self.engine, self.prompt_ids = engine, list(prompt_ids)
        self.drafter = drafter      # a speculative.Drafter: decode with a draft model
        # a constrain.Constraint (or one sequence's Matcher): the output follows its grammar and
        # ends ("stop") where the grammar allows nothing more
        self.constraint = constraint
        self.matcher = None
        self.params = params or SamplingParams()
        self.max_tokens, self.stop = max_tokens, tuple(s for s in stop if s)
        self.seq = seq
        self.should_stop = should_stop or (lambda: False)
        self.on_step = on_step
        self.ids: list[int] = []
        self.text = ""
        self.stats = GenStats()

    def __iter__(self):
        eng = self.engine
        tok = eng.tokenizer
        stop_ids = tok.stop_ids if tok is not None else frozenset()     # (a weights-only model has no tokenizer)
        sampler = Sampler(self.params)
        seq = self.seq if self.seq is not None else eng.new_sequence()   # an empty Sequence is falsy
        self.seq = seq
        st = self.stats
        st.prompt_tokens = len(self.prompt_ids)
        t0 = time.perf_counter()
        logits = eng.prefill(seq, self.prompt_ids)
        st.reused_tokens = seq.reused_tokens
        st.prompt_seconds = time.perf_counter() - t0
        history = list(self.prompt_ids)
        text = TextStream(tok, self.stop)    # holds back what could still begin a stop string
        c = self.constraint
        matcher = self.matcher = c.matcher() if hasattr(c, "matcher") else c
        t1 = time.perf_counter()
        source = (self.drafter.tokens(seq, logits, history, sampler, matcher) if self.drafter
                  else _plain_tokens(eng, seq, logits, history, sampler, matcher))
        while True:
            try:
                nxt = next(source)
            except ContextOverflow:
                st.stop_reason = "context"
                break
            except ConstraintDead as e:
                st.stop_reason, st.constraint_error = "constraint", str(e)
                break
            if nxt in stop_ids:
                st.stop_reason = "eos"
                break
            if matcher is not None and not matcher.consume(nxt):
                st.stop_reason, st.constraint_error = "constraint", matcher.error
                break
            self.ids.append(nxt)
            history.append(nxt)
            st.generated_tokens = len(self.ids)
            emit = text.feed(nxt)
            if emit:
                self.text += emit
                yield emit
            if text.stopped:
                st.stop_reason = "stop"
                break
            if matcher is not None and matcher.done:     # the grammar is complete: nothing may follow
                st.stop_reason = "stop"
                break
            if len(self.ids) >= self.max_tokens:
                st.stop_reason = "length"
                break
            if self.should_stop():
                st.stop_reason = "cancelled"
                break
            st.generate_seconds = time.perf_counter() - t1
            if self.on_step:
                self.on_step(self)
        st.generate_seconds = time.perf_counter() - t1
        if self.drafter:
            # leave the cache as plain decoding would: every emitted token fed but the
            # last (all after EOS); accepted drafts past the stop must not stay
            self.drafter.finish(seq, len(self.prompt_ids) + len(self.ids) - (st.stop_reason != "eos"))
            st.speculative = self.drafter.stats.as_dict()
        tail = text.finish()
        if tail:
            self.text += tail
            yield tail

    def run(self) -> "Generation":
        for _ in self:
            pass
        return self


def greedy_next(eng: Engine, seq: Sequence, token: int) -> int:
    """Feed one token and return the greedy next one: the argmax alone, taken where the
    logits are (on the device for the CUDA backend).  bench's tg decodes through this too."""
    return int(eng.step([seq], [[token]], argmax=True)[0])


def _masked_greedy_next(eng: Engine, seq: Sequence, token: int, matcher) -> int:
    """greedy_next among the tokens `matcher` allows: the mask is computed while the
    forward runs (llguidance lets go of the GIL) and goes to the engine with the step."""
    global _MASK_POOL
    if _MASK_POOL is None:
        from concurrent.futures import ThreadPoolExecutor
        _MASK_POOL = ThreadPoolExecutor(1, thread_name_prefix="llamba-mask")
    row = np.zeros(matcher.n_words, np.uint32)
    ok = _MASK_POOL.submit(matcher.fill_mask, row)
    nxt = int(eng.step([seq], [[token]], argmax=True,
                       masks=lambda: row if ok.result() else np.full_like(row, 0xFFFFFFFF))[0])
    if not ok.result():
        raise ConstraintDead(matcher.error)
    return nxt


_MASK_POOL = None


def _plain_tokens(eng: Engine, seq: Sequence, logits, history: list[int], sampler: Sampler, matcher=None):
    """One target step per token; the consumer appends each token to history (and
    consumes it into `matcher`, whose mask each step's logits get).  Greedy decoding
    without penalties or constraint asks the engine for the argmax alone (no logits)."""
    def pick(logits):
        return sampler.sample(logits if matcher is None else matcher.mask_logits(logits), history)
    nxt = pick(logits)
    while True:
        yield nxt
        if sampler.p.argmax_only and matcher is None:
            nxt = greedy_next(eng, seq, nxt)
        elif sampler.p.argmax_only:         # greedy under a constraint: the argmax among allowed tokens
            nxt = _masked_greedy_next(eng, seq, nxt, matcher)
        else:
            nxt = pick(eng.step([seq], [[nxt]])[0])
