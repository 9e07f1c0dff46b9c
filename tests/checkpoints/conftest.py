"""Real Hugging Face checkpoints for the safetensors tests, made once from the
catalog GGUFs by make_checkpoints.py and cached outside the repo."""
from __future__ import annotations

import pytest

from make_checkpoints import checkpoint_dir, ensure_checkpoint


@pytest.fixture(scope="session")
def smollm_ckpt():
    """SmolLM2-135M as a bf16 checkpoint in 3 shards with an index (about a minute the first time)."""
    return ensure_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def qwen_ckpt():
    """Qwen2.5-Coder-0.5B as an f16 checkpoint: only where it was already made
    (python tests/checkpoints/make_checkpoints.py qwen2.5-coder-0.5b), to keep CI short."""
    d = checkpoint_dir("qwen2.5-coder-0.5b")
    if not (d / ".complete").exists():
        pytest.skip("qwen checkpoint not made here (tests/checkpoints/make_checkpoints.py qwen2.5-coder-0.5b)")
    return d


