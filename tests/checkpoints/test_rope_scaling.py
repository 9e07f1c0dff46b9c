"""YaRN and LongRoPE against transformers, beyond what test_tiny_families.py checks for
every family (F16 from the folder, our GGUF and llama.cpp's, 96 tokens past an original
context of 32 or 64): each part of the math matters, BF16 and F32 weights, LongRoPE's
two regimes, YaRN's optional keys (truncate, betas, attention factor; gpt-oss's values),
and what is refused.

LongRoPE's factors: transformers picks them per forward (long where the forward reaches
past the original context), Llamba once for the engine by its context, as llama.cpp does,
since keys are rotated when they enter the cache.  The two agree where an engine whose
context is the original runs a forward inside it (short), and where an engine of a longer
context runs a forward past it (long); test_longrope_* check both, and the one place they
differ (a longer context, a short forward: ours long, transformers' short).
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from ckpt_helpers import edit_config, engine_logits, kl
from models import UnsupportedModelFile, check_tensors, config_from_gguf
from models.config import YarnScaling, rope_inv_freq, yarn_freq_scale, yarn_mscale
from models.hf_config import CheckpointError, config_from_hf
from runtime.gguf_file import GGUFFile
from runtime.loader import load_model
from tiny_models import make_tiny, prompt_ids, transformers_logits

pytest.importorskip("transformers")
MIN_TOP1, MAX_KL = 0.99, 1e-3


def _check(ours, ref, what):
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    mean_kl = float(kl(ref, ours).mean())
    print(f"{what}: top-1 {top1:.4f}, mean KL {mean_kl:.2e}")
    assert top1 >= MIN_TOP1, f"{what}: top-1 agreement {top1:.3f}"
    assert mean_kl <= MAX_KL, f"{what}: mean KL {mean_kl:.2e}"


def _far(ours, ref):
    """Clearly outside the bar (LongRoPE's magnitude on 8 of 16 dims of the tiny Phi-3 moves
    the mean KL by 0.05, its factors by 0.14)."""
    return float(kl(ref, ours).mean()) > 20 * MAX_KL


@pytest.mark.parametrize("family", ["qwen3-yarn", "phi3-longrope"])
def test_every_part_of_the_scaling_matters(tiny, family):
    """Without the frequencies' scaling, or without the magnitude on cos and sin, the
    same folder disagrees with transformers (so the family tests' agreement is earned)."""
    folder, ids, ref = tiny(family)
    lm = load_model(folder)
    _check(engine_logits(lm, ids), ref, family)
    cfg = lm.config
    assert cfg.rope_mscale == pytest.approx(yarn_mscale(4.0) if family == "qwen3-yarn" else math.sqrt(2))
    no_freqs = dict(rope_yarn=None) if cfg.rope_yarn else dict(rope_factors_short=np.ones(4, np.float32),
                                                                rope_factors_long=np.ones(4, np.float32))
    for changes in (no_freqs, dict(rope_mscale=1.0)):
        wrong = dataclasses.replace(lm, config=dataclasses.replace(cfg, **changes))
        assert _far(engine_logits(wrong, ids), ref), changes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["qwen3-yarn", "llama-yarn", "phi3-longrope"])
def test_bf16_and_f32_folders(tmp_path, family, dtype):
    d = make_tiny(family, tmp_path / family, dtype=dtype)
    ids = prompt_ids()
    lm = load_model(d)
    want = {"bfloat16": "BF16", "float32": "F32"}[dtype]
    assert {t.qtype.name for t in lm.tensors.values() if len(t.shape) == 2} == {want}
    _check(engine_logits(lm, ids), transformers_logits(d, ids), f"{family} {dtype}")


@pytest.mark.parametrize("family", ["qwen2", "qwen3moe", "smollm3"])
def test_yarn_on_the_other_families(tmp_path, family):
    """(Llama and Qwen3 with YaRN are families of their own in test_tiny_families.py.)"""
    d = make_tiny(family, tmp_path / family, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
        max_position_embeddings=128)
    ids = prompt_ids()
    lm = load_model(d)
    assert lm.config.rope_yarn == YarnScaling(4.0, 32)
    _check(engine_logits(lm, ids), transformers_logits(d, ids), f"{family} yarn")


# ---- LongRoPE's two regimes ------------------------------------------------------------------------------

def _longrope_files(tiny, lcpp, tmp_path):
    from quant.convert import convert
    folder = tiny("phi3-longrope")[0]
    return {"folder": folder, "llama.cpp GGUF": lcpp("phi3-longrope"),
            "our GGUF": convert(folder, tmp_path / "ours.gguf", "f16", progress=False)["path"]}


def test_longrope_short_context_takes_the_short_factors(tiny, lcpp, tmp_path):
    """An engine whose context is the original 64 takes the short factors, as transformers
    does for a forward of 64 tokens; it disagrees with the long factors' logits."""
    folder, ids, ref_long = tiny("phi3-longrope")
    short_ids = ids[:64]
    ref_short = transformers_logits(folder, short_ids)
    assert _far(ref_short, ref_long[:64])              # the regimes differ on the same tokens
    for what, path in _longrope_files(tiny, lcpp, tmp_path).items():
        lm = load_model(path)
        assert lm.config.rope_original_context == 64 and lm.config.context_length == 4096
        assert not lm.config.for_context(64).rope_uses_long_factors
        ours = engine_logits(lm, short_ids, n_ctx=64)
        _check(ours, ref_short, f"phi3-longrope {what}, context 64")
        assert _far(ours, ref_long[:64])


def test_longrope_long_context_takes_the_long_factors_from_the_first_token(tiny, lcpp, tmp_path):
    """An engine of a context past the original takes the long factors for every token, also
    for a prompt inside the original context: its logits for 64 tokens are transformers' first
    64 rows of a 96-token forward (long), not those of a 64-token forward (short)."""
    folder, ids, ref_long = tiny("phi3-longrope")
    for what, path in _longrope_files(tiny, lcpp, tmp_path).items():
        lm = load_model(path)
        assert lm.config.for_context(65).rope_uses_long_factors
        _check(engine_logits(lm, ids, n_ctx=256), ref_long, f"phi3-longrope {what}, context 256")
        _check(engine_logits(lm, ids[:64], n_ctx=65), ref_long[:64], f"phi3-longrope {what}, context 65, 64 tokens")


# ---- YaRN's optional keys ----------------------------------------------------------------------------------

def test_yarn_gpt_oss_values_and_truncate_false():
    """gpt-oss's config.json (factor 32, beta_fast 32, beta_slow 1, original 4096, rope_theta
    150000, head dim 64, truncate false): our ramp is transformers', and not the rounded one."""
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    c = transformers.GptOssConfig()
    rp = c.rope_parameters
    assert (rp["factor"], rp["beta_fast"], rp["beta_slow"], rp["original_max_position_embeddings"],
            rp["truncate"], c.head_dim) == (32.0, 32.0, 1.0, 4096, False, 64)
    want, attention = ROPE_INIT_FUNCTIONS["yarn"](c, torch.device("cpu"))
    theta, dim = rp["rope_theta"], c.head_dim
    base = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    y = YarnScaling(32.0, 4096, 32.0, 1.0, truncate=False)
    np.testing.assert_allclose(base * yarn_freq_scale(y, dim, theta), want.numpy(), rtol=1e-6)
    rounded = base * yarn_freq_scale(dataclasses.replace(y, truncate=True), dim, theta)
    assert np.abs(rounded / want.numpy() - 1).max() > 0.05
    assert attention == pytest.approx(yarn_mscale(32.0)) == pytest.approx(1 + 0.1 * math.log(32))


@pytest.fixture(scope="module")
def llama_yarn_options(tmp_path_factory):
    """Llama with YaRN's optional keys set: unrounded ramp, other betas, an explicit attention factor."""
    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
            "beta_fast": 8.0, "beta_slow": 0.5, "attention_factor": 1.5, "truncate": False}
    d = make_tiny("llama-yarn", tmp_path_factory.mktemp("yarn") / "options", rope_parameters=rope)
    ids = prompt_ids()
    return d, ids, transformers_logits(d, ids)


def test_yarn_options_from_the_folder(llama_yarn_options):
    d, ids, ref = llama_yarn_options
    lm = load_model(d)
    assert lm.config.rope_yarn == YarnScaling(8.0, 32, 8.0, 0.5, truncate=False) and lm.config.rope_mscale == 1.5
    _check(engine_logits(lm, ids), ref, "llama yarn options, folder")


def test_yarn_options_from_llama_cpp_s_gguf(llama_yarn_options, tmp_path):
    """llama.cpp's converter writes beta_fast, beta_slow and attention_factor (yarn_beta_fast,
    yarn_beta_slow, yarn_attn_factor; llama.cpp's own llama graph then ignores them): read, they
    give transformers' logits, truncate aside (a GGUF has no key for it: rounded)."""
    from tiny_models import llama_cpp_convert, llama_cpp_converter
    script = llama_cpp_converter()
    if script is None:
        pytest.skip("llama.cpp's converter could not be fetched")
    d, ids, ref = llama_yarn_options
    path = llama_cpp_convert(script, d, tmp_path / "x.gguf")
    meta = GGUFFile(path).metadata
    assert meta["llama.rope.scaling.yarn_beta_fast"] == 8.0 and meta["llama.rope.scaling.yarn_attn_factor"] == 1.5
    lm = load_model(path)
    assert lm.config.rope_yarn == YarnScaling(8.0, 32, 8.0, 0.5, truncate=True)
    assert lm.config.rope_mscale == 1.5 and lm.config.context_length == 256
    rounded = edit_config(d, tmp_path / "rounded", rope_parameters={
        **json.loads((d / "config.json").read_text())["rope_parameters"], "truncate": True})
    _check(engine_logits(lm, ids), transformers_logits(rounded, ids), "llama yarn options, llama.cpp GGUF")


def test_our_converter_refuses_yarn_that_gguf_readers_would_run_otherwise(llama_yarn_options, tiny, tmp_path):
    from quant.convert import ConvertError, convert
    d = llama_yarn_options[0]
    with pytest.raises(ConvertError, match="truncate false"):
        convert(d, tmp_path / "x.gguf", "f16", progress=False)
    cfg = json.loads((d / "config.json").read_text())
    e = edit_config(d, tmp_path / "betas", rope_parameters={**cfg["rope_parameters"], "truncate": True})
    with pytest.raises(ConvertError, match="beta_fast 8, beta_slow 0.5, attention factor 1.5"):
        convert(e, tmp_path / "y.gguf", "f16", progress=False)


def test_yarn_attention_factor_from_mscale_and_the_stretched_context():
    """Qwen3's 128k recipe (factor 4 over 32768; max_position_embeddings left at 40960) runs
    to 131072 tokens; DeepSeek-style mscale / mscale_all_dim set the magnitude as transformers."""
    hf = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100,
          "max_position_embeddings": 40960, "rope_theta": 1e6,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    cfg = config_from_hf(hf, {})
    assert cfg.context_length == 131072 and cfg.rope_mscale == pytest.approx(1 + 0.1 * math.log(4))
    hf["rope_scaling"].update(mscale=0.707, mscale_all_dim=1.0)
    assert config_from_hf(hf, {}).rope_mscale == pytest.approx((1 + 0.0707 * math.log(4)) / (1 + 0.1 * math.log(4)))
    assert np.all(rope_inv_freq(cfg, 1e6) <= rope_inv_freq(dataclasses.replace(cfg, rope_yarn=None), 1e6))


# ---- refused ------------------------------------------------------------------------------------------------

def test_gguf_rope_scaling_that_is_refused(tiny, lcpp):
    g = GGUFFile(lcpp("qwen3-yarn"))
    meta, shapes = g.metadata, {n: t.shape for n, t in g.tensors.items()}
    cfg = config_from_gguf(meta, shapes)
    assert cfg.rope_yarn == YarnScaling(4.0, 32) and cfg.rope_mscale == pytest.approx(yarn_mscale(4.0), rel=1e-6)
    config_from_gguf({**meta, "qwen3.rope.scaling.yarn_ext_factor": 1.0}, shapes)     # ggml's default: accepted
    for changes, says in [({"qwen3.rope.scaling.yarn_ext_factor": 0.5}, "yarn_ext_factor"),
                          ({"qwen3.rope.scaling.yarn_log_multiplier": 0.1}, "yarn_log_multiplier"),
                          ({"qwen3.rope.scaling.factor": 0.0}, "without rope.scaling.factor"),
                          ({"qwen3.rope.scaling.type": "longrope"}, "without the rope_factors")]:
        with pytest.raises(UnsupportedModelFile, match=says):
            config_from_gguf({**meta, **changes}, shapes)
    half = (cfg.rope_dim // 2,)
    with pytest.raises(UnsupportedModelFile, match="LongRoPE factors .* are read for phi3 only"):
        config_from_gguf(meta, {**shapes, "rope_factors_long.weight": half, "rope_factors_short.weight": half})
    g = GGUFFile(lcpp("gemma3"))
    with pytest.raises(UnsupportedModelFile, match="'yarn' is implemented for llama"):
        config_from_gguf({**g.metadata, "gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 4.0},
                         {n: t.shape for n, t in g.tensors.items()})
    g = GGUFFile(lcpp("llama3"))        # YaRN on top of llama3's rope_freqs
    with pytest.raises(UnsupportedModelFile, match="YaRN together with rope_freqs"):
        config_from_gguf({**g.metadata, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
                         {n: t.shape for n, t in g.tensors.items()})


def test_gguf_longrope_needs_both_factor_tensors_of_half_the_rotated_dims(lcpp):
    g = GGUFFile(lcpp("phi3-longrope"))
    shapes = {n: t.shape for n, t in g.tensors.items()}
    assert shapes["rope_factors_long.weight"] == shapes["rope_factors_short.weight"] == (4,)
    cfg = config_from_gguf(g.metadata, shapes)
    assert cfg.rope_original_context == 64 and cfg.rope_mscale == pytest.approx(math.sqrt(2), rel=1e-6)
    check_tensors(cfg, shapes, "x.gguf")
    one = {n: s for n, s in shapes.items() if n != "rope_factors_long.weight"}
    with pytest.raises(UnsupportedModelFile, match="lacks tensor rope_factors_long.weight"):
        check_tensors(config_from_gguf(g.metadata, one), one, "x.gguf")
    with pytest.raises(UnsupportedModelFile, match="rope_factors_short.weight has shape"):
        check_tensors(cfg, {**shapes, "rope_factors_short.weight": (8,)}, "x.gguf")
    with pytest.raises(UnsupportedModelFile, match="LongRoPE factors with rope.scaling.type 'linear'"):
        config_from_gguf({**g.metadata, "phi3.rope.scaling.type": "linear", "phi3.rope.scaling.factor": 2.0}, shapes)


def test_hf_longrope_factor_lists_must_fit_the_rotated_dims(tiny, tmp_path):
    d = tiny("phi3-longrope")[0]
    rope = json.loads((d / "config.json").read_text())["rope_parameters"]
    e = edit_config(d, tmp_path / "ck", rope_parameters={**rope, "long_factor": [1.0] * 8})
    with pytest.raises(CheckpointError, match="long_factor must list 4 numbers"):
        load_model(e)


def test_info_says_which_longrope_factors_a_context_takes(tiny, capsys):
    from runtime.cli import main
    folder = tiny("phi3-longrope")[0]
    for ctx, factors in ((64, "short"), (65, "long")):
        assert main(["info", str(folder), "-c", str(ctx), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["rope_scaling"] == {"type": "longrope", "original_context": 64, "factors": factors,
                                        "magnitude": round(math.sqrt(2), 6)}
