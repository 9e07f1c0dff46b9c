"""Make the Hugging Face checkpoints the safetensors tests read.

HF transformers loads a catalog GGUF (dequantizing it) and `save_pretrained`s
model and tokenizer as a safetensors folder: a real checkpoint, made from the
models we already ship, without the hub.  Folders are cached outside the repo
(~/.cache/llamba-test/, or $LLAMBA_TEST_CACHE) and never committed.

    python tests/checkpoints/make_checkpoints.py [smollm2-135m] [qwen2.5-coder-0.5b]
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

CACHE = Path(os.environ.get("LLAMBA_TEST_CACHE", Path.home() / ".cache" / "llamba-test"))

# name -> (catalog name, torch dtype, max shard size).  smollm2 is saved in bf16
# and sharded so that one checkpoint exercises bf16 and the shard index; qwen in f16;
# gemma3 (norms stored as w, not 1 + w) in bf16.
CHECKPOINTS = {
    "smollm2-135m": ("smollm2-135m", "bfloat16", "100MB"),
    "qwen2.5-coder-0.5b": ("qwen2.5-coder-0.5b", "float16", "2GB"),
    "gemma3-270m": ("gemma3-270m", "bfloat16", "2GB"),
}


def checkpoint_dir(name: str) -> Path:
    return CACHE / f"{name}-{CHECKPOINTS[name][1]}"


def ensure_checkpoint(name: str) -> Path:
    """The checkpoint folder, made on first use (a minute or so for smollm2)."""
    out = checkpoint_dir(name)
    if (out / ".complete").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.loader import resolve_model_path

    catalog_name, dtype, shard = CHECKPOINTS[name]
    gguf_path = resolve_model_path(catalog_name)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    from transformers import GgufConfig
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    # A GGUF-loaded model refuses save_pretrained (it counts as "quantized"):
    # move its dense weights into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(tmp, max_shard_size=shard)
    tok.save_pretrained(tmp)
    (tmp / ".complete").write_text(f"{gguf_path.name} {dtype}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    for n in sys.argv[1:] or list(CHECKPOINTS):
        print(ensure_checkpoint(n))
