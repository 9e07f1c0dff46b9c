"""Tiny random-weight checkpoints of real architectures, made by HF transformers
(their configs are the real families' shapes, only small), and llama.cpp's own
converter to turn them into GGUF files.

A checkpoint is a float16 safetensors folder with SmolLM2's tokenizer (taken once
from the catalog GGUF): 4 layers, d_model 64, vocab 49152.  Weights are drawn so
that activations stay O(1) and logits have clear margins (HF's own init, std
0.02, would make every logit nearly equal and top-1 agreement a coin toss).

llama.cpp's converter comes from the llama-cpp-python source distribution on
PyPI (its vendor/llama.cpp), fetched once into the test cache; `llama_cpp_converter()`
returns None when it cannot be had (no network), and the tests that need it skip.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("LLAMBA_TEST_CACHE", Path.home() / ".cache" / "llamba-test"))
LLAMA_CPP_PYTHON = "0.3.36"      # the sdist whose vendor/llama.cpp converts the tiny checkpoints
N_PROMPT = 96

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, vocab_size=49152,
               bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=True)

# family -> (transformers config class, its arguments beyond _COMMON, our arch)
FAMILIES = {
    # Llama 3.2 shape: tied output, llama3 RoPE scaling (original context 64 so that the
    # scaling bends frequencies that a 96-token prompt turns through)
    "llama3": ("LlamaConfig", dict(rope_theta=10000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), "llama"),
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_theta=1000000.0), "qwen3"),
    "mistral": ("MistralConfig", dict(sliding_window=16, tie_word_embeddings=False, rope_theta=1000000.0),
                "llama"),
    "smollm3": ("SmolLM3Config", dict(rope_theta=5000000.0), "smollm3"),
    # Gemma 3 (already supported; here to check the HF layer_types / rope_parameters paths): five
    # sliding-window layers then a global one, linear RoPE scaling on the global layers (4B+)
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=16, sliding_window=16,
                                        query_pre_attn_scalar=16, rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
               "gemma3"),
    # Phi-4-mini shape: fused qkv and gate_up, RoPE on 3/4 of each head... here on half
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, sliding_window=16, tie_word_embeddings=False,
                                rope_theta=10000.0), "phi3"),
    # YaRN (Qwen3's 128k recipe, gpt-oss's defaults) with an original context of 32, so that a
    # 96-token prompt runs past it; factor * original = max_position_embeddings, as transformers wants
    "qwen3-yarn": ("Qwen3Config", dict(head_dim=32, max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}), "qwen3"),
    "llama-yarn": ("LlamaConfig", dict(max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}),
                   "llama"),
    # Phi-3-mini-128k / Phi-4-mini shape: LongRoPE on part of each head (Phi-4-mini: 3/4), the
    # original context (top-level in Phi-3's config.json) 64; factor 4096 / 64 makes the
    # magnitude sqrt(2).  The engine's context picks the factors (tests/checkpoints/test_rope_scaling.py)
    "phi3-longrope": ("Phi3Config", dict(partial_rotary_factor=0.5, tie_word_embeddings=False,
                                         original_max_position_embeddings=64, rope_parameters={
                                             "rope_type": "longrope", "rope_theta": 10000.0,
                                             "short_factor": [1.0, 1.25, 1.6, 2.5],
                                             "long_factor": [2.0, 6.0, 18.0, 54.0]}), "phi3"),
    # Qwen3-30B-A3B shape, small: 8 experts of 32, 2 a token (renormalized), every layer MoE
    "qwen3moe": ("Qwen3MoeConfig", dict(num_hidden_layers=2, head_dim=32, rope_theta=1000000.0, num_experts=8,
                                        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
                 "qwen3moe"),
    # gpt-oss-20b shape, small: 8 experts of 32, 2 a token, biases everywhere, attention sinks, a
    # sliding window of 8 (a 96-token prompt crosses it) in every other layer, head dim 64; its
    # YaRN (factor 32, betas 32 and 1, ramp ends not rounded) over an original context of 128,
    # so that the ramp ends mid-dim (8.09: rounding would move it)
    "gptoss": ("GptOssConfig", dict(head_dim=64, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                    sliding_window=8, tie_word_embeddings=False, rope_parameters={
                                        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 128,
                                        "rope_theta": 150000.0}),
               "gpt-oss"),
}

# checkpoints make_tiny also makes that the family tests do not run (llama.cpp's Qwen2
# converter does not know SmolLM2's pre-tokenizer)
OTHER_CHECKPOINTS = {
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0), "qwen2"),
}


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer as an HF folder (tokenizer.json, tokenizer_config.json), made once."""
    out = CACHE / "tokenizer-smollm2"
    if (out / ".complete").exists():
        return out
    from transformers import AutoTokenizer

    from runtime.loader import resolve_model_path
    gguf_path = resolve_model_path("smollm2-135m")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
    (tmp / ".complete").write_text("smollm2-135m\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def make_tiny(family: str, folder: Path, seed: int = 0, dtype: str = "float16", **overrides) -> Path:
    """Write a tiny random `family` checkpoint into `folder` (float16 safetensors, or
    `dtype`: bfloat16)."""
    import torch
    import transformers

    cls_name, args, _ = FAMILIES.get(family) or OTHER_CHECKPOINTS[family]
    config = getattr(transformers, cls_name)(**{**_COMMON, **args, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("self_attn.sinks"):      # gpt-oss: from well below the scores to above
                p.uniform_(-2.0, 3.0)
            elif family == "gptoss" and name.endswith("experts.gate_up_proj"):   # its clamp (7) acts
                p.normal_(0.0, 3.0 / math.sqrt(p.shape[1]))
            elif p.ndim >= 2:       # (3-D: a layer's experts, [n_experts, out, in])
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            elif name.endswith("norm.weight"):
                p.uniform_(0.7, 1.3)
            else:
                p.normal_(0.0, 0.1)
    folder = Path(folder)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    for p in tokenizer_dir().iterdir():
        if not p.name.startswith("."):
            shutil.copy(p, folder / p.name)
    if cls_name == "Phi3Config":      # llama.cpp's Phi-3 converter reads a BPE vocabulary only under this name (Phi-4's)
        tc = json.loads((folder / "tokenizer_config.json").read_text())
        tc["tokenizer_class"] = "GPT2Tokenizer"
        (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    return folder


def prompt_ids(seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(100, 49000, N_PROMPT).tolist()


def transformers_logits(folder, ids) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].numpy()


def llama_cpp_converter() -> Path | None:
    """Path of llama.cpp's convert_hf_to_gguf.py (with its conversion/ and gguf-py/),
    fetched once from the llama-cpp-python sdist; None if it cannot be fetched."""
    root = _llama_cpp_files(f"llama.cpp-{LLAMA_CPP_PYTHON}", lambda rel: rel == "convert_hf_to_gguf.py" or
                            rel.startswith(("conversion/", "gguf-py/")))
    return root / "convert_hf_to_gguf.py" if root is not None else None


def llama_cpp_template(name: str) -> Path | None:
    """A chat template of llama.cpp's test set (models/templates/NAME: the models' own
    templates, e.g. openai-gpt-oss-120b.jinja), fetched once from the llama-cpp-python
    sdist; None if it cannot be fetched."""
    root = _llama_cpp_files(f"llama.cpp-{LLAMA_CPP_PYTHON}-templates", lambda rel: rel.startswith("models/templates/"))
    p = root / "models" / "templates" / name if root is not None else None
    return p if p is not None and p.is_file() else None


def _llama_cpp_files(folder: str, wanted) -> Path | None:
    """CACHE/folder holding the files of the sdist's vendor/llama.cpp whose relative path
    `wanted` accepts, extracted once; None if the sdist cannot be fetched."""
    root = CACHE / folder
    if (root / ".complete").exists():
        return root
    dl = CACHE / f"sdist-{os.getpid()}"
    shutil.rmtree(dl, ignore_errors=True)
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                            "--no-deps", "--no-binary", "llama-cpp-python", "-d", str(dl)],
                           capture_output=True, text=True, timeout=600)
        tars = list(dl.glob("*.tar.gz"))
        if r.returncode != 0 or not tars:
            return None
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(tars[0]) as tf:
            for m in tf.getmembers():
                rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                if rel and m.isfile() and wanted(rel):
                    dst = tmp / rel
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(tf.extractfile(m).read())
        if not tmp.exists():
            return None
        (tmp / ".complete").write_text(tars[0].name + "\n")
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
        return root
    except (OSError, subprocess.SubprocessError, tarfile.TarError):
        return None
    finally:
        shutil.rmtree(dl, ignore_errors=True)


def llama_cpp_convert(script: Path, folder: Path, out: Path, outtype: str = "f16") -> Path:
    """Run llama.cpp's converter (with the gguf-py it ships) on `folder`."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    r = subprocess.run([sys.executable, str(script), str(folder), "--outfile", str(out), "--outtype", outtype],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {folder.name}:\n{r.stderr[-3000:]}")
    return out


# ---- gpt-oss's text side ---------------------------------------------------------------------------------------
# o200k's split, as gpt-oss's tokenizer.json (and tiktoken's o200k_base) write it
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# harmony's special tokens (o200k_harmony's names)
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>"]


def make_harmony(folder: Path, texts=()):
    """A tiny gpt-oss checkpoint with an o200k-style tokenizer (byte-level BPE of ~2000 tokens
    trained on the GPL and `texts` with o200k's split, harmony's special tokens, gpt-oss's
    tokenizer_config / generation_config) and, where llama.cpp's test set can be fetched,
    gpt-oss's chat template.  Returns (folder, the `tokenizers` Tokenizer, {special: id},
    the template's path or None)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    corpus = Path("/usr/share/common-licenses/GPL-3")
    lines = corpus.read_text().splitlines() if corpus.exists() else []
    lines += list(texts) * 3
    hf.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.add_special_tokens(HARMONY_SPECIALS)
    n = hf.get_vocab_size()
    d = make_tiny("gptoss", folder, vocab_size=n)
    for p in d.iterdir():
        if p.name.startswith("tokenizer") or p.name in ("special_tokens_map.json", "chat_template.jinja"):
            p.unlink()
    hf.save(str(d / "tokenizer.json"))
    template = llama_cpp_template("openai-gpt-oss-120b.jinja")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
              "eos_token": "<|return|>", "pad_token": "<|endoftext|>", "model_max_length": 4096}
    if template is not None:
        config["chat_template"] = template.read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    ids = {t: hf.token_to_id(t) for t in HARMONY_SPECIALS}
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|startoftext|>"], "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"],
                                                                 ids["<|call|>"]]}))
    return d, hf, ids, template
