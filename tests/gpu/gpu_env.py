"""Where the GPU tests stand: NO_GPU (why not, or None) and the model files to use."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


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


def greedy_plain(eng, ids, n):
    """n greedy tokens of the target alone after the prompt ids."""
    seq = eng.new_sequence()
    logits = eng.prefill(seq, ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = eng.step([seq], [[out[-1]]])[0]
    eng.release(seq)
    return out


def greedy_drafted(eng, drafter, ids, n):
    """The loop Generation runs, without its detokenizer (test models carry no tokenizer)."""
    from runtime.sampling import Sampler, SamplingParams
    seq = eng.new_sequence()
    logits = eng.prefill(seq, ids)
    history, out = list(ids), []
    for t in drafter.tokens(seq, logits, history, Sampler(SamplingParams(temperature=0.0))):
        out.append(t)
        history.append(t)
        if len(out) == n:
            break
    drafter.finish(seq, len(history))
    eng.release(seq)
    return out
