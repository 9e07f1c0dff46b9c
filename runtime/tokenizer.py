"""Text <-> token ids, exactly as llama.cpp does it for a GGUF file.

A GGUF file carries its tokenizer as metadata: the vocabulary, the merges (BPE)
or scores (SentencePiece), a type for every token and the name of the
pre-tokenizer (`tokenizer.ggml.pre`).  We rebuild from that a Rust
`tokenizers.Tokenizer` that reproduces llama.cpp's `llama_tokenize`:

* `gpt2` (byte-level BPE): the text is split by the regexes that llama.cpp
  uses for `tokenizer.ggml.pre` (applied one after another; each match and each
  gap becomes a piece), every piece is byte-mapped, then merged by rank.
* `llama` (SentencePiece BPE, e.g. Gemma): spaces become U+2581 (and a space is
  put in front of every text fragment when `add_space_prefix` says so); then
  llama.cpp merges the adjacent pair whose concatenation is the token with the
  best score, leftmost first, and falls back to `<0xNN>` byte tokens.  That is
  a BPE whose merges are every split of every token into two tokens, ranked by
  the score of the result -- we derive those merges once (and cache them).
* Special tokens: tokens typed CONTROL / USER_DEFINED / UNKNOWN are matched in
  the raw text before anything else.  With `parse_special=False` CONTROL and
  UNKNOWN tokens are left as plain text but USER_DEFINED ones are still
  matched, as in llama.cpp.

Decoding is ours (per-token bytes, joined, decoded as UTF-8), so that a
streaming decoder can emit exactly what `decode` would, one complete character
at a time.  (llama.cpp's `clean_spaces` post-pass of llama_detokenize is not
applied: it cannot be streamed, and none of our models use it.)

Built tokenizers are cached per process (by a digest of the vocabulary), and
the merges derived for a SentencePiece vocabulary are cached on disk under the
user cache folder (`LLAMBA_CACHE_DIR` overrides it; `off` disables it).

Checked against llama.cpp token for token (tests/runtime/test_tokenizer.py).
Known limit: the split regexes run on Oniguruma's Unicode tables, which are
newer than llama.cpp's, so a character assigned in a recent Unicode version
(e.g. U+135DE, Egyptian Hieroglyphs Ext-A, Unicode 16) may be classed as a
letter here and as "other" there.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.models import BPE

__all__ = ["Tokenizer", "StreamDecoder", "TokenizerError"]


class TokenizerError(ValueError):
    """The metadata describes a tokenizer we cannot build; the message says why."""


# GGUF token types (tokenizer.ggml.token_type)
TYPE_UNDEFINED, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = range(7)

# llama.cpp token attributes (bit flags), derived from the types and a few name rules
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_ATTR_OF_TYPE = {
    TYPE_UNDEFINED: 0, TYPE_NORMAL: ATTR_NORMAL, TYPE_UNKNOWN: ATTR_UNKNOWN, TYPE_CONTROL: ATTR_CONTROL,
    TYPE_USER_DEFINED: ATTR_USER_DEFINED, TYPE_UNUSED: ATTR_UNUSED, TYPE_BYTE: ATTR_BYTE,
}
_SPECIAL = ATTR_CONTROL | ATTR_UNKNOWN          # hidden by decode(special=False); skipped by parse_special=False
_MATCHED = _SPECIAL | ATTR_USER_DEFINED         # matched whole in the raw text before tokenizing

# ---------------------------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, by `tokenizer.ggml.pre` (from llama.cpp's llm_tokenizer_bpe, in Oniguruma syntax).
# Each list is applied in order: every match and every gap between matches becomes a piece.

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
               r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k's (GPT-4o, gpt-oss) as its tokenizer.json and tiktoken write it: the contractions
# case-insensitive, which also takes Unicode case folds ("'ſ" is "'s").  llama.cpp spells them
# '[sS]... and so splits "it'ſ" as "it" + "'ſ" where tiktoken keeps "it'ſ" (nothing else differs:
# tests/runtime/test_harmony.py); the model's own tokenizer is the reference here.
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTION +
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTION +
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"

# name -> (regexes, ignore_merges, add_bos default)
_PRE = {}


def _pre(names, regexes, ignore_merges=False, add_bos=False):
    for n in names:
        _PRE[n] = (tuple(regexes), ignore_merges, add_bos)


_pre(["default"], [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])
_pre(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
     [_LLAMA3], ignore_merges=True, add_bos=True)
_pre(["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], [_LLAMA3])
_pre(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"],
     [_QWEN2])
_pre(["qwen35"], [_QWEN35])
_pre(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"],
     [r"\p{N}", _GPT2])
_pre(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "exaone4", "trillion",
      "granite-docling"], [_GPT2])
_pre(["deepseek-coder"], [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"])
_pre(["deepseek-v3"], [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                       r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                       r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"])
_pre(["falcon"], [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"])
_pre(["tekken"], [_TEKKEN], ignore_merges=True, add_bos=True)
_pre(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], [_GPT4O])
_pre(["poro-chat", "bloom", "gpt3-finnish"], [_PORO])
_pre(["viking"], [_PORO, r"\p{N}"])
_pre(["seed-coder"], [_SEED_CODER])
_pre(["bailingmoe", "bailingmoe2", "llada-moe"], [_BAILINGMOE])
_pre(["chameleon"], [r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                     r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2], add_bos=True)

SUPPORTED_PRE = tuple(sorted(_PRE))

# ---------------------------------------------------------------------------------------------------------------
# Special-token rules that llama.cpp applies by token text (llama_vocab::impl::load).

_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_FIM_OTHER_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                    "<|code_prefix|>", "<|prefix|>",
                    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                    "<|code_suffix|>", "<|suffix|>",
                    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                    "<|code_middle|>", "<|middle|>")
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_RENDER_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")   # gpt-oss


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE tokens are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_ENCODER = _bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}

# ---------------------------------------------------------------------------------------------------------------
# Per-process cache of built tokenizers (keyed by a digest of the vocabulary), and an on-disk cache of the
# merges derived for SentencePiece vocabularies (the slow part: ~1 s for Gemma's 262k tokens).

_CACHE: "OrderedDict[str, Tokenizer]" = OrderedDict()
_IDENT: dict = {}      # (ids of the metadata arrays, small keys) -> (the arrays, digest): a fast re-lookup
_BIG_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
             "tokenizer.ggml.merges")
_CACHE_MAX = 4
_CACHE_LOCK = threading.Lock()
_SPM_MERGES_VERSION = 1


def _cache_dir() -> Path | None:
    """Where derived data may be cached; None disables the disk cache (LLAMBA_CACHE_DIR='' or 'off')."""
    env = os.environ.get("LLAMBA_CACHE_DIR")
    if env is not None:
        return None if env.strip() in ("", "0", "off", "none") else Path(env)
    try:
        import platformdirs
        return Path(platformdirs.user_cache_dir("llamba"))
    except Exception:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "llamba"


def clear_cache() -> None:
    """Forget the tokenizers built in this process (tests use this to measure construction)."""
    with _CACHE_LOCK:
        _CACHE.clear()
        _IDENT.clear()


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, np.ndarray):
            b = np.ascontiguousarray(p).tobytes()
        elif isinstance(p, (list, tuple)):
            b = "\x00".join(p).encode("utf-8", "surrogatepass")
        else:
            b = repr(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------


class Tokenizer:
    """Encode/decode for one model.  Build with `from_gguf(metadata)` or `from_hf_files(folder)`.

    Attributes: vocab_size, bos_id, eos_id, add_bos, add_eos, stop_ids (llama.cpp's end-of-generation set),
    bos_token / eos_token (their text, for chat templates), chat_template (str | None), model ('gpt2', 'llama',
    'hf'), pre (the pre-tokenizer name).
    """

    def __init__(self, *, backend: _RustTokenizer, tokens: list[str], attrs: np.ndarray, byte_level: bool,
                 bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool, stop_ids,
                 add_space_prefix: bool = False, chat_template: str | None = None, model: str = "",
                 pre: str = "", name: str = ""):
        self._backend = backend
        self._tokens = tokens
        self._attrs = attrs
        self._byte_level = byte_level
        self._lock = threading.Lock()
        self._piece_cache: dict[int, bytes] = {}
        self._piece_cache_nospecial: dict[int, bytes] = {}
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.add_space_prefix = bool(add_space_prefix)
        self.chat_template = chat_template
        self.model = model
        self.pre = pre
        self.name = name

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})")

    # -- construction ---------------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: dict) -> "Tokenizer":
        """The tokenizer a GGUF file's metadata describes (cached per process by vocabulary digest)."""
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(model, str) or not isinstance(tokens, list) or not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
        raw_types = metadata.get("tokenizer.ggml.token_type")
        scores = metadata.get("tokenizer.ggml.scores")
        merges = metadata.get("tokenizer.ggml.merges")
        types = np.full(len(tokens), TYPE_NORMAL, np.int32) if raw_types is None else \
            np.asarray(raw_types, np.int32)
        if len(types) < len(tokens):
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        relevant = repr(sorted((k, repr(v)) for k, v in metadata.items()
                               if k.startswith("tokenizer.ggml.") and k not in _BIG_KEYS)) + \
            repr((metadata.get("general.name", ""), metadata.get("general.architecture", "")))
        # the same arrays again (the same metadata dict): skip hashing the vocabulary
        ident = (id(tokens), id(raw_types), id(scores), id(merges), relevant)
        with _CACHE_LOCK:
            seen = _IDENT.get(ident)
        if seen is not None and seen[0] is tokens and seen[1] is raw_types and seen[2] is scores \
                and seen[3] is merges:
            key = seen[4]
        else:
            key = _digest(tokens, types, np.asarray(scores if scores is not None else [], np.float32),
                          list(merges or []), relevant)
            with _CACHE_LOCK:
                _IDENT[ident] = (tokens, raw_types, scores, merges, key)
                while len(_IDENT) > _CACHE_MAX:
                    _IDENT.pop(next(iter(_IDENT)))
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
            if hit is not None:
                _CACHE.move_to_end(key)
                if hit.chat_template != metadata.get("tokenizer.chat_template"):
                    hit = hit._with_template(metadata.get("tokenizer.chat_template"))
                return hit
        tok = cls._build_gguf(metadata, model, tokens, types, scores, merges, key)
        with _CACHE_LOCK:
            _CACHE[key] = tok
            while len(_CACHE) > _CACHE_MAX:
                _CACHE.popitem(last=False)
        return tok

    def _with_template(self, template):
        clone = object.__new__(Tokenizer)
        clone.__dict__.update(self.__dict__)
        clone.chat_template = template
        return clone

    @classmethod
    def _build_gguf(cls, md, model, tokens, types, scores, merges, key) -> "Tokenizer":
        n = len(tokens)
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]   # as llama.cpp does
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:     # llama.cpp refuses duplicate tokens; keep the first rather than fail
            vocab = {}
            for i, t in enumerate(tokens):
                vocab.setdefault(t, i)
        attrs = _types_to_attrs(types[:n])

        if model == "gpt2":
            pre = md.get("tokenizer.ggml.pre") or "default"
            if pre not in _PRE:
                raise TokenizerError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                                     f"supported: {', '.join(SUPPORTED_PRE)}")
            regexes, ignore_merges, default_add_bos = _PRE[pre]
            if merges is None:
                raise TokenizerError("gpt2 tokenizer without tokenizer.ggml.merges")
            pairs = [(m[:p], m[p + 1:]) if p > 0 else ("", m) for m in merges for p in (m.find(" ", 1),)]
            # A byte the vocabulary lacks (SmolLM2 has no 0xF1, for one) stays a symbol in llama.cpp: it
            # blocks merges across it and is dropped from the output.  The Rust BPE would drop it first and
            # merge its neighbours, so it gets a placeholder id past the vocabulary, filtered out in encode().
            missing = [c for c in _BYTE_ENCODER.values() if c not in vocab]
            if missing:
                vocab = dict(vocab)
                for k, c in enumerate(missing):
                    vocab[c] = n + k
            bpe = None
            if len(set(merges)) == len(merges):
                try:
                    bpe = BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
                except Exception:       # a merge names a token the vocabulary lacks
                    bpe = None
            if bpe is None:
                bpe = BPE(vocab=vocab, merges=_usable_merges(pairs, vocab), ignore_merges=ignore_merges)
            backend = _RustTokenizer(bpe)
            splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            byte_level = True
            add_space_prefix = False
            defaults = dict(bos=11, eos=11, unk=None, add_bos=default_add_bos, add_eos=False)
        elif model == "llama":
            pre = md.get("tokenizer.ggml.pre") or "default"
            if scores is None:
                scores = np.zeros(n, np.float32)
            pairs = _spm_merges(tokens, vocab, np.asarray(scores, np.float32), key)
            bpe = BPE(vocab=vocab, merges=pairs, byte_fallback=True)
            backend = _RustTokenizer(bpe)
            add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
            if add_space_prefix:
                backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
            else:
                backend.normalizer = normalizers.Replace(" ", "▁")
            byte_level = False
            defaults = dict(bos=1, eos=2, unk=0, add_bos=True, add_eos=False)
        else:
            raise TokenizerError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                                 "supported: 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)")

        def special_id(name, default):
            v = md.get(f"tokenizer.ggml.{name}_token_id")
            if v is not None and 0 <= int(v) < n:
                return int(v)
            return default if default is not None and 0 <= default < n else None

        bos_id = special_id("bos", defaults["bos"])
        eos_id = special_id("eos", defaults["eos"])
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", defaults["add_bos"]))
        add_eos = bool(md.get("tokenizer.ggml.add_eos_token", defaults["add_eos"]))
        if add_bos and bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true but there is no BOS token")

        stop_ids = _llama_cpp_special_fixups(md, tokens, vocab, attrs, eos_id, special_id)
        _add_matched_tokens(backend, tokens, attrs)
        return cls(backend=backend, tokens=tokens, attrs=attrs, byte_level=byte_level, bos_id=bos_id,
                   eos_id=eos_id, add_bos=add_bos, add_eos=add_eos, stop_ids=stop_ids,
                   add_space_prefix=add_space_prefix, chat_template=md.get("tokenizer.chat_template"),
                   model=model, pre=pre, name=str(md.get("general.name", "")))

    @classmethod
    def from_hf_files(cls, folder) -> "Tokenizer":
        """Best effort: a `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`) folder."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {folder}")
        backend = _RustTokenizer.from_file(str(path))
        spec = json.loads(path.read_text(encoding="utf-8"))
        config = _read_json(folder / "tokenizer_config.json")
        gen_config = _read_json(folder / "generation_config.json")
        try:    # what the file's post-processor adds, in case the config does not say
            probe = backend.encode("a", add_special_tokens=True).ids
        except Exception:
            probe = []
        backend.post_processor = None        # BOS/EOS are ours to add
        backend.no_truncation()
        backend.no_padding()

        n = backend.get_vocab_size(with_added_tokens=True)
        tokens = [backend.id_to_token(i) or f"[EMPTY_{i}]" for i in range(n)]
        attrs = np.full(n, ATTR_NORMAL, np.int32)
        for t in spec.get("added_tokens", []):
            i = int(t["id"])
            if 0 <= i < n:
                attrs[i] = ATTR_CONTROL if t.get("special") else ATTR_USER_DEFINED
        byte_level = _mentions_type(spec.get("decoder"), "ByteLevel") or \
            _mentions_type(spec.get("pre_tokenizer"), "ByteLevel")
        if not byte_level:
            for i, t in enumerate(tokens):
                if len(t) == 6 and t.startswith("<0x") and t.endswith(">") and attrs[i] == ATTR_NORMAL:
                    try:
                        int(t[3:5], 16)
                        attrs[i] = ATTR_BYTE
                    except ValueError:
                        pass

        vocab = backend.get_vocab(with_added_tokens=True)

        def tok_id(value):
            if isinstance(value, dict):
                value = value.get("content")
            return vocab.get(value) if isinstance(value, str) else None

        bos_id = tok_id(config.get("bos_token"))
        eos_id = tok_id(config.get("eos_token"))
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
        add_eos = bool(config.get("add_eos_token", False))
        stops = set()
        if eos_id is not None:
            stops.add(eos_id)
        ge = gen_config.get("eos_token_id")
        for v in (ge if isinstance(ge, list) else [ge]):
            if isinstance(v, int) and 0 <= v < n:
                stops.add(v)
        for text in _EOG_TEXTS:
            i = vocab.get(text)
            if i is not None and attrs[i] & ATTR_CONTROL:
                stops.add(i)
        _message_end_is_not_eog(stops, tokens, attrs)     # (as from a GGUF file: gpt-oss's <|end|>)
        for text in _ALWAYS_RENDER_TEXTS:
            i = vocab.get(text)
            if i is not None:
                attrs[i] = ATTR_USER_DEFINED
        template = config.get("chat_template")
        if isinstance(template, list):   # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        # a SentencePiece-style file whose decoder drops the space its normalizer/pre-tokenizer put in front
        decoder = spec.get("decoder")
        strips_prefix = _mentions_type(decoder, "Strip") or any(
            d.get("type") == "Metaspace" and (d.get("prepend_scheme") in ("first", "always") or
                                              d.get("add_prefix_space") is True)
            for d in _walk_dicts(decoder))
        return cls(backend=backend, tokens=tokens, attrs=attrs, byte_level=byte_level, bos_id=bos_id,
                   eos_id=eos_id, add_bos=add_bos, add_eos=add_eos, stop_ids=stops,
                   add_space_prefix=bool(strips_prefix and not byte_level),
                   chat_template=template, model="hf", pre="", name=folder.name)

    # -- encode ----------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize(text, add_special, parse_special).

        add_bos: None = as the model says (`self.add_bos`, plus EOS when the model asks for add_eos);
        True/False forces the BOS.  parse_special: CONTROL tokens written in the text (`<|im_start|>`)
        become their ids; False tokenizes them as plain text.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        with self._lock:
            self._backend.encode_special_tokens = not parse_special
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if ids and max(ids) >= self.vocab_size:       # placeholders for bytes the vocabulary lacks
            n = self.vocab_size
            ids = [i for i in ids if i < n]
        want_bos = self.add_bos if add_bos is None else bool(add_bos)
        if want_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (add_bos is None or add_bos) and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts, add_bos: bool | None = None, parse_special: bool = True) -> list[list[int]]:
        return [self.encode(t, add_bos=add_bos, parse_special=parse_special) for t in texts]

    # -- decode ----------------------------------------------------------------------------------------------------

    def token_bytes(self, id, special: bool = True) -> bytes:
        """The raw bytes of one token (llama.cpp's token_to_piece).

        Byte-level BPE tokens are unmapped to their bytes, SentencePiece ▁ becomes a space, <0xNN> tokens
        are that byte.  CONTROL tokens give their text, or nothing with special=False.
        """
        id = int(id)
        cache = self._piece_cache if special else self._piece_cache_nospecial
        b = cache.get(id)
        if b is None:
            if not 0 <= id < self.vocab_size:
                raise IndexError(f"token id {id} out of range (vocab size {self.vocab_size})")
            b = self._piece(id, special)
            cache[id] = b
        return b

    def _piece(self, id: int, special: bool) -> bytes:
        attr = int(self._attrs[id])
        text = self._tokens[id]
        if attr & _SPECIAL:
            return text.encode("utf-8") if special else b""
        if attr & ATTR_USER_DEFINED:
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self._byte_level:
                dec = _BYTE_DECODER
                return b"".join(bytes([dec[c]]) if c in dec else c.encode("utf-8") for c in text)
            return text.replace("▁", " ").encode("utf-8")
        if attr & ATTR_BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return text.encode("utf-8")
        return b""       # unused / undefined

    def decode(self, ids, special: bool = True) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD).  special=False drops CONTROL tokens' text."""
        data = b"".join(self.token_bytes(i, special) for i in ids)
        if self.add_space_prefix:
            data = self._strip_prefix_space(ids, special, data)
        return data.decode("utf-8", errors="replace")

    def _strip_prefix_space(self, ids, special, data):
        # A SentencePiece model with add_space_prefix put a space before the text: take it off the first
        # text token (one that is not CONTROL), as HF's decoders do.
        offset = 0
        for i in ids:
            if not self._attrs[int(i)] & _SPECIAL:
                if data[offset:offset + 1] == b" ":
                    return data[:offset] + data[offset + 1:]
                return data
            offset += len(self.token_bytes(i, special))
        return data

    def stream(self, special: bool = True) -> "StreamDecoder":
        """A decoder fed one id at a time that returns only complete characters."""
        return StreamDecoder(self, special)

    # -- lookups ---------------------------------------------------------------------------------------------------

    def token_text(self, id) -> str:
        """The token as the vocabulary spells it (`Ġhello`, `▁hello`, `<|im_end|>`)."""
        return self._tokens[int(id)]

    def token_to_id(self, text: str) -> int | None:
        i = self._backend.token_to_id(text)
        return i if i is not None and i < self.vocab_size else None

    def is_control(self, id) -> bool:
        return bool(self._attrs[int(id)] & _SPECIAL)

    @property
    def bos_token(self) -> str:
        return self._tokens[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._tokens[self.eos_id] if self.eos_id is not None else ""


class StreamDecoder:
    """Incremental detokenizer: `feed(id)` returns the newly completed text (never half a UTF-8 character);
    `flush()` returns what is left (an incomplete tail becomes U+FFFD).  The concatenation of everything it
    returned equals `tokenizer.decode(ids)`."""

    def __init__(self, tokenizer: Tokenizer, special: bool = True):
        self._tok = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = tokenizer.add_space_prefix

    def feed(self, id) -> str:
        b = self._tok.token_bytes(id, self._special)
        if self._strip and not self._tok.is_control(id):
            self._strip = False
            if b[:1] == b" ":
                b = b[1:]
        return self._utf8.decode(b)

    def flush(self) -> str:
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _types_to_attrs(types: np.ndarray) -> np.ndarray:
    table = np.zeros(8, np.int32)
    for t, a in _ATTR_OF_TYPE.items():
        table[t] = a
    t = np.asarray(types, np.int64)
    t = np.where((t >= 0) & (t < 7), t, 0)
    return table[t].astype(np.int32)


def _usable_merges(pairs, vocab):
    """Drop merges the Rust BPE would reject (a part or the result missing from the vocabulary) and repeats
    (llama.cpp keeps the first rank of a repeated pair)."""
    seen = set()
    out = []
    for a, b in pairs:
        if (a, b) in seen or a not in vocab or b not in vocab or (a + b) not in vocab:
            continue
        seen.add((a, b))
        out.append((a, b))
    return out


def _spm_merges(tokens, vocab, scores, key) -> list[tuple[str, str]]:
    """Every way to write a token as two tokens, best-scored result first (llama.cpp's SPM merge order)."""
    cdir = _cache_dir()
    path = cdir / "tokenizer" / f"spm-merges-v{_SPM_MERGES_VERSION}-{key[:32]}.npy" if cdir else None
    arr = None
    if path is not None and path.is_file():
        try:
            arr = np.load(path, allow_pickle=False)
            if not (arr.ndim == 2 and arr.shape[1] == 2 and arr.dtype == np.int32 and
                    (arr.size == 0 or (int(arr.max()) < len(tokens) and int(arr.min()) >= 0))):
                arr = None
        except Exception:
            arr = None
    if arr is None:
        arr = _derive_spm_merges(tokens, vocab, scores)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                with open(tmp, "wb") as fh:
                    np.save(fh, arr, allow_pickle=False)
                os.replace(tmp, path)
            except OSError:
                pass
    names = np.asarray(tokens, dtype=object)
    return list(zip(names[arr[:, 0]].tolist(), names[arr[:, 1]].tolist()))


def _derive_spm_merges(tokens, vocab, scores) -> np.ndarray:
    """(left id, right id) for every split of a token into two tokens, ordered as llama.cpp's SPM would
    prefer them: higher score of the merged token first; ties by token id, then split position."""
    found = [(i, vocab[tok[:k]], vocab[tok[k:]])
             for i, tok in enumerate(tokens) if len(tok) > 1 and vocab.get(tok) == i
             for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
    if not found:
        return np.zeros((0, 2), np.int32)
    arr = np.array(found, np.int32)
    order = np.argsort(-scores[arr[:, 0]], kind="stable")
    return np.ascontiguousarray(arr[order, 1:])


def _llama_cpp_special_fixups(md, tokens, vocab, attrs, eos_id, special_id) -> set[int]:
    """Apply llama.cpp's by-name token rules to `attrs` (in place) and return its end-of-generation set."""
    def force_control(i):
        attrs[i] |= ATTR_CONTROL

    def find(texts):
        for t in texts:
            i = vocab.get(t)
            if i is not None:
                return i
        return None

    eot_id = special_id("eot", None)
    if eot_id is None:
        eot_id = find(_EOT_TEXTS)
        if eot_id is not None:
            force_control(eot_id)
    eom_id = special_id("eom", None)
    if eom_id is None:
        eom_id = find(_EOM_TEXTS)
        if eom_id is not None:
            force_control(eom_id)
    fim = {}
    for name, texts in (("fim_pad", _FIM_PAD_TEXTS), ("fim_rep", _FIM_REP_TEXTS), ("fim_sep", _FIM_SEP_TEXTS)):
        i = special_id(name, None)
        if i is None:
            i = find(texts)
            if i is not None:
                force_control(i)
        fim[name] = i
    for t in _FIM_OTHER_TEXTS:
        i = vocab.get(t)
        if i is not None:
            force_control(i)

    eog = {i for i in fim.values() if i is not None}
    for t in _EOG_TEXTS:
        i = vocab.get(t)
        if i is not None:
            eog.add(i)
            force_control(i)
    for t in _ALWAYS_RENDER_TEXTS:
        i = vocab.get(t)
        if i is not None:
            attrs[i] = ATTR_USER_DEFINED
    for i in (eos_id, eot_id, eom_id):
        if i is not None:
            eog.add(i)
    _message_end_is_not_eog(eog, tokens, attrs)
    texts = {tokens[i]: i for i in eog}
    if "<|tool_response>" in texts and "</s>" in texts:
        i = texts["</s>"]
        eog.discard(i)
        attrs[i] = ATTR_NORMAL

    # per-model strip attributes (llama.cpp: "set attributes by model/tokenizer/architecture name")
    name = str(md.get("general.name", "")).lower()
    pre = str(md.get("tokenizer.ggml.pre", ""))
    arch = str(md.get("general.architecture", ""))
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
            any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in vocab:
            attrs[vocab["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        attrs[(attrs & _MATCHED) != 0] |= ATTR_RSTRIP
        if "</s>" in vocab:
            attrs[vocab["</s>"]] |= ATTR_RSTRIP
        for t in ("<unk>", "<s>", "<|endoftext|>"):
            if t in vocab:
                attrs[vocab[t]] &= ~ATTR_RSTRIP
    return eog


def _message_end_is_not_eog(eog: set, tokens, attrs) -> None:
    """llama.cpp's rule: where <|return|> and <|call|> end a turn (gpt-oss's harmony; or
    <|calls|> and <|flush|>), <|end|> only ends a message within it (the reasoning, before
    the answer): not an end of generation, and rendered as text (in `eog`, `attrs`, in place)."""
    texts = {tokens[i]: i for i in eog}
    if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts) or
                               ("<|calls|>" in texts and "<|flush|>" in texts)):
        i = texts["<|end|>"]
        eog.discard(i)
        attrs[i] = ATTR_USER_DEFINED


def _add_matched_tokens(backend: _RustTokenizer, tokens, attrs) -> None:
    """Register CONTROL/UNKNOWN (special) and USER_DEFINED tokens so they are matched whole in the raw text."""
    idx = np.nonzero(attrs & _MATCHED)[0]
    special, plain = [], []
    for i in idx.tolist():
        a = int(attrs[i])
        t = AddedToken(tokens[i], special=bool(a & _SPECIAL), normalized=False,
                       lstrip=bool(a & ATTR_LSTRIP), rstrip=bool(a & ATTR_RSTRIP))
        (special if a & _SPECIAL else plain).append(t)
    if plain:
        backend.add_tokens(plain)
    if special:
        backend.add_special_tokens(special)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _mentions_type(node, name: str) -> bool:
    if isinstance(node, dict):
        if node.get("type") == name:
            return True
        return any(_mentions_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_mentions_type(v, name) for v in node)
    return False


def _walk_dicts(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk_dicts(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk_dicts(v)
