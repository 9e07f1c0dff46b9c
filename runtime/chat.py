"""A multi-turn chat over one Engine: renders the model's chat template, keeps
the conversation's KV blocks between turns so a new turn only computes its own
tokens, and reports each turn's stats.  The CLI's `chat` and the desktop app
both drive this class.
"""
from __future__ import annotations

from . import reasoning
from .context import check_policy, fit_turns
from .engine import Engine
from .generate import GenStats, Generation
from .sampling import SamplingParams


class ChatSession:
    def __init__(self, engine: Engine, system: str | None = None, params: SamplingParams | None = None,
                 max_tokens: int = 1024, overflow: str | None = None, drafter=None, constraint=None):
        self.engine = engine
        # context overflow (runtime/context.py): "stop", "drop-turns" or "shift" (engine-level)
        self.overflow = check_policy(overflow or engine.overflow)
        if self.overflow == "shift" and engine.overflow != "shift":
            raise ValueError("overflow='shift' needs an Engine created with overflow='shift'")
        self.first_shown = 0          # drop-turns: messages before this index are not in the prompt
        self.dropped_turns = 0
        self.drafter = drafter      # speculative.Drafter or None
        self.constraint = constraint    # constrain.Constraint every answer follows, or None
        self.system = system
        self.params = params or SamplingParams()
        self.max_tokens = max_tokens
        self.messages: list[dict] = []
        self.seq = None
        self.last_stats = GenStats()
        self.last_generation: Generation | None = None

    # ---- prompt ------------------------------------------------------------------
    def conversation(self) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + self.messages[self.first_shown:]

    def _render(self, messages: list[dict]) -> list[int]:
        from .chat_template import encode_chat
        lm = self.engine.loaded
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        # earlier answers as the template wants them: the answer as content, the reasoning
        # apart (reasoning.py; gpt-oss's template refuses channel markers in content)
        msgs += [{**m, **reasoning.for_template(m["content"])}
                 if m.get("role") == "assistant" and isinstance(m.get("content"), str) else m for m in messages]
        return encode_chat(self.engine.tokenizer, lm.chat_template, msgs, arch=self.engine.config.arch)

    def prompt_ids(self) -> list[int]:
        """The prompt the model sees; under drop-turns, the oldest turns are left out
        until it fits with room for an answer (self.dropped_turns counts them)."""
        if self.overflow != "drop-turns":
            return self._render(self.messages[self.first_shown:])
        reserve = min(self.max_tokens, self.engine.n_ctx // 4)
        first, ids = fit_turns(self.messages[self.first_shown:], self._render, self.engine.n_ctx, reserve)
        if first:
            self.dropped_turns += sum(m["role"] == "user" for m in self.messages[self.first_shown:self.first_shown + first])
            self.first_shown += first
        return ids

    def _sequence_for(self, ids: list[int]):
        """Continue the cached sequence when the new prompt extends it; otherwise
        start a fresh one (its shared full blocks still come from the prefix cache)."""
        seq = self.seq
        if seq is not None and ids[:len(seq.history)] == seq.history and len(ids) > len(seq.history):
            return seq        # (history: every id fed, also those a context shift dropped)
        if seq is not None:
            self.engine.release(seq)
        self.seq = self.engine.new_sequence()
        if self.overflow == "shift":     # a context shift never drops the system prompt
            sys_ids = self._render([]) if self.system else ids[:1]
            self.seq.keep = next((i for i, (x, y) in enumerate(zip(sys_ids, ids)) if x != y), min(len(sys_ids), len(ids)))
        return self.seq

    # ---- turns -------------------------------------------------------------------
    def send(self, text: str, should_stop=None, on_step=None):
        """Add a user message and stream the assistant's answer (yields text pieces)."""
        self.messages.append({"role": "user", "content": text})
        yield from self._answer(should_stop, on_step)

    def regenerate(self, should_stop=None, on_step=None):
        """Drop the last answer and answer the last user message again."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        yield from self._answer(should_stop, on_step)

    def edit(self, index: int, text: str, should_stop=None, on_step=None):
        """Replace user message `index` (in self.messages), drop what followed, answer anew."""
        if self.messages[index]["role"] != "user":
            raise ValueError("only user messages can be edited")
        del self.messages[index + 1:]
        self.messages[index] = {"role": "user", "content": text}
        yield from self._answer(should_stop, on_step)

    def clear(self) -> None:
        self.messages.clear()
        self.first_shown = self.dropped_turns = 0
        if self.seq is not None:
            self.engine.release(self.seq)
            self.seq = None

    def _answer(self, should_stop, on_step):
        ids = self.prompt_ids()
        seq = self._sequence_for(ids)
        gen = Generation(self.engine, ids, self.params, max_tokens=self.max_tokens, seq=seq,
                         should_stop=should_stop, on_step=on_step, drafter=self.drafter,
                         constraint=self.constraint)
        self.last_generation = gen
        reply = {"role": "assistant", "content": ""}
        self.messages.append(reply)
        if reasoning.prompt_opens_reasoning(self.engine.tokenizer, ids):      # the template opened <think>: the answer says so itself
            reply["content"] = reasoning.THINK_OPEN
            yield reasoning.THINK_OPEN
        try:
            for piece in gen:
                reply["content"] += piece
                yield piece
        finally:
            self.last_stats = gen.stats
