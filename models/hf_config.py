"""Hugging Face checkpoints described in our terms: `config.json` -> ModelConfig,
HF tensor names -> GGUF tensor names, and the layout fixes that llama.cpp's
converter applies (so a checkpoint loads into the same model code as a GGUF).

Layout differences between an HF checkpoint and a GGUF file:
* llama, smollm3: q/k rows are permuted.  HF rotates the two halves of each head
  (rotate_half); GGUF/llama.cpp rotates adjacent pairs, so its converter
  reorders each head's rows [0, d/2, 1, d/2+1, ...].  Our llama model runs the
  GGUF (pair) form, so q/k are permuted on load.  qwen2, qwen3 and gemma3 run
  NeoX rope (halves) and need nothing.

config.json keys that change the math are honoured (rope scaling: linear, llama3,
YaRN, LongRoPE; sliding windows; SmolLM3's no_rope_layers) or refused with the reason;
a model is never run with a piece of its math left out.
* gemma3: HF computes RMSNorm as x * (1 + w) and stores w; GGUF stores 1 + w.
"""
from __future__ import annotations

import re

import numpy as np

from .config import (LONGROPE_ARCHS, MOE_ARCHS, SUPPORTED_ARCHS, YARN_ARCHS, ModelConfig, UnsupportedArchitecture,
                     YarnScaling, llama3_rope_factors, longrope_mscale, yarn_context, yarn_mscale)

# HF model_type -> GGUF architecture name
_ARCH_OF_MODEL_TYPE = {
    "llama": "llama", "mistral": "llama", "smollm": "llama",
    "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "smollm3": "smollm3", "phi3": "phi3",
    "gemma3": "gemma3", "gemma3_text": "gemma3", "gpt_oss": "gpt-oss",
}
# the activation of each family's GLU (config.json hidden_act / hidden_activation)
_ACTIVATION = {"llama": ("silu",), "qwen2": ("silu",), "qwen3": ("silu",), "qwen3moe": ("silu",), "smollm3": ("silu",),
               "phi3": ("silu",), "gemma3": ("gelu_pytorch_tanh",),
               # (gpt-oss's config says silu; its experts run the clamped SwiGLU whatever it says)
               "gpt-oss": ("silu",)}

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# the norm after attention feeds the FFN in llama/qwen2 but is a post-norm in gemma3
_LAYER_NAMES_BY_ARCH = {
    "llama": {"post_attention_layernorm": "ffn_norm"},
    "qwen2": {"post_attention_layernorm": "ffn_norm"},
    "qwen3": {"post_attention_layernorm": "ffn_norm"},
    "qwen3moe": {"post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"},
    "smollm3": {"post_attention_layernorm": "ffn_norm"},
    "phi3": {"post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
             "mlp.gate_up_proj": "ffn_up"},
    "gemma3": {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "gpt-oss": {"post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp",
                "mlp.experts.down_proj": "ffn_down_exps"},
}

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# gpt-oss names a few tensors without the .weight / .bias suffix
_GPT_OSS_RE = re.compile(r"model\.layers\.(\d+)\.(self_attn\.sinks|mlp\.experts\.(?:gate_up|down)_proj(?:_bias)?)$")
# one expert's matrix in an HF MoE checkpoint; GGUF stacks a layer's experts into one 3-D tensor
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
# wrappers around the text model in multimodal checkpoints (e.g. Gemma3ForConditionalGeneration)
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")
# tensors a checkpoint may hold that the model does not use
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|vision_tower\.|multi_modal_projector\.|"
                      r"^model\.vision|^vision_model\.)")


class CheckpointError(ValueError):
    """A checkpoint folder we cannot read; the message names the file and the problem."""


def hf_arch(hf: dict) -> str:
    """GGUF architecture name for a config.json, or UnsupportedArchitecture."""
    mt = hf.get("model_type")
    archs = hf.get("architectures") or []
    arch = _ARCH_OF_MODEL_TYPE.get(mt)
    if arch is None:
        raise UnsupportedArchitecture(
            f"checkpoint architecture '{mt or (archs[0] if archs else '?')}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)}; config.json model_type "
            f"{', '.join(sorted(_ARCH_OF_MODEL_TYPE))})")
    return arch


def text_config(hf: dict) -> dict:
    """The language model's part of a (possibly multimodal) config.json."""
    if "text_config" in hf and isinstance(hf["text_config"], dict) and "num_hidden_layers" not in hf:
        inner = dict(hf["text_config"])
        inner.setdefault("model_type", hf.get("model_type"))
        return inner
    return hf


def _rope(hf: dict, kind: str | None = None) -> dict:
    """rope parameters in transformers 4 (rope_theta + rope_scaling) or 5
    (rope_parameters, per attention kind for gemma3) spelling."""
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict) and kind and isinstance(rp.get(kind), dict):
        rp = rp[kind]
    out = dict(rp) if isinstance(rp, dict) and "rope_theta" in rp else {}
    if "rope_theta" not in out and "rope_theta" in hf:
        out["rope_theta"] = hf["rope_theta"]
    rs = hf.get("rope_scaling")
    if isinstance(rs, dict) and "rope_type" not in out:
        out.update({k: v for k, v in rs.items() if k not in out})
        if "type" in rs and "rope_type" not in out:
            out["rope_type"] = rs["type"]
    return out


def config_from_hf(hf: dict, tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """ModelConfig from config.json; tensor_shapes uses GGUF names (see gguf_name)."""
    arch = hf_arch(hf)
    hf = text_config(hf)

    def need(key):
        if hf.get(key) is None:
            raise CheckpointError(f"config.json lacks '{key}'")
        return hf[key]

    d_model = int(need("hidden_size"))
    n_heads = int(need("num_attention_heads"))
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or d_model // n_heads)
    n_layers = int(need("num_hidden_layers"))
    emb = tensor_shapes.get("token_embd.weight")
    vocab = int(emb[0]) if emb else int(need("vocab_size"))
    rope = _rope(hf, "full_attention" if arch == "gemma3" else None)
    rope_type = rope.get("rope_type") or "default"
    prf = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    act = hf.get("hidden_activation") or hf.get("hidden_act") or _ACTIVATION[arch][0]
    if act not in _ACTIVATION[arch]:
        raise CheckpointError(f"config.json: activation '{act}' is not the {arch} one Llamba implements "
                              f"({', '.join(_ACTIVATION[arch])})")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key):
            raise CheckpointError(f"config.json: {key}={hf[key]} is not implemented by Llamba")
    cfg = ModelConfig(
        arch=arch, n_layers=n_layers, d_model=d_model,
        d_ff=int(need("intermediate_size")), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        vocab_size=vocab, context_length=int(hf.get("max_position_embeddings") or 2048),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_neox=arch in ("qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "gpt-oss"),
        rope_dim=int(head_dim * float(prf)),
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        tied_output="output.weight" not in tensor_shapes,
        name=str(hf.get("_name_or_path") or hf.get("_model_name_or_path") or ""),
        extra={"hf_config": hf},
    )
    _rope_scaling(cfg, hf, rope, rope_type)
    _windows(cfg, hf, arch)
    if arch in MOE_ARCHS:
        _experts(cfg, hf, n_layers)
    if arch == "smollm3":
        flags = hf.get("no_rope_layers")
        if flags is None:
            every = int(hf.get("no_rope_layer_interval") or 4)
            flags = [int((i + 1) % every != 0) for i in range(n_layers)]
        if len(flags) != n_layers:
            raise CheckpointError(f"config.json: no_rope_layers has {len(flags)} entries for {n_layers} layers")
        cfg.nope_layers = tuple(i for i, f in enumerate(flags) if not f)   # 1 = this layer uses RoPE
    if arch == "gemma3":
        local = _rope(hf, "sliding_attention")
        cfg.rope_theta_local = float(hf.get("rope_local_base_freq") or local.get("rope_theta", 10000.0))
        cfg.embed_scale = d_model ** 0.5
        qpas = hf.get("query_pre_attn_scalar")
        cfg.attn_scale = float(qpas) ** -0.5 if qpas else 0.0
    return cfg


def _original_context(hf: dict, rope: dict) -> int:
    """The pretraining context a scaled RoPE starts from, where transformers takes it: a
    top-level original_max_position_embeddings first (Phi-3's config has one, 4096 by
    default), else the rope parameters', else max_position_embeddings."""
    if hf.get("original_max_position_embeddings") is not None:
        return int(hf["original_max_position_embeddings"])
    if hf.get("model_type") == "phi3":
        return 4096
    return int(rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings") or 2048)


def _rope_scaling(cfg: ModelConfig, hf: dict, rope: dict, rope_type: str) -> None:
    """The rope parameters' scaling as transformers' modeling_rope_utils computes it."""
    arch = cfg.arch
    if arch == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"        # as transformers' Phi3Config renames them
    if rope_type == "default":
        return
    if rope_type == "linear":
        cfg.rope_scale = float(rope.get("factor", 1.0))
        return
    original = _original_context(hf, rope)
    max_pos = int(hf.get("max_position_embeddings") or original)
    if rope_type == "llama3" and arch == "llama":
        cfg.rope_freq_factors = llama3_rope_factors(
            cfg.rope_dim, cfg.rope_theta, float(rope.get("factor", 8.0)), float(rope.get("low_freq_factor", 1.0)),
            float(rope.get("high_freq_factor", 4.0)), original)
    elif rope_type == "yarn" and arch in YARN_ARCHS:
        factor = float(rope.get("factor") or max_pos / original)
        cfg.rope_yarn = YarnScaling(factor, original, beta_fast=float(rope.get("beta_fast") or 32),
                                    beta_slow=float(rope.get("beta_slow") or 1),
                                    truncate=bool(rope["truncate"]) if "truncate" in rope else True)
        attention = rope.get("attention_factor")
        if attention is None:
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                         if mscale and mscale_all_dim else yarn_mscale(factor))
        cfg.rope_mscale = float(attention)
        cfg.context_length = max(cfg.context_length, yarn_context(cfg.rope_yarn))
    elif rope_type == "longrope" and arch in LONGROPE_ARCHS:
        short, long = rope.get("short_factor"), rope.get("long_factor")
        for name, f in (("short_factor", short), ("long_factor", long)):
            if not isinstance(f, list) or len(f) != cfg.rope_dim // 2:
                raise CheckpointError(f"config.json: LongRoPE {name} must list {cfg.rope_dim // 2} numbers (half the "
                                      f"{cfg.rope_dim} rotated dims), not {str(f)[:60]}")
        factor = float(rope.get("factor") or max_pos / original)
        attention = rope.get("attention_factor")
        cfg.rope_mscale = float(longrope_mscale(factor, original) if attention is None else attention)
        cfg.rope_factors_short = np.asarray(short, np.float32)
        cfg.rope_factors_long = np.asarray(long, np.float32)
        cfg.rope_original_context = original
    else:
        kinds = ["linear"] + (["llama3"] if arch == "llama" else []) + (["yarn"] if arch in YARN_ARCHS else []) \
            + (["longrope"] if arch in LONGROPE_ARCHS else [])
        raise CheckpointError(f"config.json: rope scaling type '{rope_type}' is not implemented by Llamba for "
                              f"{arch} (only {', '.join(kinds)}); refusing rather than running the model with the "
                              f"wrong positions")


def _experts(cfg: ModelConfig, hf: dict, n_layers: int) -> None:
    """Qwen3-MoE's experts from config.json; what would change the math and is not
    implemented (dense layers among the MoE ones, shared experts) is refused."""
    def need(*keys):
        for k in keys:
            if hf.get(k) is not None:
                return hf[k]
        raise CheckpointError(f"config.json lacks '{keys[0]}'")
    cfg.n_experts = int(need("num_experts", "num_local_experts"))
    cfg.n_experts_used = int(need("num_experts_per_tok"))
    if cfg.arch == "gpt-oss":
        # every expert is intermediate_size wide; a softmax over the top k router logits
        # (renormalized top-k probabilities: moe.py); the clamped SwiGLU, whose constants
        # llama.cpp fixes (1.702, 7): other values are refused, not run differently there
        cfg.d_ff_expert = int(need("intermediate_size"))
        cfg.expert_norm_topk = True
        cfg.expert_glu = "swiglu_oai"
        for key, want in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
            if float(hf.get(key, want)) != want:
                raise CheckpointError(f"config.json: {key}={hf[key]} is not implemented by Llamba (gpt-oss's "
                                      f"clamped SwiGLU with {want})")
        if hf.get("attention_bias") is False:
            raise CheckpointError("config.json: attention_bias false is not implemented for gpt-oss")
    else:
        cfg.d_ff_expert = int(need("moe_intermediate_size"))
        cfg.expert_norm_topk = bool(hf.get("norm_topk_prob", False))
    if not 0 < cfg.n_experts_used <= cfg.n_experts:
        raise CheckpointError(f"config.json: num_experts_per_tok {cfg.n_experts_used} with {cfg.n_experts} experts")
    dense = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense |= {i for i in range(n_layers) if (i + 1) % step != 0}
    if dense:
        raise CheckpointError(f"config.json: layers {sorted(dense)} have a dense MLP among the expert layers "
                              f"(mlp_only_layers / decoder_sparse_step); Llamba runs experts in every layer")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if hf.get(key):
            raise CheckpointError(f"config.json: {key}={hf[key]}: shared experts are not implemented by Llamba "
                                  f"for {cfg.arch}")


class Part:
    """How one GGUF tensor is cut from an HF one that stores it differently (gpt-oss's
    experts): the last two axes swapped (HF keeps them as x @ W), then every other row
    along the output axis from `start` (gate and up interleaved in one tensor, gate
    first) where start is not None; the output axis is the last for a bias."""

    def __init__(self, transpose: bool, start: int | None = None, bias: bool = False):
        self.transpose, self.start, self.bias = transpose, start, bias

    def apply(self, a: np.ndarray) -> np.ndarray:
        if self.transpose:
            a = a.swapaxes(-1, -2)
        if self.start is not None:
            a = a[..., self.start::2] if self.bias else a[..., self.start::2, :]
        return a

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        s = list(shape)
        if self.transpose:
            s[-1], s[-2] = s[-2], s[-1]
        if self.start is not None:
            ax = -1 if self.bias else -2
            s[ax] = (s[ax] - self.start + 1) // 2
        return tuple(s)


def parts(hf_name: str, arch: str) -> list[tuple[str, Part]] | None:
    """The GGUF tensors cut from HF tensor `hf_name` (Part), or None where it maps to one
    GGUF tensor as stored (gguf_name).  gpt-oss: gate_up_proj [E, d, 2 ff] (gate and up
    interleaved) -> ffn_gate_exps / ffn_up_exps [E, ff, d]; down_proj [E, ff, d] ->
    ffn_down_exps [E, d, ff]; gate_up_proj_bias [E, 2 ff] -> the two biases [E, ff]
    (llama.cpp's converter cuts them the same way)."""
    if arch != "gpt-oss":
        return None
    m = _GPT_OSS_RE.match(hf_name)
    if m is None:
        return None
    i, part = m.groups()
    p = f"blk.{i}."
    if part == "mlp.experts.gate_up_proj":
        return [(p + "ffn_gate_exps.weight", Part(True, 0)), (p + "ffn_up_exps.weight", Part(True, 1))]
    if part == "mlp.experts.gate_up_proj_bias":
        return [(p + "ffn_gate_exps.bias", Part(False, 0, bias=True)),
                (p + "ffn_up_exps.bias", Part(False, 1, bias=True))]
    if part == "mlp.experts.down_proj":
        return [(p + "ffn_down_exps.weight", Part(True))]
    return None


_MXFP4_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj_blocks$")


def mxfp4_parts(hf_name: str, arch: str) -> list[tuple[str, int | None]] | None:
    """gpt-oss's own checkpoint keeps its experts in MXFP4: `*_blocks` (uint8 [E, rows,
    cols / 32, 16]) with `*_scales` (uint8 [E, rows, cols / 32]), rows as GGUF has them (not
    transposed).  For a `*_blocks` name: [(GGUF name, first row or None)], gate and up
    interleaved by rows in gate_up (llama.cpp's converter cuts them the same way); None for
    any other name (its `*_scales` is read beside it)."""
    m = _MXFP4_RE.match(hf_name) if arch == "gpt-oss" else None
    if m is None:
        return None
    i, part = m.groups()
    if part == "gate_up":
        return [(f"blk.{i}.ffn_gate_exps.weight", 0), (f"blk.{i}.ffn_up_exps.weight", 1)]
    return [(f"blk.{i}.ffn_down_exps.weight", None)]


def expert_name(hf_name: str) -> tuple[str, int] | None:
    """(GGUF name of the 3-D tensor, expert index) for one expert's HF matrix, else None."""
    m = _EXPERT_RE.match(hf_name)
    if m is None:
        return None
    i, e, part = m.groups()
    return f"blk.{i}.ffn_{part}_exps.weight", int(e)


def _windows(cfg: ModelConfig, hf: dict, arch: str) -> None:
    """Sliding-window layers as transformers runs them: Mistral (model_type mistral)
    windows every layer when sliding_window is set; the others name each layer's
    kind in layer_types (transformers 5) or by pattern (gemma3, older configs)."""
    window = int(hf.get("sliding_window") or 0)
    kinds = hf.get("layer_types")
    if arch == "gemma3":
        cfg.sliding_window = window or 512
        if isinstance(kinds, list):
            cfg.local_layers = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
        else:
            cfg.sliding_pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        return
    if hf.get("model_type") in ("mistral", "phi3"):
        cfg.sliding_window = window          # every layer; 0 (null): full attention everywhere
        return
    if isinstance(kinds, list):
        bad = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if bad:
            raise CheckpointError(f"config.json: layer type {bad[0]} is not implemented by Llamba")
        local = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
        if local and not window:
            raise CheckpointError("config.json: sliding_attention layers without a sliding_window")
        if local and hf.get("use_sliding_window", True):
            cfg.sliding_window, cfg.local_layers = window, local
    elif hf.get("use_sliding_window") and window:
        raise CheckpointError("config.json: use_sliding_window without layer_types; Llamba cannot tell "
                              "which layers attend through the window")


def gguf_name(hf_name: str, arch: str) -> str | None:
    """GGUF tensor name for an HF tensor name; None for tensors the model does not use.
    Raises CheckpointError for a tensor we do not know (better than silently
    running a model with a missing piece)."""
    for p in _PREFIXES:
        if hf_name.startswith(p):
            hf_name = "model." + hf_name[len(p):] if not hf_name.startswith("language_model.lm_head") \
                else hf_name[len(p):]
            break
    if _IGNORED.search(hf_name):
        return None
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    if arch == "gpt-oss":
        m = _GPT_OSS_RE.match(hf_name)
        if m and m.group(2) == "self_attn.sinks":
            return f"blk.{m.group(1)}.attn_sinks.weight"
        if m and m.group(2) == "mlp.experts.down_proj_bias":
            return f"blk.{m.group(1)}.ffn_down_exps.bias"
    m = _LAYER_RE.match(hf_name)
    if m:
        i, part, kind = m.groups()
        ours = _LAYER_NAMES_BY_ARCH[arch].get(part) or _LAYER_NAMES.get(part)
        if ours:
            return f"blk.{i}.{ours}.{kind}"
    raise CheckpointError(f"tensor '{hf_name}' is not part of a {arch} model as Llamba knows it")


def needs_qk_permute(arch: str) -> bool:
    return arch in ("llama", "smollm3")


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF (rotate-half) q/k rows -> GGUF (adjacent-pair) order, as llama.cpp's
    converter does; n_heads is the q head count for q and the kv count for k.
    Works on weights [n_heads*d, K] and biases [n_heads*d]."""
    rows = w.shape[0]
    return (w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def is_norm(gguf_tensor_name: str) -> bool:
    return gguf_tensor_name.endswith("norm.weight")


def fix_layout(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """float32 tensor in HF layout -> GGUF layout, for GGUF tensor `name`."""
    if needs_qk_permute(cfg.arch):
        if ".attn_q." in name:
            w = permute_qk(w, cfg.n_heads)
        elif ".attn_k." in name:
            w = permute_qk(w, cfg.n_kv_heads)
    if cfg.arch == "gemma3" and is_norm(name):
        w = w + np.float32(1.0)
    return w


def layout_changes(name: str, cfg: ModelConfig) -> bool:
    """Whether fix_layout changes tensor `name` (otherwise it can stay as stored)."""
    if needs_qk_permute(cfg.arch) and (".attn_q." in name or ".attn_k." in name):
        return True
    return cfg.arch == "gemma3" and is_norm(name)
