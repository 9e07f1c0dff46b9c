"""Token ids in, text out, for a streamed answer: detokenized a token at a time (never half a
UTF-8 character), held back while it could still be the start of a stop string, and cut
at the first stop string.  Everything `feed` and `finish` return, joined, is the answer."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop=()):
        self.stop = tuple(s for s in stop if s)
        # (a weights-only model, as the GPU tests load, has ids and no text)
        self._decoder = tokenizer.stream() if tokenizer is not None else _NoText()
        self._pending = ""          # decoded, not yet safe to show
        self.text = ""              # shown so far
        self.stopped = False        # a stop string was found; the text ends before it

    def feed(self, token: int) -> str:
        """Add a token; the text that is now safe to show (maybe "", and always after a stop)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.feed(token)
        hits = [self._pending.find(s) for s in self.stop if s in self._pending]
        if hits:
            emit, self._pending, self.stopped = self._pending[:min(hits)], "", True
        else:
            emit, self._pending = _hold_back(self._pending, self.stop)
        self.text += emit
        return emit

    def finish(self) -> str:
        """The answer is over: what was held back (all of it, unless a stop string cut it)."""
        tail = "" if self.stopped else self._pending + self._decoder.flush()
        self._pending = ""
        self.text += tail
        return tail


class _NoText:
    def feed(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def _hold_back(text: str, stops) -> tuple[str, str]:
    """(what to show, what to keep): keep the longest tail that is a prefix of some stop string."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return (text[:len(text) - keep], text[len(text) - keep:]) if keep else (text, "")
