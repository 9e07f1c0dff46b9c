"""Where the GPU tests stand: NO_GPU (why not, or None) and the model files to use."""

from __future__ import annotations

import os
from pathlib import Path


def _why_no_gpu():
    try:
        from runtime.backend.cuda import probe
        probe()
        return None
    except Exception as e:           # DeviceUnavailable, or anything a broken install raises
        return str(e)


NO_GPU = _why_no_gpu()


def model_files() -> list[Path]:
    """Real models to compare the backends on: every .gguf in $LLAMBA_GPU_TEST_MODELS
    (trimmed copies carried to a GPU machine), and the catalog models in the cache."""
    found = []
    d = os.environ.get("LLAMBA_GPU_TEST_MODELS")
    if d:
        found += sorted(Path(d).glob("*.gguf"))
    cache = Path(os.environ.get("LLAMBA_MODELS", Path.home() / ".cache" / "llm-models"))
    for name in ("SmolLM2-135M-Instruct-Q4_1.gguf", "gemma-3-270m-Q4_K_M.gguf",
                 "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"):
        if (cache / name).exists():
            found.append(cache / name)
    return found
