"""The families people download today, each as a tiny random-weight checkpoint
made by HF transformers with the real architecture's config: our logits against
transformers on the same weights, read from the safetensors folder, from the GGUF
our converter writes and from the GGUF llama.cpp's own converter writes.

Bar (F16 weights, 96 random tokens): top-1 agreement >= 99%, mean KL <= 1e-3.
Then the strictness: what changes the math and is not implemented is refused.
"""
from __future__ import annotations


import numpy as np
import pytest

from ckpt_helpers import edit_config, engine_logits, kl
from models import UnsupportedModelFile, check_tensors, config_from_gguf
from models.hf_config import CheckpointError
from runtime.context import rope_for_layer
from runtime.gguf_file import GGUFFile
from runtime.loader import load_model
from tiny_models import FAMILIES, make_tiny, prompt_ids

pytest.importorskip("transformers")
MIN_TOP1, MAX_KL = 0.99, 1e-3


def _agree(lm, ids, ref, what, rows=None):
    ours = engine_logits(lm, ids)
    if rows is not None:
        ours, ref = ours[rows], ref[rows]
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    mean_kl = float(kl(ref, ours).mean())
    print(f"{what}: top-1 {top1:.4f}, mean KL {mean_kl:.2e}")
    assert top1 >= MIN_TOP1, f"{what}: top-1 agreement {top1:.3f}"
    assert mean_kl <= MAX_KL, f"{what}: mean KL {mean_kl:.2e}"
    return ours


@pytest.mark.parametrize("family", list(FAMILIES))
def test_safetensors_folder_matches_transformers(tiny, family):
    folder, ids, ref = tiny(family)
    lm = load_model(folder)
    assert lm.config.arch == FAMILIES[family][2]
    assert {t.qtype.name for t in lm.tensors.values() if len(t.shape) == 2} == {"F16"}
    _agree(lm, ids, ref, f"{family} safetensors")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_gguf_matches_transformers(tiny, family, tmp_path):
    from quant.convert import convert
    folder, ids, ref = tiny(family)
    path = tmp_path / f"{family}.gguf"
    convert(folder, path, "f16", progress=False)
    lm = load_model(path)
    assert lm.config.arch == FAMILIES[family][2]
    _agree(lm, ids, ref, f"{family} our GGUF")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_gguf_matches_transformers(tiny, lcpp, family):
    folder, ids, ref = tiny(family)
    lm = load_model(lcpp(family))
    assert lm.config.arch == FAMILIES[family][2]
    if family == "mistral":
        # llama.cpp's converter drops Mistral's sliding_window (llama.cpp runs every layer with
        # full attention), so its file agrees with transformers only inside the window
        assert lm.config.sliding_window == 0
        _agree(lm, ids, ref, f"{family} llama.cpp GGUF", rows=slice(0, 16))
    else:
        _agree(lm, ids, ref, f"{family} llama.cpp GGUF")


def test_llama3_rope_scaling_is_applied(tiny, lcpp):
    """A Llama 3.2-shaped file from llama.cpp's converter carries rope_freqs.weight; we
    divide the frequencies by it.  Without it the same file disagrees with transformers."""
    _, ids, ref = tiny("llama3")
    path = lcpp("llama3")
    g = GGUFFile(path)
    assert "rope_freqs.weight" in g.tensors and g.tensors["rope_freqs.weight"].shape == (8,)
    lm = load_model(path)
    assert "rope_freqs.weight" not in lm.tensors
    factors = lm.config.rope_freq_factors
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0
    inv_freq, neox, _ = rope_for_layer(lm.config, 0)
    assert not neox and np.allclose(inv_freq * factors, rope_for_layer_unscaled(lm.config))
    _agree(lm, ids, ref, "llama3 llama.cpp GGUF")
    lm.config.rope_freq_factors = None       # what we used to do: ignore the tensor
    ours = engine_logits(lm, ids)
    assert float(kl(ref, ours).mean()) > 100 * MAX_KL


def rope_for_layer_unscaled(cfg):
    from models.config import rope_inv_freq
    saved, cfg.rope_freq_factors = cfg.rope_freq_factors, None
    try:
        return rope_inv_freq(cfg, cfg.rope_theta)
    finally:
        cfg.rope_freq_factors = saved


def test_our_gguf_reads_as_llama_cpp_s_does(tiny, lcpp, tmp_path):
    """Our converter's file and llama.cpp's give the same config and the same tensors;
    the one difference is Mistral's sliding window, which we write and llama.cpp's
    converter leaves out (llama.cpp runs Mistral with full attention)."""
    import dataclasses

    from quant.convert import convert
    for family in FAMILIES:
        ours = load_model(convert(tiny(family)[0], tmp_path / f"{family}.gguf", "f16", progress=False)["path"])
        theirs = load_model(lcpp(family))
        assert set(ours.tensors) == set(theirs.tensors), family
        a, b = (dataclasses.replace(lm.config, name="") for lm in (ours, theirs))
        if family == "mistral":
            assert (a.sliding_window, b.sliding_window) == (16, 0)
            a.sliding_window = 0
        assert a == b, family
        for divisors in ("rope_freq_factors", "rope_factors_short", "rope_factors_long"):
            x, y = getattr(a, divisors), getattr(b, divisors)
            assert np.array_equal(x, y) if y is not None else x is None, (family, divisors)


def test_layers_without_rope_shift_without_rotation(tiny):
    lm = load_model(tiny("smollm3")[0])
    assert lm.config.nope_layers == (3,)
    assert not rope_for_layer(lm.config, 3)[0].any() and rope_for_layer(lm.config, 2)[0].all()


@pytest.mark.parametrize("family,overrides", [("llama3", {}), ("smollm3", {"no_rope_layers": [0, 1, 1, 1]}),
                                               ("qwen3-yarn", {}), ("phi3-longrope", {})])
def test_context_shift_rerotates_keys_as_the_forward_rotates_them(tmp_path, family, overrides):
    """After a context shift, layer 0's keys (which depend only on token and position)
    equal a fresh prefill's: rope_for_layer knows the llama3 factors, YaRN's ramp and the
    LongRoPE factors the engine chose, a shift does not apply YaRN's / LongRoPE's magnitude
    a second time, and a layer without RoPE (here SmolLM3's layer 0) is moved, not rotated."""
    from runtime.engine import Engine
    lm = load_model(make_tiny(family, tmp_path / family, **overrides))
    eng = Engine(lm, n_ctx=128, overflow="shift")
    bs, P, keep, n_discard = eng.block_size, prompt_ids()[:60], 5, 21
    seq = eng.new_sequence()
    seq.keep = keep
    eng.prefill(seq, P)
    eng.shift(seq, n_discard)
    fresh = Engine(lm, n_ctx=128)
    s2 = fresh.new_sequence()
    fresh.step([s2], [seq.tokens])

    def k0(e, s):
        t = np.asarray(s.blocks)
        pos = np.arange(len(s))
        return e.storage.k[0][t[pos // bs] * bs + pos % bs].view(np.float16).astype(np.float32)
    want = k0(fresh, s2)
    np.testing.assert_allclose(k0(eng, seq), want, atol=0.01 * np.abs(want).max())


def test_mistral_window_reaches_the_engine(tiny):
    from runtime.engine import Engine
    lm = load_model(tiny("mistral")[0])
    assert lm.config.sliding_window == 16
    assert Engine(lm, n_ctx=64).windows == [16] * 4


# ---- refusing what we do not implement ---------------------------------------------------------------------

@pytest.mark.parametrize("family,rope", [
    ("llama3", {"rope_type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8, "rope_theta": 10000.0,
                "original_max_position_embeddings": 1024}),
    ("llama3", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    ("gemma3", {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                   "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
])
def test_unimplemented_rope_scaling_is_refused(tiny, tmp_path, family, rope):
    """LongRoPE outside Phi-3, dynamic NTK, YaRN on Gemma 3's global layers."""
    d = edit_config(tiny(family)[0], tmp_path / "ck", rope_parameters=rope)
    kind = rope.get("rope_type") or rope["full_attention"]["rope_type"]
    with pytest.raises(CheckpointError, match=f"rope scaling type '{kind}' is not implemented"):
        load_model(d)


def test_unknown_activation_is_refused(tiny, tmp_path):
    d = edit_config(tiny("qwen3")[0], tmp_path / "ck", hidden_act="gelu")
    with pytest.raises(CheckpointError, match="activation 'gelu'"):
        load_model(d)


def test_unknown_gguf_metadata_is_refused(tiny, lcpp):
    g = GGUFFile(lcpp("qwen3"))
    shapes = {n: t.shape for n, t in g.tensors.items()}
    config_from_gguf(g.metadata, shapes)
    for key, value, says in [("qwen3.attention.logit_softcapping", 30.0, "logit_softcapping"),
                             ("qwen3.expert_count", 8, "expert_count"),
                             ("qwen3.rope.scaling.type", "dynamic", "'dynamic' is not implemented"),
                             ("qwen3.rope.scaling.yarn_log_multiplier", 0.1, "yarn_log_multiplier")]:
        with pytest.raises(UnsupportedModelFile, match=says):
            config_from_gguf({**g.metadata, key: value}, shapes)
    # what older converters write and changes nothing is accepted
    config_from_gguf({**g.metadata, "qwen3.expert_count": 0, "qwen3.attention.causal": True,
                      "qwen3.tensor_data_layout": "Meta AI original pth"}, shapes)
    with pytest.raises(UnsupportedModelFile, match="attention.causal"):
        config_from_gguf({**g.metadata, "qwen3.attention.causal": False}, shapes)


def test_unknown_gguf_tensor_is_refused(tiny, lcpp):
    g = GGUFFile(lcpp("llama3"))
    shapes = {n: t.shape for n, t in g.tensors.items()}
    cfg = config_from_gguf(g.metadata, shapes)
    check_tensors(cfg, shapes, "x.gguf")
    with pytest.raises(UnsupportedModelFile, match="blk.1.attn_output.bias is not part of a llama model"):
        check_tensors(cfg, {**shapes, "blk.1.attn_output.bias": (64,)}, "x.gguf")
    missing = dict(shapes)
    del missing["blk.2.ffn_up.weight"]
    with pytest.raises(UnsupportedModelFile, match="lacks tensor blk.2.ffn_up.weight"):
        check_tensors(cfg, missing, "x.gguf")


def test_attention_bias_checkpoint_is_refused(tmp_path):
    """Llama with attention_bias also has an o_proj bias, which our llama does not add."""
    d = make_tiny("llama3", tmp_path / "ck", attention_bias=True)
    with pytest.raises(CheckpointError, match="unexpected tensors.*o_proj.bias"):
        load_model(d)


def test_smollm3_odd_nope_pattern_loads_but_does_not_convert(tmp_path):
    from quant.convert import ConvertError, convert
    d = make_tiny("smollm3", tmp_path / "ck", no_rope_layers=[1, 0, 1, 1])
    assert load_model(d).config.nope_layers == (1,)
    with pytest.raises(ConvertError, match="every 4th layer"):
        convert(d, tmp_path / "x.gguf", "f16", progress=False)


def test_phi3_fused_weights_split_into_views(tiny):
    lm = load_model(tiny("phi3")[0])
    t = lm.tensors
    assert "blk.0.attn_qkv.weight" not in t and t["blk.0.attn_q.weight"].shape == (64, 64)
    assert t["blk.0.attn_k.weight"].shape == t["blk.0.attn_v.weight"].shape == (32, 64)
    assert t["blk.0.ffn_gate.weight"].shape == t["blk.0.ffn_up.weight"].shape == (128, 64)
    assert lm.config.rope_dim == 8 and lm.config.rope_neox and lm.config.sliding_window == 16
