"""A multi-turn chat over one Engine: renders the model's chat template, keeps
the conversation's KV blocks between turns so a new turn only computes its own
tokens, and reports each turn's stats.  The CLI's `chat` and the desktop app
both drive this class.
"""
from __future__ import annotations

from .engine import Engine
from .generate import GenStats, Generation
from .sampling import SamplingParams


class ChatSession:
    def __init__(self, engine: Engine, system: str | None = None, params: SamplingParams | None = None,
                 max_tokens: int = 1024):
        self.engine = engine
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
        return msgs + self.messages

    def prompt_ids(self) -> list[int]:
        from .chat_template import encode_chat
        lm = self.engine.loaded
        return encode_chat(self.engine.tokenizer, lm.chat_template, self.conversation(),
                           arch=self.engine.config.arch)

    def _sequence_for(self, ids: list[int]):
        """Continue the cached sequence when the new prompt extends it; otherwise
        start a fresh one (its shared full blocks still come from the prefix cache)."""
        seq = self.seq
        if seq is not None and ids[:len(seq.tokens)] == seq.tokens and len(ids) > len(seq.tokens):
            return seq
        if seq is not None:
            self.engine.release(seq)
        self.seq = self.engine.new_sequence()
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
        if self.seq is not None:
            self.engine.release(self.seq)
            self.seq = None

    def _answer(self, should_stop, on_step):
        ids = self.prompt_ids()
        seq = self._sequence_for(ids)
        gen = Generation(self.engine, ids, self.params, max_tokens=self.max_tokens, seq=seq,
                         should_stop=should_stop, on_step=on_step)
        self.last_generation = gen
        reply = {"role": "assistant", "content": ""}
        self.messages.append(reply)
        try:
            for piece in gen:
                reply["content"] += piece
                yield piece
        finally:
            self.last_stats = gen.stats
