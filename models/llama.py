"""Llama-family decoder: llama (SmolLM2, Llama 3.x, Mistral), qwen2 (QKV bias),
qwen3 (RMS-normed q/k heads), qwen3moe (qwen3 with a mixture of experts for each
FFN), smollm3 (no RoPE in every 4th layer) and phi3 (NeoX RoPE on part of each
head; its fused qkv and gate_up are split on load).

RoPE scaling (linear, llama3, YaRN, LongRoPE) is all in the rope op's arguments: the
frequencies (rope_inv_freq), the position divisor and the magnitude on cos and sin.

Written once against the Backend ops; the Backend decides where it runs.
Weights are named as in GGUF files (`blk.{i}.attn_q.weight`, ...).  Sliding-window
layers (Mistral) need nothing here: the engine gives those layers a window.
"""
from __future__ import annotations

from .config import ModelConfig, rope_inv_freq  # noqa: F401  (rope_inv_freq: re-exported)


class Llama:
    def __init__(self, cfg: ModelConfig, w: dict):
        self.cfg = cfg
        self.tok_embd = w["token_embd.weight"]
        self.output_norm = w["output_norm.weight"]
        self.output = w.get("output.weight", self.tok_embd)
        self.layers = [_layer(w, i) for i in range(cfg.n_layers)]
        self.inv_freq = rope_inv_freq(cfg, cfg.rope_theta)
        # which experts run depends on the data: a backend must not replay one step's choice
        # (the CUDA backend captures only steps it routes on the device; the CPU's fused moe
        # kernels route inside the replayed calls)
        self.routes_tokens = cfg.n_experts > 0

    def forward(self, b, step):
        """Run one step: `step.tokens` enter, logits for `step.logit_rows` leave."""
        cfg = self.cfg
        x = b.embed(self.tok_embd, step.tokens)
        for i, L in enumerate(self.layers):
            h = b.rmsnorm(x, L["attn_norm"], cfg.rms_eps)
            q, k, v = b.matmuls(h, (L["attn_q"], L["attn_k"], L["attn_v"]),
                                (L.get("attn_q.bias"), L.get("attn_k.bias"), L.get("attn_v.bias")))
            q = b.heads(q, cfg.n_heads)
            k = b.heads(k, cfg.n_kv_heads)
            if cfg.qk_norm:
                q = b.rmsnorm(q, L["attn_q_norm"], cfg.rms_eps)
                k = b.rmsnorm(k, L["attn_k_norm"], cfg.rms_eps)
            if cfg.uses_rope(i):
                b.rope(q, step, self.inv_freq, cfg.rope_neox, cfg.rope_scale, cfg.rope_mscale)
                b.rope(k, step, self.inv_freq, cfg.rope_neox, cfg.rope_scale, cfg.rope_mscale)
            a = b.attention(q, k, b.heads(v, cfg.n_kv_heads), i, step)
            b.matmul_add(a, L["attn_output"], x)
            h = b.rmsnorm(x, L["ffn_norm"], cfg.rms_eps)
            if cfg.n_experts:     # softmax over the router's logits, top k (renormalized), SiLU GLU experts
                b.add(x, b.moe(h, L["ffn_gate_inp"], (L["ffn_gate_exps"], L["ffn_up_exps"], L["ffn_down_exps"]),
                               cfg.n_experts_used, cfg.expert_norm_topk))
            else:
                g, u = b.matmuls(h, (L["ffn_gate"], L["ffn_up"]))
                b.glu(g, u, "silu")
                b.matmul_add(g, L["ffn_down"], x)
            b.end_layer()
        x = b.rmsnorm(b.rows(x, step.logit_rows), self.output_norm, cfg.rms_eps)
        return b.logits(x, self.output)


def _layer(w: dict, i: int) -> dict:
    p = f"blk.{i}."
    return {k[len(p):].removesuffix(".weight"): v for k, v in w.items() if k.startswith(p)}
