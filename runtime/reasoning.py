"""A model's reasoning apart from its answer, read from the text it generates.

Two ways of writing it are known (the text keeps the special tokens' spelling: the
stream decodes them):

- think tags (Qwen3, DeepSeek-R1, SmolLM3, ...): `<think>` reasoning `</think>` answer.  A
  template may open the tag in the prompt (the answer then begins inside the reasoning);
  `ChatSession` writes the `<think>` in front of such an answer, so that every stored
  answer describes itself.
- harmony (gpt-oss): messages `<|start|>assistant<|channel|>NAME<|message|>` text `<|end|>`,
  the answer's first header already in the prompt (`<|start|>assistant`): the `analysis`
  channel is the reasoning, `final` (and `commentary`, the user-visible preambles) the answer;
  a message to a recipient (`to=functions.NAME` in its header) is a tool call, its body the
  arguments; `<|return|>` / `<|call|>` end the turn.

`split(text)` reads a whole or partial answer (the app re-reads the streamed text at
each refresh); `for_template(text)` gives the fields a chat template wants back for an
earlier answer (the answer as `content`, the reasoning as `reasoning_content` and
`thinking`), so a template never sees the markers of another turn.  Text without any
marker is all answer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# harmony's tokens, as gpt-oss's vocabulary spells them
H_START, H_CHANNEL, H_MESSAGE, H_END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
H_RETURN, H_CALL, H_CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
_H_MARKS = (H_START, H_CHANNEL, H_MESSAGE, H_END, H_RETURN, H_CALL)
REASONING_CHANNELS = ("analysis",)
_MAX_HEADER = 256       # a "header" longer than this was never one: the text is shown as answer
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Parts:
    reasoning: str = ""
    answer: str = ""
    thinking: bool = False      # the text ends inside the reasoning (still thinking)
    format: str = ""            # "think", "harmony" or "" (no markers)
    # harmony's tool calls: (function name, arguments text, whole); a call still being written
    # comes last with whole=False
    calls: list = field(default_factory=list)


def detect(text: str) -> str:
    """The way `text` writes its reasoning: "harmony", "think" or ""."""
    if H_CHANNEL in text or H_MESSAGE in text:
        return "harmony"
    if THINK_OPEN in text or THINK_CLOSE in text:
        return "think"
    return ""


def split(text: str, fmt: str | None = None, final: bool = False) -> Parts:
    """Reasoning and answer of a whole or partial answer: markers that may still be coming
    (e.g. a trailing `<|chan`) are left out of both, unless the answer is `final` (then
    such a tail was text)."""
    fmt = detect(text) if fmt is None else fmt
    if not fmt and text and not final and \
            any(m.startswith(text) for m in (H_CHANNEL, THINK_OPEN)):
        return Parts()          # the first marker still arriving
    if fmt == "harmony":
        return _split_harmony(text, final)
    if fmt == "think":
        return _split_think(text, final)
    return Parts(answer=text)


def for_template(text: str) -> dict:
    """An earlier assistant answer as a chat template wants it: {"content": the answer}
    and, when there was reasoning, "reasoning_content" (Qwen3, DeepSeek) and "thinking"
    (gpt-oss) with it.  Text without markers comes back unchanged."""
    p = split(text)
    if not p.format:
        return {"content": text}
    out = {"content": p.answer}
    if p.reasoning:
        out["reasoning_content"] = out["thinking"] = p.reasoning
    return out


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ends inside think tags (its template opened `<think>` for the answer)."""
    i = prompt_tail.rfind(THINK_OPEN)
    return i >= 0 and prompt_tail.find(THINK_CLOSE, i) < 0


def prompt_opens_reasoning(tok, ids) -> bool:
    """Whether prompt ids end inside think tags (a tokenizer-less model's never do)."""
    return tok is not None and bool(ids) and opens_reasoning(tok.decode(ids[-16:]))


class Deltas:
    """A streamed answer's pieces in, (new reasoning text, new answer text) out: what
    `split` of the text so far adds to what it gave before (each is a prefix of the next)."""

    def __init__(self):
        self.text = ""
        self._r = self._a = 0
        self.parts = Parts()        # the last split (harmony's tool calls are read from it)

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.text += piece
        p = self.parts = split(self.text, final=final)
        out = p.reasoning[self._r:], p.answer[self._a:]
        self._r, self._a = len(p.reasoning), len(p.answer)
        return out

    def finish(self) -> tuple[str, str]:
        """The answer ended: what was held back as a possible marker, as text."""
        return self.feed("", final=True)


def _partial_tail(text: str, marks) -> int:
    """Length of the longest tail of text that is a proper prefix of one of `marks`."""
    best = 0
    for m in marks:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _split_think(text: str, final: bool = False) -> Parts:
    reasoning, answer = [], []
    inside = False
    i = 0
    while True:
        mark = THINK_CLOSE if inside else THINK_OPEN
        j = text.find(mark, i)
        if j < 0:
            rest = text[i:]
            rest = rest[:len(rest) - (0 if final else _partial_tail(rest, (mark,)))]
            (reasoning if inside else answer).append(rest)
            break
        (reasoning if inside else answer).append(text[i:j])
        inside = not inside
        i = j + len(mark)
    return Parts(reasoning="".join(reasoning).strip("\n"), answer="".join(answer).lstrip("\n"), thinking=inside,
                 format="think")


def _split_harmony(text: str, final: bool = False) -> Parts:
    """Messages of the assistant's turn; the first header's `<|start|>assistant` was in the prompt."""
    reasoning, answer, calls = [], [], []
    i, n = 0, len(text)
    state = "header"             # header -> body -> (after <|end|>) between -> header ...
    channel = to = None
    while i < n:
        if state == "header":
            j = text.find(H_MESSAGE, i)
            if j < 0:
                head = text[i:]
                if len(head) > _MAX_HEADER:      # no harmony here: what was said is the answer
                    answer.append(head)
                break
            head = text[i:j]         # e.g. "<|channel|>analysis", " to=functions.f<|channel|>commentary json"
            c = head.find(H_CHANNEL)
            words = head[c + len(H_CHANNEL):].replace(H_CONSTRAIN, " ").split() if c >= 0 else []
            channel = words[0] if words else None
            r = _RECIPIENT.search(head)      # before or after the channel: "assistant to=functions.f<|channel|>.."
            to = r.group(1) if r else None
            state, i = "body", j + len(H_MESSAGE)
        elif state == "body":
            ends = [(k, m) for m in (H_END, H_RETURN, H_CALL, H_START) if (k := text.find(m, i)) >= 0]
            if to:
                body = text[i:min(ends)[0]] if ends else text[i:]
                calls.append((to, body.strip(), bool(ends) or final))
                out = []
            else:
                out = reasoning if channel in REASONING_CHANNELS else answer
            if not ends:
                rest = text[i:]
                out.append(rest[:len(rest) - (0 if final else _partial_tail(rest, _H_MARKS))])
                break
            k, m = min(ends)
            out.append(text[i:k])
            if m == H_START:            # a message that never ended: the next one's header
                state, i = "header", k + len(H_START)
            elif m == H_END:
                state, i = "between", k + len(H_END)
            else:
                i = n
                state = "done"
        else:       # between messages: <|start|> opens the next one; anything else is shown as answer
            j = text.find(H_START, i)
            gap = text[i:] if j < 0 else text[i:j]
            if gap.strip():
                answer.append(gap[:len(gap) - _partial_tail(gap, _H_MARKS)] if j < 0 and not final else gap)
            if j < 0:
                break
            state, i = "header", j + len(H_START)
    said = "".join(answer)
    thinking = (state == "body" and channel in REASONING_CHANNELS) or (state in ("header", "between") and not said)
    return Parts(reasoning="\n\n".join(r for r in reasoning if r), answer=said, thinking=thinking, format="harmony",
                 calls=calls)
