"""Loading Hugging Face safetensors checkpoints: logits against transformers on
the same folder, quantization on load, bf16/f16/f32 reading, and clear errors
for broken folders."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_helpers import PROMPT, engine_logits, kl
from models.config import UnsupportedArchitecture
from models.hf_config import CheckpointError
from runtime.loader import load_model
from runtime.safetensors_loader import Shard


def _transformers_logits(folder, ids):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def smollm_none(smollm_ckpt):
    lm = load_model(smollm_ckpt)
    ids = lm.tokenizer.encode(PROMPT)
    return lm, ids, engine_logits(lm, ids)


def test_bf16_sharded_checkpoint_matches_transformers(smollm_ckpt, smollm_none):
    lm, ids, ours = smollm_none
    assert len(list(Path(smollm_ckpt).glob("*.safetensors"))) > 1          # the index path is exercised
    assert {t.qtype.name for t in lm.tensors.values() if len(t.shape) == 2} == {"BF16"}
    assert lm.config.arch == "llama" and lm.chat_template and "im_start" in lm.chat_template
    ref = _transformers_logits(smollm_ckpt, ids)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert kl(ref, ours).max() < 1e-4


@pytest.mark.parametrize("name,arch", [("qwen2.5-coder-0.5b", "qwen2"), ("gemma3-270m", "gemma3")])
def test_other_architectures_match_transformers(made_checkpoint, name, arch):
    folder = made_checkpoint(name)
    lm = load_model(folder)
    assert lm.config.arch == arch and lm.config.qkv_bias == (arch == "qwen2")
    ids = lm.tokenizer.encode(PROMPT)
    ours = engine_logits(lm, ids)
    ref = _transformers_logits(folder, ids)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert kl(ref, ours).max() < 1e-4


# Bounds (mean KL over the prompt's positions, nats; top-1 agreement) against the
# unquantized checkpoint.  SmolLM2-135M is small and was itself a Q4_1 GGUF, so
# 4-bit re-quantization costs it far more than it would a larger model.
QUANT_BOUNDS = {"int8": (0.01, 0.95), "int4": (0.4, 0.6)}


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantize_on_load_stays_close(smollm_ckpt, smollm_none, quant):
    _, ids, base = smollm_none
    lm = load_model(smollm_ckpt, quant=quant)
    types = {t.qtype.name for t in lm.tensors.values() if len(t.shape) == 2}
    if quant == "int8":
        assert types == {"Q8_0"}
    else:   # llama.cpp's Q4_K_M mix: Q4_K, with Q5_0/Q6_K/Q8_0 where rows or roles call for them
        assert "Q4_K" in types and types <= {"Q4_0", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    ours = engine_logits(lm, ids)
    max_kl, min_top1 = QUANT_BOUNDS[quant]
    assert kl(base, ours).mean() < max_kl
    assert (ours.argmax(-1) == base.argmax(-1)).mean() >= min_top1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_dtypes_read_exactly(tmp_path, dtype):
    from safetensors.torch import save_file
    t = torch.randn(3, 64, dtype=torch.float32).to(dtype)
    save_file({"w": t}, str(tmp_path / "x.safetensors"))
    got = Shard(tmp_path / "x.safetensors").array("w").astype(np.float32)
    assert np.array_equal(got, t.float().numpy())


# ---- broken folders --------------------------------------------------------------------------------------------

def _copy_folder(src: Path, dst: Path, skip=()) -> Path:
    """A folder of symlinks to src's files (cheap), except those in skip."""
    dst.mkdir()
    for p in src.iterdir():
        if p.name not in skip:
            os.symlink(p, dst / p.name)
    return dst


def _last_shard(folder: Path) -> str:
    return sorted(p.name for p in folder.glob("*.safetensors"))[-1]


def test_truncated_shard(smollm_ckpt, tmp_path):
    shard = _last_shard(smollm_ckpt)
    d = _copy_folder(smollm_ckpt, tmp_path / "ck", skip={shard})
    data = (smollm_ckpt / shard).read_bytes()
    (d / shard).write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard}.*truncated or corrupt"):
        load_model(d)


def test_missing_tensor(smollm_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    shard = _last_shard(smollm_ckpt)
    d = _copy_folder(smollm_ckpt, tmp_path / "ck", skip={shard, "model.safetensors.index.json"})
    tensors = load_file(str(smollm_ckpt / shard))
    victim = sorted(k for k in tensors if "mlp.up_proj" in k)[0]
    del tensors[victim]
    save_file(tensors, str(d / shard), metadata={"format": "pt"})
    index = json.loads((smollm_ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][victim]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"lacks tensor '{victim}'"):
        load_model(d)


def test_unsupported_dtype(smollm_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    shard = _last_shard(smollm_ckpt)
    d = _copy_folder(smollm_ckpt, tmp_path / "ck", skip={shard})
    tensors = load_file(str(smollm_ckpt / shard))
    victim = sorted(tensors)[0]
    tensors[victim] = tensors[victim].to(torch.float64)
    save_file(tensors, str(d / shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"'{victim}' is stored as F64"):
        load_model(d)


def test_header_dtype_disagrees_with_bytes(smollm_ckpt, tmp_path):
    """A header that says F32 where the bytes are sized for BF16."""
    shard = _last_shard(smollm_ckpt)
    d = _copy_folder(smollm_ckpt, tmp_path / "ck", skip={shard})
    raw = (smollm_ckpt / shard).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    victim = sorted(k for k in header if k != "__metadata__")[0]
    header[victim]["dtype"] = "F32"
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    (d / shard).write_bytes(raw[:8] + text.ljust(n, b" ") + raw[8 + n:])
    with pytest.raises(CheckpointError, match=shard):
        load_model(d)


def test_unknown_architecture(smollm_ckpt, tmp_path):
    d = _copy_folder(smollm_ckpt, tmp_path / "ck", skip={"config.json"})
    cfg = json.loads((smollm_ckpt / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "mamba", ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="'mamba' is not supported"):
        load_model(d)


def test_quant_flag_is_for_checkpoints_only(model_path):
    with pytest.raises(ValueError, match="applies to safetensors checkpoint folders"):
        load_model(model_path("smollm2-135m"), quant="int8")
