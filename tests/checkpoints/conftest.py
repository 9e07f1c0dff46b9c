"""Real Hugging Face checkpoints for the safetensors tests, made once from the
catalog GGUFs by make_checkpoints.py and cached outside the repo."""
from __future__ import annotations

import pytest

from make_checkpoints import checkpoint_dir, ensure_checkpoint
from tiny_models import llama_cpp_convert, llama_cpp_converter, make_tiny, prompt_ids, transformers_logits


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


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(family) -> (folder, prompt ids, transformers' logits), made once per session."""
    made = {}

    def get(family):
        if family not in made:
            d = make_tiny(family, tmp_path_factory.mktemp("tiny") / family)
            ids = prompt_ids()
            made[family] = (d, ids, transformers_logits(d, ids))
        return made[family]
    return get


@pytest.fixture(scope="session")
def lcpp(tiny, tmp_path_factory):
    """lcpp(family) -> the GGUF llama.cpp's convert_hf_to_gguf.py writes (f16)."""
    script = llama_cpp_converter()
    if script is None:
        pytest.skip("llama.cpp's converter could not be fetched (pip download llama-cpp-python sdist failed)")
    out = {}

    def get(family):
        if family not in out:
            folder = tiny(family)[0]
            out[family] = llama_cpp_convert(script, folder, tmp_path_factory.mktemp("lcpp") / f"{family}.gguf")
        return out[family]
    return get
