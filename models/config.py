"""What a model *is*, independent of where its weights come from.

`ModelConfig` is filled from GGUF metadata (here) or from a Hugging Face
`config.json` (the safetensors path); model files read only this.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np


class UnsupportedArchitecture(ValueError):
    pass


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's frequency ramp (transformers' _compute_yarn_parameters): frequencies that turn
    fewer than beta_slow times over the original context are divided by `factor`, those
    that turn more than beta_fast times are kept, a linear ramp between.  truncate rounds
    the ramp's ends to whole dims (transformers' default, and what ggml always does);
    gpt-oss's config.json turns it off.  Its magnitude factor is ModelConfig.rope_mscale."""
    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass
class ModelConfig:
    arch: str                      # family name as GGUF spells it: llama, qwen2, qwen3, qwen3moe, gemma3, ...
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_neox: bool                # rotate halves (NeoX) rather than adjacent pairs
    rope_dim: int = 0              # rotated dims per head (0 = all)
    rope_theta_local: float = 0.0  # gemma3 sliding-window layers use their own base
    rope_scale: float = 1.0        # linear position scaling (gemma3 global layers: 8)
    # llama3 RoPE scaling: each inv_freq is divided by its factor (GGUF rope_freqs.weight)
    rope_freq_factors: np.ndarray | None = field(default=None, compare=False, repr=False)
    rope_yarn: YarnScaling | None = None
    # LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): each inv_freq is divided by its short factor,
    # or by its long one where the engine's context exceeds rope_original_context (as
    # llama.cpp chooses: once for the engine, since keys are rotated when they are cached)
    rope_factors_short: np.ndarray | None = field(default=None, compare=False, repr=False)
    rope_factors_long: np.ndarray | None = field(default=None, compare=False, repr=False)
    rope_original_context: int = 0
    rope_context: int = 0          # the context the engine runs with (for_context); 0: not chosen, short
    # YaRN / LongRoPE magnitude (transformers' attention_factor): cos and sin of the rotated
    # dims are multiplied by it, in q and in k; the dims RoPE leaves alone are not
    rope_mscale: float = 1.0
    nope_layers: tuple = ()        # smollm3: layers that apply no RoPE at all
    sliding_window: int = 0        # 0: every layer attends to the whole context
    sliding_pattern: int = 0       # gemma3: every Nth layer is global, the rest local
    local_layers: tuple | None = None  # the sliding-window layers spelled out (None: by sliding_pattern)
    qk_norm: bool = False          # RMSNorm on each q and k head before RoPE (qwen3, gemma3)
    attn_scale: float = 0.0        # 0: 1/sqrt(head_dim)
    embed_scale: float = 1.0       # gemma multiplies embeddings by sqrt(d_model)
    qkv_bias: bool = False
    tied_output: bool = False
    # mixture of experts (qwen3moe): every layer's FFN is n_experts experts of d_ff_expert,
    # n_experts_used of them a token, chosen by softmax over the router's logits; their
    # weights renormalized to sum to 1 when expert_norm_topk (HF norm_topk_prob)
    n_experts: int = 0
    n_experts_used: int = 0
    d_ff_expert: int = 0
    expert_norm_topk: bool = False
    # gpt-oss: the experts' GLU (backend glu kinds: silu, swiglu_oai); the router and the
    # experts have biases, attention has q/k/v/o biases and a sink logit per head
    expert_glu: str = "silu"
    name: str = ""
    extra: dict = field(default_factory=dict)

    def is_local_layer(self, i: int) -> bool:
        """True for layers that attend only inside the sliding window."""
        if not self.sliding_window:
            return False
        if self.local_layers is not None:
            return i in self.local_layers
        return self.sliding_pattern == 0 or (i + 1) % self.sliding_pattern != 0

    def uses_rope(self, i: int) -> bool:
        return i not in self.nope_layers

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def rope_uses_long_factors(self) -> bool:
        return self.rope_factors_long is not None and self.rope_context > self.rope_original_context

    def rope_scaling(self) -> dict | None:
        """What scales this model's RoPE, for `info` (None: plain RoPE)."""
        if self.rope_yarn is not None:
            y = self.rope_yarn
            return {"type": "yarn", "factor": y.factor, "original_context": y.original_context,
                    "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "truncate": y.truncate,
                    "magnitude": round(self.rope_mscale, 6)}
        if self.rope_factors_long is not None:
            return {"type": "longrope", "original_context": self.rope_original_context,
                    "factors": "long" if self.rope_uses_long_factors else "short",
                    "magnitude": round(self.rope_mscale, 6)}
        if self.rope_freq_factors is not None:
            return {"type": "llama3"}
        if self.rope_scale != 1.0:
            return {"type": "linear", "factor": self.rope_scale}
        return None

    def for_context(self, n_ctx: int) -> "ModelConfig":
        """This config for an engine of n_ctx tokens a sequence: LongRoPE takes its long
        factors when n_ctx exceeds the original context (llama.cpp's rule), else the short."""
        if self.rope_factors_long is None or self.rope_context == n_ctx:
            return self
        return dataclasses.replace(self, rope_context=int(n_ctx))


SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "smollm3", "phi3", "gpt-oss")
MOE_ARCHS = ("qwen3moe", "gpt-oss")

# Metadata keys under "{arch}." that Llamba reads (and honours).  Any other key
# there may change the math in a way we do not implement (logit soft-capping,
# experts, YaRN parameters, ...), so a file carrying one is refused rather than
# run wrong.  Values are checked too (e.g. rope.scaling.type).
_GGUF_KEYS = {"context_length", "embedding_length", "block_count", "feed_forward_length",
              "attention.head_count", "attention.head_count_kv", "attention.key_length",
              "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
              "rope.dimension_count", "vocab_size", "rope.scaling.type", "rope.scaling.factor",
              # YaRN's and LongRoPE's original context; informational for none and linear
              "rope.scaling.original_context_length", "rope.scaling.finetuned",
              # YaRN (llama.cpp's converter writes transformers' beta_fast, beta_slow and
              # attention_factor under these); a magnitude on cos and sin for any scaling
              "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "rope.scaling.yarn_attn_factor",
              "rope.scaling.attn_factor"}
_GGUF_ARCH_KEYS = {
    "llama": {"attention.sliding_window"},       # written by our converter for Mistral (HF sliding_window)
    "gemma3": {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"},
    "phi3": {"attention.sliding_window"},
    # llama.cpp's qwen3moe: softmax routing, normalized top-k, no shared experts (a key for
    # any of those, e.g. expert_shared_feed_forward_length or expert_gating_func, is refused)
    "qwen3moe": {"expert_count", "expert_used_count", "expert_feed_forward_length"},
    # llama.cpp's gpt-oss (openai-moe): top-k of the biased router logits, softmax over
    # them; sliding-window layers by pattern (2: every other layer from the first, or
    # llama.cpp's per-layer array); a separate sliding-window RoPE base is refused
    "gpt-oss": {"expert_count", "expert_used_count", "expert_feed_forward_length", "attention.sliding_window",
                "attention.sliding_window_pattern"},
}
# keys that some converters write with a value that changes nothing
_GGUF_NEUTRAL = {"tensor_data_layout": lambda v: v == "Meta AI original pth",   # GGUF's own q/k layout
                 "attention.causal": lambda v: bool(v),
                 "expert_count": lambda v: int(v) == 0, "expert_used_count": lambda v: int(v) == 0,
                 # ggml's YaRN ramp weight; 1 (its default for yarn) is transformers' YaRN
                 "rope.scaling.yarn_ext_factor": lambda v: float(v) == 1.0}
# rope.scaling.type values we implement (linear: positions divided by the factor; yarn;
# longrope: the factors are the tensors rope_factors_short/long.weight)
_ROPE_SCALING_OK = ("none", "linear", "yarn", "longrope")
# families whose transformers code takes YaRN
YARN_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "smollm3", "gpt-oss")
# families whose YaRN does not round the ramp's ends (config.json truncate: false); a GGUF
# file has no key for it.  (gpt-oss: OpenAI's reference and transformers do not round;
# ggml always does, so llama.cpp runs gpt-oss's dims 8-17 with a slightly other ramp)
YARN_UNTRUNCATED_ARCHS = ("gpt-oss",)
# families that may carry LongRoPE factors (llama.cpp reads rope_factors_long/short for these)
LONGROPE_ARCHS = ("phi3",)
LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")


class UnsupportedModelFile(ValueError):
    """A model file whose metadata or tensors ask for math Llamba does not implement."""


def rope_inv_freq(cfg: ModelConfig, theta: float) -> np.ndarray:
    """RoPE's inverse frequencies for `cfg`'s rotated dims, divided by the llama3
    frequency factors where the model has them (llama.cpp's rope_freqs), bent by YaRN's
    ramp, or divided by LongRoPE's short or long factors (ModelConfig.for_context)."""
    dim = cfg.rope_dim or cfg.head_dim
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if cfg.rope_freq_factors is not None:
        inv = inv / np.asarray(cfg.rope_freq_factors, np.float64)
    if cfg.rope_yarn is not None:
        inv = inv * yarn_freq_scale(cfg.rope_yarn, dim, theta)
    if cfg.rope_factors_long is not None:
        factors = cfg.rope_factors_long if cfg.rope_uses_long_factors else cfg.rope_factors_short
        inv = inv / np.asarray(factors, np.float64)
    return inv.astype(np.float32)


def yarn_freq_scale(y: YarnScaling, dim: int, theta: float) -> np.ndarray:
    """What YaRN multiplies each of the dim/2 inverse frequencies by: transformers'
    inv_freq_interpolation * (1 - e) + inv_freq_extrapolation * e, with e its ramp."""
    def correction_dim(rotations):
        return dim * math.log(y.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001          # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 - ramp  # 1: the frequency is kept, 0: divided by the factor
    return (1.0 - extrapolated) / y.factor + extrapolated


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude for a context stretched by factor (transformers' yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def longrope_mscale(factor: float, original_context: int) -> float:
    """LongRoPE's default magnitude (transformers' _compute_longrope_parameters and
    llama.cpp's converter): sqrt(1 + ln(factor) / ln(original context))."""
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_context))


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> np.ndarray:
    """The per-frequency divisors of Llama 3.1's RoPE scaling, as llama.cpp's converter
    computes them into rope_freqs.weight (the same curve as transformers' llama3 rope)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape (rows first) of every weight tensor `cfg`'s model reads;
    a file must hold exactly these (plus rope_freqs.weight where the family has it)."""
    d, q, kv, ff = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_dim, cfg.d_ff
    out = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        out["output.weight"] = (cfg.vocab_size, d)
    E, fe = cfg.n_experts, cfg.d_ff_expert
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layer = {"attn_norm.weight": (d,), "attn_q.weight": (q, d), "attn_k.weight": (kv, d),
                 "attn_v.weight": (kv, d), "attn_output.weight": (d, q), "ffn_norm.weight": (d,),
                 "ffn_gate.weight": (ff, d), "ffn_up.weight": (ff, d), "ffn_down.weight": (d, ff)}
        if cfg.qkv_bias:
            layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        if cfg.qk_norm:
            layer.update({"attn_q_norm.weight": (cfg.head_dim,), "attn_k_norm.weight": (cfg.head_dim,)})
        if cfg.arch == "phi3":    # q, k, v in one matrix; gate and up in one (see unfuse)
            for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"):
                del layer[n]
            layer.update({"attn_qkv.weight": (q + 2 * kv, d), "ffn_up.weight": (2 * ff, d)})
        if cfg.arch == "gemma3":
            layer.update({"post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,)})
        if cfg.arch in MOE_ARCHS:    # the router and the experts' three 3-D tensors replace the FFN
            for n in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
                del layer[n]
            layer.update({"ffn_gate_inp.weight": (E, d), "ffn_gate_exps.weight": (E, fe, d),
                          "ffn_up_exps.weight": (E, fe, d), "ffn_down_exps.weight": (E, d, fe)})
        if cfg.arch == "gpt-oss":    # biases everywhere, sinks, and the FFN's norm named as llama.cpp does
            del layer["ffn_norm.weight"]
            layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,), "attn_output.bias": (d,),
                          "attn_sinks.weight": (cfg.n_heads,), "post_attention_norm.weight": (d,),
                          "ffn_gate_inp.bias": (E,), "ffn_gate_exps.bias": (E, fe), "ffn_up_exps.bias": (E, fe),
                          "ffn_down_exps.bias": (E, d)})
        out.update({p + k: v for k, v in layer.items()})
    return out


# families whose GGUF may carry llama3 RoPE factors (llama.cpp reads rope_freqs.weight for these)
ROPE_FREQS_ARCHS = ("llama",)


def check_tensors(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse a file whose tensors are not exactly what `cfg`'s model reads: a tensor we
    would ignore (a bias, an extra norm) means the file's model is not the one we run."""
    want = tensor_shapes(cfg)
    if cfg.arch in ROPE_FREQS_ARCHS:
        want["rope_freqs.weight"] = ((cfg.rope_dim or cfg.head_dim) // 2,)
    if cfg.rope_original_context:      # LongRoPE: both factor tensors (config_from_gguf saw one)
        want.update({n: ((cfg.rope_dim or cfg.head_dim) // 2,) for n in LONGROPE_TENSORS})
    missing = [n for n in want if n not in shapes and n != "rope_freqs.weight"]
    if missing:
        raise UnsupportedModelFile(f"{where}: lacks tensor {missing[0]} that a {cfg.arch} model needs"
                                   + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(n for n in shapes if n not in want)
    if extra:
        raise UnsupportedModelFile(
            f"{where}: tensor {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} is not part of a "
            f"{cfg.arch} model as Llamba runs it (running without it would give wrong results)")
    for n, shape in shapes.items():
        if tuple(shape) != tuple(want[n]):
            raise UnsupportedModelFile(f"{where}: tensor {n} has shape {list(shape)}, the metadata "
                                       f"implies {list(want[n])}")


def config_from_gguf(meta: dict, shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitecture(
            f"model architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    known = _GGUF_KEYS | _GGUF_ARCH_KEYS.get(arch, set())
    for k in meta:
        sub = k[len(arch) + 1:]
        neutral = sub in _GGUF_NEUTRAL and _GGUF_NEUTRAL[sub](meta[k])
        if k.startswith(arch + ".") and sub not in known and not neutral:
            raise UnsupportedModelFile(
                f"GGUF metadata key '{k}' = {_short(meta[k])} asks for something Llamba does not implement "
                f"for {arch}; refusing rather than running the model wrong")

    def get(key, default=None, required=True):
        v = meta.get(f"{arch}.{key}", default)
        if v is None and required:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return v

    d_model = int(get("embedding_length"))
    n_heads = _one(get("attention.head_count"), "attention.head_count")
    n_kv = _one(get("attention.head_count_kv", n_heads), "attention.head_count_kv")
    head_dim = int(get("attention.key_length", d_model // n_heads))
    v_dim = int(get("attention.value_length", head_dim))
    if v_dim != head_dim:
        raise UnsupportedModelFile(f"{arch}.attention.value_length {v_dim} differs from the key length "
                                   f"{head_dim}; Llamba runs equal q/k/v head sizes only")
    vocab = shapes["token_embd.weight"][0]
    cfg = ModelConfig(
        arch=arch, n_layers=int(get("block_count")), d_model=d_model,
        d_ff=int(get("feed_forward_length")), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        vocab_size=int(vocab), context_length=int(get("context_length", 2048)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_neox=arch in ("qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "gpt-oss"),
        rope_dim=int(get("rope.dimension_count", head_dim, required=False) or head_dim),
        qkv_bias="blk.0.attn_q.bias" in shapes,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        tied_output="output.weight" not in shapes,
        name=str(meta.get("general.name", "")),
    )
    if not 0 < cfg.rope_dim <= head_dim or cfg.rope_dim % 2:
        raise UnsupportedModelFile(f"{arch}.rope.dimension_count {cfg.rope_dim} does not fit a head of {head_dim}")
    _rope_scaling_from_gguf(cfg, get, shapes)
    if arch in ("llama", "phi3"):
        # every layer windowed, as transformers runs Mistral and Phi-3 (llama.cpp ignores
        # Phi-3's window and never sees Mistral's: its converter drops it)
        cfg.sliding_window = int(get("attention.sliding_window", 0, required=False) or 0)
    if arch in MOE_ARCHS:
        cfg.n_experts = int(get("expert_count"))
        cfg.n_experts_used = int(get("expert_used_count"))
        if not 0 < cfg.n_experts_used <= cfg.n_experts:
            raise UnsupportedModelFile(f"{arch}: expert_used_count {cfg.n_experts_used} with expert_count "
                                       f"{cfg.n_experts}")
        # llama.cpp: without the key, the experts' width is feed_forward_length / experts used
        fe = get("expert_feed_forward_length", None, required=False)
        cfg.d_ff_expert = _one(fe, "expert_feed_forward_length") if fe is not None \
            else cfg.d_ff // cfg.n_experts_used
        cfg.expert_norm_topk = True      # llama.cpp's qwen3moe always renormalizes the top-k weights
                                         # (gpt-oss: softmax over the top k logits, the same: moe.py)
    if arch == "gpt-oss":
        cfg.expert_glu = "swiglu_oai"
        cfg.sliding_window = int(get("attention.sliding_window"))
        pattern = get("attention.sliding_window_pattern", 2, required=False)
        if hasattr(pattern, "__len__"):           # llama.cpp's per-layer form: true = sliding window
            local = tuple(i for i, s in enumerate(pattern) if s)
        else:                                     # llama.cpp's set_swa_pattern: the last of every n is global
            n = int(pattern)
            local = tuple(i for i in range(cfg.n_layers) if n == 0 or i % n < n - 1)
        cfg.local_layers = local
    if arch == "smollm3":
        # llama.cpp: every 4th layer (1-based) of SmolLM3 has no RoPE; there is no key for it
        cfg.nope_layers = tuple(i for i in range(cfg.n_layers) if (i + 1) % 4 == 0)
    if arch == "gemma3":
        cfg.sliding_window = int(get("attention.sliding_window", 0, required=False) or 0)
        pattern = get("attention.sliding_window_pattern", 6, required=False)
        if hasattr(pattern, "__len__"):           # llama.cpp's per-layer form: true = sliding window
            cfg.local_layers = tuple(i for i, s in enumerate(pattern) if s)
        else:
            cfg.sliding_pattern = int(pattern)
        cfg.rope_theta_local = float(get("rope.freq_base_swa", 10000.0, required=False))
        cfg.embed_scale = d_model ** 0.5
        if cfg.n_layers == 62:   # llama.cpp: Gemma 3 27B scales by 1/sqrt(d_model / n_heads)
            cfg.attn_scale = (d_model / n_heads) ** -0.5
    return cfg


def _rope_scaling_from_gguf(cfg: ModelConfig, get, shapes) -> None:
    """rope.scaling.* as llama.cpp reads them: linear, YaRN (transformers' math, with the
    beta and attention-factor keys llama.cpp's converter writes) or LongRoPE (the factors
    are tensors, read by the loader into rope_factors_short/long)."""
    arch = cfg.arch
    factor = float(get("rope.scaling.factor", 0.0, required=False) or 0.0)
    # llama.cpp: without a type, a factor means linear scaling
    scaling = str(get("rope.scaling.type", "linear" if factor else "none", required=False))
    if scaling not in _ROPE_SCALING_OK:
        raise UnsupportedModelFile(f"{arch}.rope.scaling.type '{scaling}' is not implemented by Llamba "
                                   f"(only {', '.join(_ROPE_SCALING_OK)}); refusing rather than running it wrong")
    original = int(get("rope.scaling.original_context_length", 0, required=False) or 0) or cfg.context_length
    # llama.cpp multiplies cos and sin by it whatever the scaling (LongRoPE's magnitude)
    cfg.rope_mscale = float(get("rope.scaling.attn_factor", 1.0, required=False))
    longrope = [n for n in LONGROPE_TENSORS if n in shapes]
    if longrope:
        if arch not in LONGROPE_ARCHS:
            raise UnsupportedModelFile(f"{arch}: LongRoPE factors ({longrope[0]}) are read for "
                                       f"{', '.join(LONGROPE_ARCHS)} only; refusing rather than ignoring them")
        if scaling not in ("none", "longrope"):
            raise UnsupportedModelFile(f"{arch}: LongRoPE factors with rope.scaling.type '{scaling}' as well; "
                                       f"Llamba does not combine them")
        cfg.rope_original_context = original
    elif scaling == "longrope":
        raise UnsupportedModelFile(f"{arch}.rope.scaling.type 'longrope' without the rope_factors_short/long "
                                   f"tensors")
    if scaling == "linear":
        cfg.rope_scale = factor or 1.0
    if scaling == "yarn":
        if arch not in YARN_ARCHS:
            raise UnsupportedModelFile(f"{arch}.rope.scaling.type 'yarn' is implemented for {', '.join(YARN_ARCHS)} "
                                       f"only; refusing rather than running it wrong")
        if not factor:
            raise UnsupportedModelFile(f"{arch}.rope.scaling.type 'yarn' without rope.scaling.factor")
        if "rope_freqs.weight" in shapes:
            raise UnsupportedModelFile(f"{arch}: YaRN together with rope_freqs.weight; Llamba does not combine them")
        cfg.rope_yarn = YarnScaling(
            factor, original, beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0, required=False)),
            truncate=arch not in YARN_UNTRUNCATED_ARCHS)
        # transformers' attention_factor where the converter wrote one (llama.cpp's own
        # qwen/llama graphs ignore the key and take yarn_mscale(factor) anyway)
        cfg.rope_mscale *= float(get("rope.scaling.yarn_attn_factor", 0.0, required=False) or yarn_mscale(factor))
        cfg.context_length = max(cfg.context_length, yarn_context(cfg.rope_yarn))


def yarn_context(y: YarnScaling) -> int:
    """The context YaRN stretches the model to: a config.json's max_position_embeddings (so
    the GGUF's context_length) often still says the original (Qwen3: 40960, YaRN 4 x 32768)."""
    return int(y.factor * y.original_context)


def unfuse(cfg: ModelConfig, tensors: dict) -> dict:
    """Phi-3 stores q, k and v as one matrix (attn_qkv) and gate and up as one (ffn_up,
    gate rows first); split them by rows into the llama names, so that one model runs
    every family.  Rows of a GGML tensor are independent, so any type splits, and
    the pieces are views of the same bytes."""
    if cfg.arch != "phi3":
        return tensors
    from quant import QTensor
    q, kv, ff = cfg.n_heads * cfg.head_dim, cfg.kv_dim, cfg.d_ff
    out = {}
    for n, t in tensors.items():
        p, _, part = n.rpartition(".")[0].rpartition(".")
        if part == "attn_qkv":
            cuts = (("attn_q", 0, q), ("attn_k", q, q + kv), ("attn_v", q + kv, q + 2 * kv))
        elif part == "ffn_up":
            cuts = (("ffn_gate", 0, ff), ("ffn_up", ff, 2 * ff))
        else:
            out[n] = t
            continue
        for name, a, b in cuts:
            full = f"{p}.{name}.weight"
            out[full] = QTensor(full, t.qtype, (b - a,) + tuple(t.shape[1:]), t.data[a:b])
    return out


def _one(v, key) -> int:
    """A per-layer count that must be the same for every layer."""
    if hasattr(v, "__len__"):
        vals = {int(x) for x in v}
        if len(vals) != 1:
            raise UnsupportedModelFile(f"{key} differs between layers ({sorted(vals)}); Llamba runs "
                                       f"uniform layers only")
        return vals.pop()
    return int(v)


def _short(v) -> str:
    r = repr(v.tolist() if hasattr(v, "tolist") else v)
    return r if len(r) <= 60 else r[:57] + "..."
