"""Turn a MODEL argument (a .gguf path, a checkpoint folder or a catalog name)
into a config, a dict of weight tensors in their stored block layout, and a
tokenizer.  Nothing is dequantized here: tensors are views into the memory map.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from models import check_tensors, config_from_gguf, unfuse
from models.catalog import CATALOG, DEFAULT_MODEL
from quant import QTensor, UnsupportedQuantType

from .gguf_file import GGUFError, GGUFFile
from .loaded_model import LoadedModel


def resolve_model_path(model: str | None, progress=None) -> Path:
    """A path as given, or a catalog name fetched into the cache on first use."""
    model = model or DEFAULT_MODEL
    if model in CATALOG:
        from .download import fetch
        return fetch(model, progress=progress)
    p = Path(model).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model not found: {model} (not a file, folder or catalog name: "
                                f"{', '.join(CATALOG)})")
    return p


def load_model(model: str | Path | None, progress=None, quant: str | None = None) -> LoadedModel:
    """quant ("none", "int8", "int4"): quantize a checkpoint folder's weights on load."""
    path = resolve_model_path(str(model) if model else None, progress)
    if path.is_dir():
        from .safetensors_loader import load_checkpoint
        return load_checkpoint(path, quant=quant)
    if quant not in (None, "none"):
        raise ValueError(f"--quant {quant} applies to safetensors checkpoint folders; {path.name} is a GGUF "
                         f"file and keeps its own quantization")
    return load_gguf(path)


def load_gguf(path: Path) -> LoadedModel:
    """Every tensor and every metadata key that changes the math must be one the
    model understands, else the file is refused (models.UnsupportedModelFile)."""
    from .tokenizer import Tokenizer
    g = GGUFFile(path)
    shapes = {n: t.shape for n, t in g.tensors.items()}
    cfg = config_from_gguf(g.metadata, shapes)
    check_tensors(cfg, shapes, path.name)
    tensors = {}
    # RoPE scaling: divisors of the frequencies, not weights (llama3's; LongRoPE's two sets)
    rope_divisors = {"rope_freqs.weight": "rope_freq_factors", "rope_factors_short.weight": "rope_factors_short",
                     "rope_factors_long.weight": "rope_factors_long"}
    for name, info in g.tensors.items():
        if name in rope_divisors:
            if info.ggml_type != 0:
                raise GGUFError(f"{path.name}: {name} is stored as ggml type {info.ggml_type}, not F32")
            setattr(cfg, rope_divisors[name], np.frombuffer(g.tensor_bytes(name), np.float32).copy())
            continue
        tensors[name] = QTensor.from_file_bytes(name, info.ggml_type, info.shape, g.tensor_bytes(name))
    tensors = unfuse(cfg, tensors)
    tok = Tokenizer.from_gguf(g.metadata)
    return LoadedModel(path=path, config=cfg, tensors=tensors, tokenizer=tok, metadata=g.metadata,
                       chat_template=g.metadata.get("tokenizer.chat_template"))
