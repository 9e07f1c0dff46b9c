"""gpt-oss (OpenAI's gpt-oss-20b / 120b; llama.cpp's `gpt-oss`, HF GptOssForCausalLM).

A pre-norm decoder like Llama's, with:
- biases on q, k, v and the attention output;
- attention sinks: a learned logit per query head that joins each row's softmax
  denominator and brings no value (the backends' attention op takes them);
- sliding-window layers (128 tokens) alternating with full-attention ones: the engine
  gives each layer its window (ModelConfig.is_local_layer);
- NeoX RoPE with YaRN scaling (factor 32 over 4096, ramp ends not rounded: models/config.py's
  shared rope_inv_freq and rope_mscale);
- a mixture of experts in every layer: a router with a bias, top k of its logits and a
  softmax over those k, experts with biases and a clamped SwiGLU (the moe op's options).

Weights are named as in llama.cpp's GGUF files (the FFN's norm is `post_attention_norm`).
"""
from __future__ import annotations

from .config import ModelConfig
from .llama import _layer, rope_inv_freq


class GptOss:
    def __init__(self, cfg: ModelConfig, w: dict):
        self.cfg = cfg
        self.tok_embd = w["token_embd.weight"]
        self.output_norm = w["output_norm.weight"]
        self.output = w.get("output.weight", self.tok_embd)
        self.layers = [_layer(w, i) for i in range(cfg.n_layers)]
        self.inv_freq = rope_inv_freq(cfg, cfg.rope_theta)
        self.routes_tokens = True        # (see llama.py)

    def forward(self, b, step):
        cfg = self.cfg
        x = b.embed(self.tok_embd, step.tokens)
        for i, L in enumerate(self.layers):
            h = b.rmsnorm(x, L["attn_norm"], cfg.rms_eps)
            q, k, v = b.matmuls(h, (L["attn_q"], L["attn_k"], L["attn_v"]),
                                (L["attn_q.bias"], L["attn_k.bias"], L["attn_v.bias"]))
            q = b.heads(q, cfg.n_heads)
            k = b.heads(k, cfg.n_kv_heads)
            b.rope(q, step, self.inv_freq, True, cfg.rope_scale, cfg.rope_mscale)
            b.rope(k, step, self.inv_freq, True, cfg.rope_scale, cfg.rope_mscale)
            a = b.attention(q, k, b.heads(v, cfg.n_kv_heads), i, step, sinks=L["attn_sinks"])
            b.add(x, b.matmul(a, L["attn_output"], L["attn_output.bias"]))
            h = b.rmsnorm(x, L["post_attention_norm"], cfg.rms_eps)
            b.add(x, b.moe(h, L["ffn_gate_inp"], (L["ffn_gate_exps"], L["ffn_up_exps"], L["ffn_down_exps"]),
                           cfg.n_experts_used, True, router_bias=L["ffn_gate_inp.bias"],
                           biases=(L["ffn_gate_exps.bias"], L["ffn_up_exps.bias"], L["ffn_down_exps.bias"]),
                           glu=cfg.expert_glu))
            b.end_layer()
        x = b.rmsnorm(b.rows(x, step.logit_rows), self.output_norm, cfg.rms_eps)
        return b.logits(x, self.output)
