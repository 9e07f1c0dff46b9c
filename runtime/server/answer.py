"""A chat answer as the server sends it: reasoning apart from content, tool calls parsed out.

The text a model generates carries its reasoning inline (Qwen3's `<think>`, gpt-oss's analysis
channel: runtime/reasoning.py).  As llama-server and vLLM do, the server moves it into the
message's `reasoning_content` (streamed as `delta.reasoning_content`) unless the request or the
server asks for `reasoning_format: "none"` (the raw text in `content`).  Tool calls are then read
from the answer part only: in the model's own format (runtime/tools.py), or, for harmony, the
messages addressed `to=functions.NAME`.
"""
from __future__ import annotations

from .. import reasoning
from ..tools import ToolCall, ToolCallParser, parse_tool_calls


def template_reasons(template: str | None) -> bool:
    """Whether a chat template's model writes reasoning we know how to read."""
    t = template or ""
    return reasoning.THINK_OPEN in t or reasoning.THINK_CLOSE in t or reasoning.H_CHANNEL in t


class AnswerStream:
    """Pieces of text in, OpenAI chat deltas out ({"reasoning_content"}, {"content"}, {"tool_calls"}).
    `.content`, `.reasoning`, `.calls` hold what was sent, whole after the final feed."""

    def __init__(self, *, split: bool, opened: bool = False, tool_fmt: str | None = None, names=None):
        self.split = reasoning.Deltas() if split else None
        if self.split is not None and opened:       # the prompt opened <think>: the answer is inside it
            self.split.feed(reasoning.THINK_OPEN)
        self.harmony_calls = 0                      # harmony calls already looked at
        self.names = set(names or ())
        self.parser = ToolCallParser(tool_fmt, names=list(self.names)) if tool_fmt else None
        self.content = self.reasoning = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> list[dict]:
        out: list[dict] = []
        if self.split is None:
            think, said = "", text
        else:
            think, said = self.split.feed(text, final=final)
        if think:
            self.reasoning += think
            out.append({"reasoning_content": think})
        if self.parser is not None:
            deltas = (self.parser.feed(said) if said else []) + (self.parser.finish() if final else [])
            for d in deltas:
                if "content" in d:
                    self.content += d["content"]
            out += deltas
            if final:
                self.calls += self.parser.calls
        elif said:
            self.content += said
            out.append({"content": said})
        if self.split is not None:
            out += self._harmony_calls()
        return out

    def _harmony_calls(self) -> list[dict]:
        """Whole harmony calls not yet sent, each in one delta (name and arguments together)."""
        out = []
        calls = self.split.parts.calls
        while self.harmony_calls < len(calls) and calls[self.harmony_calls][2]:
            to, args, _ = calls[self.harmony_calls]
            self.harmony_calls += 1
            name = to.removeprefix("functions.")
            if not to.startswith("functions.") or name not in self.names:
                continue            # a built-in tool (browser, python) or a function not offered: not ours to run
            call = ToolCall(name, args or "{}")
            out.append({"tool_calls": [{"index": len(self.calls), **call.to_openai()}]})
            self.calls.append(call)
        return out


def whole_message(text: str, *, split: bool, opened: bool = False, tool_fmt: str | None = None,
                  tools=None) -> tuple[dict, bool]:
    """(the assistant message of a finished answer, whether it calls tools)."""
    names = [t["function"]["name"] for t in tools or []]
    s = AnswerStream(split=split, opened=opened, names=names)
    s.feed(text, final=True)
    content, calls = s.content, s.calls
    if tool_fmt is not None and not calls:
        content, calls = parse_tool_calls(content, tool_fmt, tools=tools)
    msg = {"role": "assistant", "content": content}
    if s.reasoning:
        msg["reasoning_content"] = s.reasoning
    if calls:
        msg["content"] = content or None
        msg["tool_calls"] = [c.to_openai() for c in calls]
    return msg, bool(calls)
