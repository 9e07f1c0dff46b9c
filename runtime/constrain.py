"""Constrained decoding: JSON schemas, Lark/GBNF grammars and regexes, compiled by llguidance.

Why llguidance, not xgrammar or outlines-core (in 5 lines):
1. vocabulary: any tokenizer as per-id byte strings, special ids apart: our GGUF tokenizers as they are.
2. lazy grammars: `[lazy]` lexemes, special-token triggers, inline `%json` (free text, then a held tool call).
3. no torch: masks written through a pointer into our arrays (xgrammar's bitmask API and wheel need torch).
4. speed: Earley parsing on a derivative lexer, masks on the fly (~0.05-1 ms), near-zero compile time.
5. JSON schema: widest coverage on JSONSchemaBench; outlines-core is regular-only (no recursion/$ref cycles).

Pieces, per request/sequence:

* `Constraint.json_schema / json_object / lark / gbnf / regex (..., tok)`: compiled once for a tokenizer and
  cached (a small LRU keyed by the kind and text); compile errors raise `ConstraintError` (a ValueError) whose
  message says where the grammar or schema fails.
* `m = constraint.matcher()`, one per sequence: `m.fill_mask(row)` writes the allowed tokens as a bitmask (bit
  t of word t // 32) into a uint32 row; `m.consume(token)`; `m.rollback(n)`; `m.is_accepting()`; `m.done`
  (nothing but EOS may follow: stop now, finish reason "stop"); `m.dead` (no token may follow: end the
  answer, `m.error` says why).  `m.fill_masks(rows, drafts)` gives the masks of a speculative verify step.
* `apply_mask(logits, bitmask)`: disallowed logits set to -inf in place, [B, V] float32 against [B, ceil(V/32)]
  uint32: a Numba kernel for numpy arrays, a CuPy kernel for device arrays.

A batched decode step (the scheduler):

    bitmask = np.full((B, mask_words(V)), 0xFFFFFFFF, np.uint32)    # rows without a constraint: all ones
    for i, r in enumerate(rows):
        if r.matcher is not None and not r.matcher.fill_mask(bitmask[i]):
            finish(r, "constraint", r.matcher.error)                 # nothing may follow
    apply_mask(logits, bitmask)                                       # [B, V], numpy or cupy (upload the mask)
    ...sample...; r.matcher.consume(token); r.matcher.done -> finish(r, "stop")

JSON grammars allow no whitespace besides the separators ", " and ": " (a small model could otherwise emit
spaces and newlines until max_tokens), and date-time/time strings without a maxLength get one (the fraction
of a second is unbounded otherwise).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import quant  # noqa: F401  (first: it points Numba's cache at quant/kernel_cache.py's folder)
import numba as nb
import numpy as np

__all__ = ["Constraint", "Matcher", "ConstraintError", "ConstraintDead", "apply_mask", "ll_tokenizer",
           "JSON_OPTIONS", "mask_words"]

# the JSON compiler's options: no free whitespace, fixed separators
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64          # compiled constraints kept (compiling a large schema takes milliseconds to seconds)


class ConstraintError(ValueError):
    """A schema, grammar or regex that does not compile; the message says where it fails."""


class ConstraintDead(RuntimeError):
    """No token can continue the constrained output (the grammar allows nothing more, yet is not complete)."""


def mask_words(n_vocab: int) -> int:
    return (int(n_vocab) + 31) // 32


def _llg():
    try:
        import llguidance
    except ImportError as e:        # pragma: no cover - a dependency of the package
        raise ConstraintError(f"constrained output needs the llguidance package (pip install llguidance): "
                              f"{type(e).__name__}: {e}") from e
    return llguidance


# ---- the vocabulary -------------------------------------------------------------------------------------------
_TOK_LOCK = threading.Lock()
_TOK_CACHE: OrderedDict = OrderedDict()      # (id(token list), n_vocab, eos) -> (token list, LLTokenizer)


def _our_tokenizer(tok):
    """(runtime Tokenizer, logits width) from a Tokenizer, an Engine or a LoadedModel."""
    if hasattr(tok, "token_bytes"):
        return tok, tok.vocab_size
    inner = getattr(tok, "tokenizer", None)
    if inner is None or not hasattr(inner, "token_bytes"):
        raise TypeError(f"expected a Tokenizer, an Engine or a LoadedModel, got {type(tok).__name__}")
    cfg = getattr(tok, "config", None)
    return inner, max(int(getattr(cfg, "vocab_size", 0) or 0), inner.vocab_size)


def ll_tokenizer(tok, n_vocab: int | None = None):
    """The llguidance tokenizer of our Tokenizer (or an Engine/LoadedModel's): every id's bytes as our decoder
    gives them, CONTROL tokens marked special (a grammar names them `<|im_end|>`, text never matches them),
    and the end-of-generation set as EOS.  n_vocab: the logits' width when wider than the vocabulary (padding
    ids are never allowed).  Built once per vocabulary (~0.3-1 s) and cached."""
    llg = _llg()
    if isinstance(tok, llg.LLTokenizer):
        return tok
    t, width = _our_tokenizer(tok)
    n = max(int(n_vocab or 0), width)
    stops = sorted(int(i) for i in t.stop_ids) or ([t.eos_id] if t.eos_id is not None else [0])
    tokens = getattr(t, "_tokens", None)
    key = (id(tokens) if tokens is not None else id(t), n, tuple(stops))
    with _TOK_LOCK:
        hit = _TOK_CACHE.get(key)
        if hit is not None:
            _TOK_CACHE.move_to_end(key)
            return hit[1]

    class _Vocab:           # what llguidance.TokenizerWrapper reads
        eos_token_id = stops[0]
        bos_token_id = t.bos_id
        tokens = [t.token_bytes(i) for i in range(t.vocab_size)]
        special_token_ids = [i for i in range(t.vocab_size) if t.is_control(i)]

        def __call__(self, s):
            text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
            return t.encode(text, add_bos=False, parse_special=False)

    ll = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), n_vocab=n, eos_token=stops)
    with _TOK_LOCK:
        _TOK_CACHE[key] = (tokens if tokens is not None else t, ll)
        while len(_TOK_CACHE) > 4:
            _TOK_CACHE.popitem(last=False)
    return ll


# ---- compiling --------------------------------------------------------------------------------------------------
_CACHE_LOCK = threading.Lock()
_CACHE: OrderedDict = OrderedDict()          # (kind, text, id(LLTokenizer)) -> Constraint


class Constraint:
    """A compiled grammar for one vocabulary.  Build with the classmethods; `matcher()` per sequence."""

    def __init__(self, kind: str, source: str, grammar: str, ll, proto):
        self.kind, self.source, self.grammar = kind, source, grammar
        self.ll = ll
        self._proto = proto          # a fresh LLMatcher; each sequence gets a deep copy
        self.n_vocab = ll.vocab_size
        self.n_words = mask_words(self.n_vocab)
        self.warnings = list(proto.get_grammar_warnings())

    def __repr__(self) -> str:
        src = self.source if len(self.source) < 60 else self.source[:57] + "..."
        return f"Constraint({self.kind}, {src!r})"

    def matcher(self) -> "Matcher":
        return Matcher(self, self._proto.deep_copy())

    # -- builders
    @classmethod
    def _build(cls, kind: str, source: str, tok, make_grammar, where: str) -> "Constraint":
        llg = _llg()
        ll = ll_tokenizer(tok)
        key = (kind, source, id(ll))
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
            if hit is not None and hit.ll is ll:
                _CACHE.move_to_end(key)
                return hit
        try:
            grammar = make_grammar()
        except ConstraintError:
            raise
        except Exception as e:      # the converters' and llguidance's ValueErrors
            raise ConstraintError(f"{where}: {e}") from None
        proto = llg.LLMatcher(ll, grammar, log_level=0)
        if proto.is_error():
            raise ConstraintError(f"{where}: {proto.get_error().strip()}")
        c = cls(kind, source, grammar, ll, proto)
        with _CACHE_LOCK:
            _CACHE[key] = c
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
        return c

    @classmethod
    def json_schema(cls, schema, tok, *, lenient: bool = False) -> "Constraint":
        """Output that is one JSON value valid under `schema` (a dict or its JSON text).  lenient: ignore
        keywords llguidance does not implement instead of failing."""
        if isinstance(schema, (bytes, str)):
            text = schema.decode() if isinstance(schema, bytes) else schema
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"JSON schema is not valid JSON: {e.msg} at line {e.lineno} "
                                      f"column {e.colno}") from None
        else:
            obj = schema
        if not isinstance(obj, dict):
            if obj is True:
                obj = {}
            else:
                raise ConstraintError(f"JSON schema must be an object, got {type(obj).__name__}")
        obj = _bound_formats(obj)
        text = json.dumps(obj, sort_keys=True, ensure_ascii=False)
        opts = dict(JSON_OPTIONS, lenient=bool(lenient))
        llg = _llg()
        return cls._build("json_schema" + ("~" if lenient else ""), text, tok,
                          lambda: llg.LLMatcher.grammar_from_json_schema(obj, overrides=opts), "JSON schema")

    @classmethod
    def json_object(cls, tok) -> "Constraint":
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls.json_schema({"type": "object"}, tok)

    @classmethod
    def lark(cls, text: str, tok) -> "Constraint":
        """A Lark grammar in llguidance's dialect (`start:` rule; `%json {...}`, `<|special|>`, `[lazy]`)."""
        llg = _llg()
        return cls._build("lark", text, tok, lambda: llg.LLMatcher.grammar_from_lark(text), "Lark grammar")

    @classmethod
    def gbnf(cls, text: str, tok) -> "Constraint":
        """A llama.cpp GBNF grammar (`root ::= ...`), converted to Lark by llguidance's converter."""
        llg = _llg()

        def make():
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                lark = gbnf_to_lark(text)
            except Exception as e:
                raise ConstraintError(f"GBNF grammar: {e}") from None
            return llg.LLMatcher.grammar_from_lark(lark)
        return cls._build("gbnf", text, tok, make, "GBNF grammar (as converted to Lark)")

    @classmethod
    def regex(cls, pattern: str, tok) -> "Constraint":
        """Output that matches `pattern` as a whole (Rust regex syntax)."""
        llg = _llg()
        return cls._build("regex", pattern, tok, lambda: llg.LLMatcher.grammar_from_regex(pattern), "regex")

    @classmethod
    def grammar(cls, text: str, tok) -> "Constraint":
        """A grammar file's text: GBNF when it has `::=` rules, else Lark."""
        return cls.gbnf(text, tok) if is_gbnf(text) else cls.lark(text, tok)


# string formats whose grammar has an unbounded part (a time's fraction of a second: a small model sampled
# "12.72178000000600863812..." until max_tokens): without a maxLength of their own they get this one
# (nanoseconds and an offset still fit)
BOUNDED_FORMATS = {"date-time": 35, "time": 24}


def _bound_formats(node, depth: int = 0):
    """The schema with a maxLength on unbounded date-time/time strings (a copy where anything changed)."""
    if depth > 64:
        return node
    if isinstance(node, list):
        return [_bound_formats(v, depth + 1) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bound_formats(v, depth + 1) if k not in ("const", "enum", "default", "examples") else v
           for k, v in node.items()}
    n = BOUNDED_FORMATS.get(out.get("format")) if isinstance(out.get("format"), str) else None
    if n and "maxLength" not in out and out.get("type", "string") == "string":
        out["maxLength"] = n
    return out


def is_gbnf(text: str) -> bool:
    """GBNF (`name ::= ...`) rather than Lark (`name: ...`)."""
    from llguidance.gbnf_to_lark import is_lark_syntax
    return "::=" in text and not is_lark_syntax(text)


# ---- per sequence ------------------------------------------------------------------------------------------------
class Matcher:
    """The state of one constrained sequence.  Every token the sequence emits must be `consume`d, in order."""

    def __init__(self, constraint: Constraint, m):
        self.constraint = constraint
        self._m = m
        self.n_words = constraint.n_words
        self._row = np.zeros(self.n_words, np.uint32)      # scratch for mask_logits
        self._empty = False          # the last mask allowed nothing
        self.n_consumed = 0

    def clone(self) -> "Matcher":
        c = Matcher(self.constraint, self._m.deep_copy())
        c._empty, c.n_consumed = self._empty, self.n_consumed
        return c

    # -- state
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS would be allowed)."""
        return self._m.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing but EOS may follow (and the output is complete): end with finish reason "stop"."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def dead(self) -> bool:
        """No token can follow: an error (a disallowed token was consumed) or a mask that allowed nothing
        while the output is incomplete."""
        return self._m.is_error() or self._empty

    @property
    def error(self) -> str:
        if self._m.is_error():
            return self._m.get_error().split("\n<state>")[0].strip()
        return "the grammar allows no further token" if self._empty else ""

    # -- masks
    def fill_mask(self, row) -> bool:
        """Write the allowed next tokens into `row` (uint32, C-contiguous, at least n_words long; words past
        n_words are zeroed).  Returns whether any token is allowed."""
        n = self.n_words
        if row.dtype != np.uint32 or not row.flags["C_CONTIGUOUS"] or row.shape[-1] < n:
            raise ValueError(f"mask row must be C-contiguous uint32 of at least {n} words")
        if self._m.is_error():
            row[:] = 0
            self._empty = True
            return False
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, n * 4)
        if row.shape[-1] > n:
            row[n:] = 0
        self._empty = not row[:n].any()
        return not self._empty

    def fill_masks(self, rows, drafts) -> int:
        """Masks of a verify step: rows[0] for the next token, rows[i + 1] after drafts[:i + 1] (rows: uint32
        [>= len(drafts) + 1, >= n_words]).  The matcher ends where it began.  Returns the rows filled: it
        stops after a draft that is not allowed or after which nothing may follow (rows past it are zero)."""
        n = 0
        fed = 0
        try:
            for i in range(len(drafts) + 1):
                if not self.fill_mask(rows[i]):
                    n = i + 1
                    break
                n = i + 1
                if i == len(drafts):
                    break
                d = int(drafts[i])
                if not _bit(rows[i], d) or not self._m.consume_token(d):
                    break
                fed += 1
                if self._m.is_stopped():
                    n = i + 2
                    self.fill_mask(rows[i + 1])
                    break
        finally:
            if fed:
                self._m.rollback(fed)
        self._empty = n == 0 or not rows[0][:self.n_words].any()
        rows[n:] = 0
        return n

    def mask_logits(self, logits, ids=None):
        """Mask one row of logits in place (and return it).  ids: the token id of each logit when the row
        covers a subset of the vocabulary (a draft's cut output layer).  Raises ConstraintDead when nothing
        is allowed (among `ids`, when given)."""
        if not self.fill_mask(self._row):
            raise ConstraintDead(self.error)
        if ids is None:
            apply_mask(logits, self._row)
        else:
            ids = np.asarray(ids, np.int64)
            ok = (self._row[np.minimum(ids >> 5, self.n_words - 1)] >> (ids & 31).astype(np.uint32)) & 1
            ok &= ids < 32 * self.n_words
            if not ok.any():
                raise ConstraintDead("none of the draft's tokens is allowed")
            logits[ok == 0] = -np.inf
        return logits

    def allowed(self, token: int) -> bool:
        """Whether `token` is allowed now (computes the mask)."""
        self.fill_mask(self._row)
        return _bit(self._row, int(token))

    def first_allowed(self) -> int:
        """The lowest allowed token id (after fill_mask/mask_logits), -1 if none."""
        nz = np.flatnonzero(self._row)
        if nz.size == 0:
            return -1
        w = int(nz[0])
        v = int(self._row[w])
        return 32 * w + ((v & -v).bit_length() - 1)

    # -- advancing
    def consume(self, token: int) -> bool:
        """Advance by one emitted token.  False (and `dead`) when the grammar does not allow it."""
        ok = self._m.consume_token(int(token))
        if ok:
            self.n_consumed += 1
            self._empty = False
        return ok

    def consume_tokens(self, tokens) -> bool:
        return all(self.consume(t) for t in tokens)

    def rollback(self, n: int) -> None:
        """Take back the last n consumed tokens (a rejected speculative draft)."""
        n = int(n)
        if n <= 0:
            return
        if n > self.n_consumed:
            raise ValueError(f"cannot roll back {n} tokens: {self.n_consumed} consumed")
        if not self._m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self._m.get_error()}")
        self.n_consumed -= n
        self._empty = False

    def reset(self) -> None:
        self._m.reset()
        self.n_consumed = 0
        self._empty = False


def _bit(row, t: int) -> bool:
    w = t >> 5
    return 0 <= t and w < row.shape[-1] and bool((int(row[w]) >> (t & 31)) & 1)


# ---- applying a mask ------------------------------------------------------------------------------------------
@nb.njit(cache=True, nogil=True)
def _apply_mask_cpu(logits, bitmask):       # pragma: no cover - compiled
    # serial on purpose: a prange launch costs milliseconds on a busy machine, the whole row 10-100 us
    B, V = logits.shape
    W = bitmask.shape[1]
    nw = (V + 31) // 32
    neg = np.float32(-np.inf)
    for b in range(B):
        row = logits[b]
        for w in range(nw):
            word = bitmask[b, w] if w < W else np.uint32(0)
            lo = w * 32
            if word == np.uint32(0xFFFFFFFF):
                continue
            if word == np.uint32(0):
                for i in range(lo, min(lo + 32, V)):
                    row[i] = neg
            elif lo + 32 <= V:
                for s in range(32):         # branch-free select: vectorizes
                    keep = (word >> np.uint32(s)) & np.uint32(1)
                    row[lo + s] = row[lo + s] if keep else neg
            else:
                for i in range(lo, V):
                    keep = (word >> np.uint32(i - lo)) & np.uint32(1)
                    row[i] = row[i] if keep else neg


# one thread a logit; compiled by CuPy (NVRTC) on first use.  No headers: -inf from its bits.
MASK_KERNEL_SOURCE = r"""
extern "C" __global__ void llamba_apply_token_mask(float* __restrict__ logits, const unsigned int* __restrict__ mask,
                                                   int V, int W, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int b = (int)(i / V), t = (int)(i - (long long)b * V), w = t >> 5;
    if (w >= W || !((mask[(long long)b * W + w] >> (t & 31)) & 1u)) logits[i] = __int_as_float(0xff800000);
}
"""
_CUDA_KERNEL = None


def _apply_mask_cuda(logits, bitmask):      # pragma: no cover - needs a GPU
    global _CUDA_KERNEL
    import cupy as cp
    if _CUDA_KERNEL is None:
        _CUDA_KERNEL = cp.RawKernel(MASK_KERNEL_SOURCE, "llamba_apply_token_mask")
    B, V = logits.shape
    mask = cp.ascontiguousarray(cp.asarray(bitmask, dtype=cp.uint32))
    n = B * V
    threads = 256
    _CUDA_KERNEL(((n + threads - 1) // threads,), (threads,),
                 (logits, mask, np.int32(V), np.int32(mask.shape[1]), np.int64(n)))


def apply_mask(logits, bitmask):
    """Set the logits of disallowed tokens to -inf, in place.  logits: [B, V] (or [V]) float32, numpy or
    cupy; bitmask: [B, ceil(V/32)] (or [W]) uint32, bit t of word t // 32 set where token t is allowed;
    ids past the mask's words are disallowed.  A row without a constraint should carry an all-ones mask.
    Returns logits."""
    lg = logits if logits.ndim == 2 else logits.reshape(1, -1)
    bm = bitmask if bitmask.ndim == 2 else bitmask.reshape(1, -1)
    if lg.shape[0] != bm.shape[0]:
        raise ValueError(f"logits have {lg.shape[0]} rows, the bitmask {bm.shape[0]}")
    if type(lg).__module__.startswith("cupy"):
        if not lg.flags.c_contiguous or lg.dtype != np.float32:
            raise ValueError("device logits must be C-contiguous float32")
        _apply_mask_cuda(lg, bm)
        return logits
    if lg.dtype != np.float32:
        raise ValueError(f"logits must be float32, got {lg.dtype}")
    if bm.dtype != np.uint32:
        bm = bm.view(np.uint32) if bm.dtype == np.int32 else bm.astype(np.uint32)
    _apply_mask_cpu(lg, bm)
    return logits


def full_mask(n_vocab: int, rows: int = 1) -> np.ndarray:
    """An all-ones bitmask (rows without a constraint)."""
    return np.full((rows, mask_words(n_vocab)), 0xFFFFFFFF, np.uint32)
