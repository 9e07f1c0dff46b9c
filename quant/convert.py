"""Hugging Face safetensors checkpoint -> GGUF file, as llama.cpp's
convert_hf_to_gguf.py + llama-quantize would write it: GGUF tensor names and
layout (llama q/k permuted, gemma norms + 1), llama.cpp's metadata and
tokenizer keys (with the chat template), and a per-tensor type policy
(quant.policy).  Llama 3.1's RoPE scaling goes in as rope_freqs.weight, as
llama.cpp's converter writes it; what llama.cpp could not read back the way the
checkpoint means it (a layer pattern it hard-codes differently) is refused.

This is a tool at the top of the stack that happens to live in quant/: it
reads checkpoints through runtime.safetensors_loader, so that a file written
here and a checkpoint quantized on load hold the very same bytes.

The file is written to a temporary name beside the output and renamed when
complete, so an interrupted run never leaves a partial OUT.gguf.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from .policy import FILE_TYPE, SCHEMES

GGUF_TOKEN_NORMAL, GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED, GGUF_TOKEN_UNUSED, GGUF_TOKEN_BYTE = 1, 3, 4, 5, 6

# tokenizer.json `Split` regexes (Hugging Face spelling) -> llama.cpp `tokenizer.ggml.pre`
_SPLIT_PRE = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    # o200k (GPT-4o, gpt-oss's o200k_harmony)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+": "gpt-4o",
}


class ConvertError(ValueError):
    pass


def bpe_pre_name(pre_tokenizer: dict | None) -> str:
    """llama.cpp's name for a byte-level BPE pre-tokenizer, read from tokenizer.json's
    structure (llama.cpp's converter hashes a tokenization instead; both name the same
    splitting rules).  Unknown layouts get llama.cpp's 'default' and a warning."""
    if not pre_tokenizer:
        return "default"
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer]) if pre_tokenizer.get("type") == "Sequence" \
        else [pre_tokenizer]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in _SPLIT_PRE:
            return _SPLIT_PRE[regex]
    print(f"warning: pre-tokenizer {kinds} not recognised; writing tokenizer.ggml.pre='default'",
          file=sys.stderr)
    return "default"


def _vocab(folder: Path, n_vocab: int, tokenizer_json: dict):
    """(model, pre, tokens, types, scores or None) for the GGUF tokenizer keys."""
    from tokenizers import Tokenizer as HFTokenizer
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = hf.get_vocab(with_added_tokens=True)
    by_id: dict[int, str] = {i: t for t, i in vocab.items()}
    added = {int(t["id"]): t for t in tokenizer_json.get("added_tokens", [])}
    model = tokenizer_json.get("model", {})
    if len(by_id) > n_vocab:
        raise ConvertError(f"tokenizer has {len(by_id)} tokens but the embedding only {n_vocab} rows")
    spm = model.get("type") == "BPE" and model.get("byte_fallback", False)
    tokens, types = [], []
    for i in range(n_vocab):
        t = by_id.get(i)
        if t is None or t == f"[PAD{i}]":   # llama.cpp's filler name, also what transformers writes
            tokens.append(f"[PAD{i}]")
            types.append(GGUF_TOKEN_UNUSED)
        elif i in added:
            tokens.append(t)
            types.append(GGUF_TOKEN_CONTROL if added[i].get("special") else GGUF_TOKEN_USER_DEFINED)
        elif spm and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            tokens.append(t)
            types.append(GGUF_TOKEN_BYTE)
        else:
            tokens.append(t)
            types.append(GGUF_TOKEN_NORMAL)
    if not spm:
        return "gpt2", bpe_pre_name(tokenizer_json.get("pre_tokenizer")), tokens, types, None
    # SentencePiece BPE saved as tokenizer.json (Gemma): llama.cpp merges the
    # adjacent pair whose result has the best score; HF merges the pair of lowest
    # merge rank.  Scoring each token by minus the rank of the merge that makes it
    # gives llama.cpp the same order.
    scores = np.full(n_vocab, -1e9, np.float32)
    for rank, m in enumerate(model.get("merges", [])):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        i = vocab.get(a + b)
        if i is not None and scores[i] == -1e9:
            scores[i] = -float(rank)
    for i in added:
        if i < n_vocab:
            scores[i] = 0.0
    return "llama", None, tokens, types, scores.tolist()


def _write_metadata(w, ck, tok, scheme: str, folder: Path) -> None:
    import json

    import gguf

    cfg = ck.config
    w.add_type("model")
    w.add_name(cfg.name or folder.name)
    w.add_file_type(FILE_TYPE[scheme])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # config.json's own (YaRN stretched cfg.context_length; the reader stretches it again)
    w.add_context_length(int(cfg.extra.get("hf_config", {}).get("max_position_embeddings") or cfg.context_length))
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    if cfg.arch == "gemma3" or cfg.head_dim != cfg.d_model // cfg.n_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.arch in ("llama", "smollm3"):
        w.add_vocab_size(cfg.vocab_size)
    if cfg.arch in ("llama", "smollm3") or cfg.rope_dim != cfg.head_dim:
        w.add_rope_dimension_count(cfg.rope_dim)
    if cfg.rope_scale != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scale)
    if cfg.rope_yarn is not None:          # as llama.cpp's converter writes it (_check_expressible: the rest default)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope_yarn.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope_yarn.original_context)
    if cfg.rope_factors_long is not None:  # LongRoPE, as llama.cpp's Phi-3 converter: the factors are tensors
        w.add_rope_scaling_orig_ctx_len(cfg.rope_original_context)
        w.add_rope_scaling_attn_factors(cfg.rope_mscale)
    if cfg.arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        if cfg.local_layers is not None and \
                tuple(cfg.local_layers) != tuple(i for i in range(cfg.n_layers) if (i + 1) % 6):
            w.add_sliding_window_pattern([cfg.is_local_layer(i) for i in range(cfg.n_layers)])
        if cfg.rope_theta_local != 10000.0:
            w.add_rope_freq_base_swa(cfg.rope_theta_local)
    elif cfg.arch == "llama" and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)    # Mistral's window over every layer
    elif cfg.arch == "phi3":
        w.add_sliding_window(cfg.sliding_window)    # as llama.cpp's converter: 0 for none
    elif cfg.arch == "gpt-oss":
        w.add_sliding_window(cfg.sliding_window)
        if tuple(cfg.local_layers or ()) != tuple(range(0, cfg.n_layers, 2)):   # not llama.cpp's default
            w.add_sliding_window_pattern([cfg.is_local_layer(i) for i in range(cfg.n_layers)])
    if cfg.n_experts:
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.n_experts_used)
        w.add_expert_feed_forward_length(cfg.d_ff_expert)

    tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model, pre, tokens, types, scores = _vocab(folder, cfg.vocab_size, tj)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
        w.add_add_space_prefix(False)
    sv = gguf.SpecialVocab(folder, load_merges=(model == "gpt2"), n_vocab=len(tokens))
    # what our tokenizer (and the HF one) does, rather than what a key may be missing
    sv.add_special_token = {"bos": bool(tok.add_bos), "eos": bool(tok.add_eos)}
    if tok.bos_id is not None:
        sv.special_token_ids["bos"] = int(tok.bos_id)
    if tok.eos_id is not None:
        sv.special_token_ids["eos"] = int(tok.eos_id)
    if sv.chat_template is None and getattr(tok, "chat_template", None):
        sv.chat_template = tok.chat_template
    sv.add_to_gguf(w, quiet=True)


def _check_expressible(cfg) -> None:
    """Refuse a checkpoint whose GGUF llama.cpp would run differently from config.json."""
    if cfg.arch == "smollm3":
        want = tuple(i for i in range(cfg.n_layers) if (i + 1) % 4 == 0)
        if tuple(cfg.nope_layers) != want:
            raise ConvertError(f"smollm3: no_rope_layers leaves out RoPE in layers {list(cfg.nope_layers)}; "
                               f"GGUF readers (llama.cpp) assume every 4th layer {list(want)}")
    if cfg.n_experts and not cfg.expert_norm_topk:
        raise ConvertError(f"{cfg.arch}: norm_topk_prob is false; GGUF readers (llama.cpp's {cfg.arch}) always "
                           f"renormalize the chosen experts' weights")
    y = cfg.rope_yarn
    if y is not None:
        from models.config import YARN_UNTRUNCATED_ARCHS, yarn_mscale
        if y.truncate != (cfg.arch not in YARN_UNTRUNCATED_ARCHS):
            raise ConvertError(f"{cfg.arch}: YaRN with truncate {str(y.truncate).lower()}; a GGUF file has no key for "
                               f"it and its readers assume {str(not y.truncate).lower()} for {cfg.arch}")
        if (y.beta_fast, y.beta_slow) != (32.0, 1.0) or not math.isclose(cfg.rope_mscale, yarn_mscale(y.factor)):
            raise ConvertError(f"{cfg.arch}: YaRN with beta_fast {y.beta_fast:g}, beta_slow {y.beta_slow:g}, "
                               f"attention factor {cfg.rope_mscale:g}; GGUF readers (llama.cpp's {cfg.arch}) take "
                               f"32, 1 and {yarn_mscale(y.factor):g} whatever the file says")
    if cfg.arch not in ("gemma3", "gpt-oss") and cfg.local_layers is not None and cfg.sliding_window:
        raise ConvertError(f"{cfg.arch}: sliding-window layers {list(cfg.local_layers)} cannot be written to a "
                           f"GGUF file that llama.cpp reads the same way")


def _order(names: list[str]) -> list[str]:
    """llama.cpp's order: embeddings, layers in order, final norm, output."""
    def key(n):
        if n.startswith("blk."):
            return (1, int(n.split(".")[1]), n)
        return (0 if n.startswith("token_embd") else 2 if n == "output_norm.weight" else 3, 0, n)
    return sorted(names, key=key)


def convert(src, out, scheme: str = "f16", progress: bool | None = None) -> dict:
    """Write checkpoint folder `src` as GGUF file `out` in `scheme`; returns stats
    (bytes written, seconds, MB/s of output, tensor types)."""
    import gguf
    from tqdm import tqdm

    from quant import GGMLType, tensor_nbytes
    from runtime.safetensors_loader import Checkpoint
    from runtime.tokenizer import Tokenizer

    if scheme not in SCHEMES:
        raise ConvertError(f"--type must be one of {', '.join(SCHEMES)}, not '{scheme}'")
    t0 = time.perf_counter()
    folder, out = Path(src), Path(out)
    if not folder.is_dir():
        raise ConvertError(f"{folder}: not a checkpoint folder")
    ck = Checkpoint(folder)
    tok = Tokenizer.from_hf_files(folder)
    from quant.policy import tensor_type
    cfg = ck.config
    _check_expressible(cfg)
    names = _order(ck.names)
    plan = {}
    for n in names:
        s, h = ck.sources[n]
        shape = s.shape(h)
        plan[n] = (shape, tensor_type(scheme, n, shape, cfg.n_layers, cfg.tied_output))

    extra = {}   # tensors made from config.json, not read from the checkpoint
    if cfg.rope_freq_factors is not None:
        extra["rope_freqs.weight"] = np.asarray(cfg.rope_freq_factors, np.float32)
    if cfg.rope_factors_long is not None:
        extra["rope_factors_long.weight"] = np.asarray(cfg.rope_factors_long, np.float32)
        extra["rope_factors_short.weight"] = np.asarray(cfg.rope_factors_short, np.float32)
    for n in sorted(extra):
        plan[n] = (extra[n].shape, GGMLType.F32)
    names = sorted(extra) + names

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.part-{os.getpid()}")
    total = 0
    w = None
    try:
        w = gguf.GGUFWriter(tmp, cfg.arch)
        _write_metadata(w, ck, tok, scheme, folder)
        for n in names:
            shape, qt = plan[n]
            nb = tensor_nbytes(qt, shape, n)
            byte_shape = tuple(shape[:-1]) + (nb // max(1, int(np.prod(shape[:-1]))),)
            w.add_tensor_info(n, byte_shape, np.dtype(np.uint8), nb, raw_dtype=gguf.GGMLQuantizationType(int(qt)))
            total += nb
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name} ({scheme})",
                  disable=(progress is False) or (progress is None and not sys.stderr.isatty()),
                  file=sys.stderr) as bar:
            for n in names:
                shape, qt = plan[n]
                data = extra[n].view(np.uint8) if n in extra else ck.tensor(n, qt).data
                w.write_tensor_data(np.ascontiguousarray(data).reshape(-1))
                bar.update(data.size)
        w.close()
        os.replace(tmp, out)
    except BaseException:
        if w is not None:
            try:
                w.close()
            except Exception:
                pass
        tmp.unlink(missing_ok=True)
        raise
    dt = time.perf_counter() - t0
    types: dict[str, int] = {}
    for _, qt in plan.values():
        types[qt.name] = types.get(qt.name, 0) + 1
    return {"path": str(out), "bytes": out.stat().st_size, "tensor_bytes": total, "seconds": dt,
            "mb_per_s": out.stat().st_size / 1e6 / dt, "tensor_types": types}
