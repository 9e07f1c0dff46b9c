"""Gemma 3: pre- and post-norms around attention and FFN, RMS-normed q/k heads,
GeGLU, embeddings scaled by sqrt(d_model), tied output, and sliding-window
(local) layers with their own RoPE base between every 6th global layer.

llama.cpp's converter already stores Gemma's norm weights as (1 + w), so every
norm here is a plain RMSNorm.
"""
from __future__ import annotations

from .config import ModelConfig
from .llama import _layer, rope_inv_freq


class Gemma3:
    def __init__(self, cfg: ModelConfig, w: dict):
        self.cfg = cfg
        self.tok_embd = w["token_embd.weight"]
        self.output_norm = w["output_norm.weight"]
        self.output = w.get("output.weight", self.tok_embd)
        self.layers = [_layer(w, i) for i in range(cfg.n_layers)]
        self.inv_freq_global = rope_inv_freq(cfg, cfg.rope_theta)
        self.inv_freq_local = rope_inv_freq(cfg, cfg.rope_theta_local)

    def forward(self, b, step):
        cfg = self.cfg
        x = b.embed(self.tok_embd, step.tokens, scale=cfg.embed_scale)
        for i, L in enumerate(self.layers):
            local = cfg.is_local_layer(i)
            inv_freq = self.inv_freq_local if local else self.inv_freq_global
            pos_scale = 1.0 if local else cfg.rope_scale
            h = b.rmsnorm(x, L["attn_norm"], cfg.rms_eps)
            q, k, v = b.matmuls(h, (L["attn_q"], L["attn_k"], L["attn_v"]))
            q = b.rmsnorm(b.heads(q, cfg.n_heads), L["attn_q_norm"], cfg.rms_eps)
            k = b.rmsnorm(b.heads(k, cfg.n_kv_heads), L["attn_k_norm"], cfg.rms_eps)
            b.rope(q, step, inv_freq, True, pos_scale, cfg.rope_mscale)
            b.rope(k, step, inv_freq, True, pos_scale, cfg.rope_mscale)
            a = b.attention(q, k, b.heads(v, cfg.n_kv_heads), i, step)
            a = b.matmul(a, L["attn_output"])
            b.add(x, b.rmsnorm(a, L["post_attention_norm"], cfg.rms_eps))
            h = b.rmsnorm(x, L["ffn_norm"], cfg.rms_eps)
            g, u = b.matmuls(h, (L["ffn_gate"], L["ffn_up"]))
            b.glu(g, u, "gelu")
            f = b.matmul(g, L["ffn_down"])
            b.add(x, b.rmsnorm(f, L["post_ffw_norm"], cfg.rms_eps))
            b.end_layer()
        x = b.rmsnorm(b.rows(x, step.logit_rows), self.output_norm, cfg.rms_eps)
        return b.logits(x, self.output)
