"""What happens when a conversation outgrows the context window.

The user picks one policy; nothing is ever cut silently:

- ``stop`` (default): refuse with a clear message (a prompt that does not fit
  raises ContextOverflow; a generation that fills the window ends with
  stop_reason "context").
- ``drop-turns`` (chats): keep the system prompt and drop the oldest
  user/assistant turns from what the model sees until the prompt fits; the chat
  reports how many turns it dropped.
- ``shift``: keep the sequence's first `keep` tokens (system prompt / BOS), drop
  the oldest tokens after them, and re-rotate the cached keys to their new
  positions (RoPE rotations compose: R(p - d) = R(-d) R(p)), as llama.cpp's
  context shift does.  Positions stay the sequence's logical positions 0..n-1.
"""
from __future__ import annotations

import numpy as np

POLICIES = ("stop", "drop-turns", "shift")


class ContextOverflow(RuntimeError):
    """A sequence would grow past the context length."""


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown context overflow policy '{policy}' (choose from {', '.join(POLICIES)})")
    return policy


def rope_for_layer(cfg, layer: int) -> tuple[np.ndarray, bool, float]:
    """(inv_freq, neox, pos_scale) that the model's forward uses for `layer`'s keys
    (a layer without RoPE, as in SmolLM3: zero frequencies, so a shift moves its keys
    without rotating them).  `cfg` is the engine's (ModelConfig.for_context: LongRoPE's
    chosen factors).  YaRN's / LongRoPE's magnitude (rope_mscale) is not here: cached keys
    carry it already, and a shift only rotates them."""
    from models.config import rope_inv_freq
    if cfg.arch == "gemma3":
        if cfg.is_local_layer(layer):
            return rope_inv_freq(cfg, cfg.rope_theta_local), True, 1.0
        return rope_inv_freq(cfg, cfg.rope_theta), True, cfg.rope_scale
    inv_freq = rope_inv_freq(cfg, cfg.rope_theta)
    if not cfg.uses_rope(layer):
        inv_freq = np.zeros_like(inv_freq)
    return inv_freq, cfg.rope_neox, cfg.rope_scale


def shift_amount(n_tokens: int, keep: int, n_new: int, n_ctx: int) -> int:
    """Tokens to drop so that n_new more fit: at least what is needed, and half of
    what is droppable (llama.cpp's n_discard) so that shifts stay rare."""
    need = n_tokens + n_new - n_ctx
    droppable = n_tokens - keep
    if need <= 0:
        return 0
    if need > droppable:
        raise ContextOverflow(
            f"context full: {n_new} new tokens do not fit in a context of {n_ctx} even after dropping "
            f"everything but the first {keep} tokens")
    return max(need, droppable // 2)


def fit_turns(messages: list[dict], render, n_ctx: int, reserve: int) -> tuple[int, list[int]]:
    """drop-turns: the index of the first message to show the model, and the prompt ids,
    so that the prompt plus `reserve` tokens for the answer fit in n_ctx.

    `messages` excludes the system prompt (always kept); `render(msgs)` gives ids.
    Whole turns are dropped (a user message and the replies up to the next user
    message); the last user message is never dropped."""
    first = 0
    while True:
        ids = render(messages[first:])
        if len(ids) + reserve <= n_ctx:
            return first, ids
        nxt = next((i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), None)
        if nxt is None:
            raise ContextOverflow(
                f"context full: the system prompt and the last message take {len(ids)} tokens, "
                f"+{reserve} for the answer exceeds the context length {n_ctx}")
        first = nxt
