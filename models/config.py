"""What a model *is*, independent of where its weights come from.

`ModelConfig` is filled from GGUF metadata (here) or from a Hugging Face
`config.json` (the safetensors path); model files read only this.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class UnsupportedArchitecture(ValueError):
    pass


@dataclass
class ModelConfig:
    arch: str                      # family name as GGUF spells it: llama, qwen2, gemma3
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
    sliding_window: int = 0        # 0: every layer attends to the whole context
    sliding_pattern: int = 0       # gemma3: every Nth layer is global, the rest local
    attn_scale: float = 0.0        # 0: 1/sqrt(head_dim)
    embed_scale: float = 1.0       # gemma multiplies embeddings by sqrt(d_model)
    qkv_bias: bool = False
    tied_output: bool = False
    name: str = ""
    extra: dict = field(default_factory=dict)

    def is_local_layer(self, i: int) -> bool:
        """True for layers that attend only inside the sliding window."""
        return bool(self.sliding_window) and (self.sliding_pattern == 0 or (i + 1) % self.sliding_pattern != 0)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")


def config_from_gguf(meta: dict, tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitecture(
            f"model architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key, default=None, required=True):
        v = meta.get(f"{arch}.{key}", default)
        if v is None and required:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return v

    d_model = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    n_kv = int(n_kv if not hasattr(n_kv, "__len__") else n_kv[0])
    head_dim = int(get("attention.key_length", d_model // n_heads))
    vocab = tensor_shapes["token_embd.weight"][0]
    cfg = ModelConfig(
        arch=arch, n_layers=int(get("block_count")), d_model=d_model,
        d_ff=int(get("feed_forward_length")), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        vocab_size=int(vocab), context_length=int(get("context_length", 2048)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_neox=arch in ("qwen2", "gemma3"),
        rope_dim=int(get("rope.dimension_count", head_dim, required=False) or head_dim),
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        tied_output="output.weight" not in tensor_shapes,
        name=str(meta.get("general.name", "")),
    )
    if arch == "gemma3":
        cfg.sliding_window = int(get("attention.sliding_window", 512))
        cfg.sliding_pattern = 6
        cfg.rope_theta_local = 10000.0
        cfg.rope_scale = float(get("rope.scaling.factor", 1.0, required=False) or 1.0)
        cfg.embed_scale = d_model ** 0.5
    return cfg
