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
def made_checkpoint():
    """made_checkpoint(name) -> folder, for the larger checkpoints only where they were
    already made (python tests/checkpoints/make_checkpoints.py NAME), to keep CI short."""
    def get(name):
        d = checkpoint_dir(name)
        if not (d / ".complete").exists():
            pytest.skip(f"{name} checkpoint not made here (tests/checkpoints/make_checkpoints.py {name})")
        return d
    return get
