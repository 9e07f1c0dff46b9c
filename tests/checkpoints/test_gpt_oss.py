"""gpt-oss beyond what test_tiny_families checks for every family (F16 from the safetensors
folder, our GGUF and llama.cpp's GGUF against transformers): its pieces against
transformers' own code (router, clamped SwiGLU, experts with biases), BF16 and Q8_0
files, what the sinks, the window and the clamp each change, greedy generation, batch
invariance, the parameter counts `info` shows, and the refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ckpt_helpers import (assert_batch_invariant, assert_verify_rows_equal_single_steps, edit_config,
                          engine_logits, kl)
from models import UnsupportedModelFile, check_tensors, config_from_gguf
from models.hf_config import CheckpointError
from runtime.gguf_file import GGUFFile
from runtime.loader import load_model
from tiny_models import make_tiny, prompt_ids, transformers_logits

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
MIN_TOP1, MAX_KL = 0.99, 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny gpt-oss checkpoint (8 experts, 2 a token, window 8), its prompt and transformers' logits."""
    d = make_tiny("gptoss", tmp_path_factory.mktemp("gptoss") / "gptoss")
    ids = prompt_ids()
    return d, ids, transformers_logits(d, ids)


def _agree(ours, ref, what, min_top1=MIN_TOP1, max_kl=MAX_KL):
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    mean_kl = float(kl(ref, ours).mean())
    print(f"{what}: top-1 {top1:.4f}, mean KL {mean_kl:.2e}")
    assert top1 >= min_top1, f"{what}: top-1 agreement {top1:.3f}"
    assert mean_kl <= max_kl, f"{what}: mean KL {mean_kl:.2e}"
    return top1, mean_kl


# ---- the pieces against transformers' code ---------------------------------------------------------------------

def _hf_config(**kw):
    import transformers
    return transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8,
                                     num_experts_per_tok=3, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, **kw)


def test_router_is_softmax_top_k_renormalized():
    """gpt-oss's router (top k of the biased logits, then a softmax over those k) is the
    moe op's softmax routing with the top k renormalized (moe.py)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from runtime.backend import moe
    torch.manual_seed(0)
    router = GptOssTopKRouter(_hf_config())
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.bias.normal_(0, 0.5)
    x = torch.randn(50, 64)
    with torch.no_grad():
        logits, scores, idx = router(x)
    w, tokens, starts, pos = moe.plan(logits.numpy(), 3, True)
    order = np.argsort(idx.numpy(), axis=-1)          # ours come in ascending expert order
    np.testing.assert_array_equal(np.sort(idx.numpy(), -1),
                                  np.array([[e for e in range(8) if t in tokens[starts[e]:starts[e + 1]]]
                                            for t in range(50)]))
    np.testing.assert_allclose(w, np.take_along_axis(scores.numpy(), order, -1), rtol=1e-6, atol=1e-7)


def test_clamped_swiglu_matches_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from runtime.backend.cpu import CPUBackend
    experts = GptOssExperts(_hf_config())
    rng = np.random.default_rng(1)
    gu = (rng.standard_normal((7, 200)) * 6).astype(np.float32)     # well past the clamp at 7
    want = experts._apply_gate(torch.from_numpy(gu)).numpy()
    g, u = np.ascontiguousarray(gu[:, ::2]), np.ascontiguousarray(gu[:, 1::2])
    got = CPUBackend().glu(g, u, "swiglu_oai")
    assert (np.abs(gu) > 7).mean() > 0.2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_moe_op_matches_transformers_experts(qtype):
    """The CPU moe op with gpt-oss's options against transformers' GptOssMLP (router with
    bias, experts with biases, clamped SwiGLU) on the same weights, HF's gate_up cut into
    GGUF's gate and up as the loaders cut it."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from models.hf_config import parts
    from quant import GGMLType, QTensor, quantize
    from runtime.backend.cpu import CPUBackend
    torch.manual_seed(2)
    mlp = GptOssMLP(_hf_config())
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)
        mlp.experts.gate_up_proj.mul_(6)        # some gate/up values beyond the clamp
    x = torch.randn(20, 64)
    with torch.no_grad():
        want = mlp(x[None])[0][0].numpy()
    be = CPUBackend()
    sd = {k: v.detach().numpy() for k, v in mlp.state_dict().items()}

    def up(name, a, t=GGMLType[qtype]):
        a = np.ascontiguousarray(a, np.float32)
        return be.upload(QTensor(name, t, a.shape, quantize(a.reshape(-1, a.shape[-1]), t)))
    cut = {}
    for hf, key in (("model.layers.0.mlp.experts.gate_up_proj", "experts.gate_up_proj"),
                    ("model.layers.0.mlp.experts.gate_up_proj_bias", "experts.gate_up_proj_bias"),
                    ("model.layers.0.mlp.experts.down_proj", "experts.down_proj")):
        for g, part in parts(hf, "gpt-oss"):
            cut[g.split(".", 2)[2]] = part.apply(sd[key])
    experts = tuple(up(n, cut[f"ffn_{n}_exps.weight"]) for n in ("gate", "up", "down"))
    biases = (cut["ffn_gate_exps.bias"], cut["ffn_up_exps.bias"], sd["experts.down_proj_bias"])
    got = be.moe(x.numpy(), up("router", sd["router.weight"], GGMLType.F32), experts, 3, True,
                 router_bias=sd["router.bias"], biases=tuple(np.ascontiguousarray(b, np.float32) for b in biases),
                 glu="swiglu_oai")
    tol = 1e-4 if qtype == "F32" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


# ---- files against transformers --------------------------------------------------------------------------------

def test_what_each_piece_changes(tiny):
    """Without the sinks, with every layer unwindowed, without the clamp, with YaRN's ramp
    ends rounded (ggml's way) or without YaRN, the tiny model's logits part from
    transformers': each piece is exercised by the prompt."""
    import dataclasses
    from runtime.backend import cpu as cpu_be
    from runtime.engine import Engine
    d, ids, ref = tiny
    lm = load_model(d)
    _agree(engine_logits(lm, ids), ref, "gptoss")

    def drift(eng):
        out = eng.step([eng.new_sequence()], [ids], all_logits=True)
        return float(kl(ref, out).mean())
    eng = Engine(lm, n_ctx=256)
    for L in eng.model.layers:
        L["attn_sinks"][:] = -1e30
    assert drift(eng) > 30 * MAX_KL
    eng = Engine(lm, n_ctx=256)
    eng.windows = [0] * lm.config.n_layers
    assert drift(eng) > 30 * MAX_KL
    cfg = lm.config
    assert cfg.rope_yarn is not None and not cfg.rope_yarn.truncate and abs(cfg.rope_mscale - 1.3466) < 1e-4
    for what, changed in (("rounded", dict(rope_yarn=dataclasses.replace(cfg.rope_yarn, truncate=True))),
                          ("no yarn", dict(rope_yarn=None, rope_mscale=1.0))):
        lm.config = dataclasses.replace(cfg, **changed)
        try:
            assert drift(Engine(lm, n_ctx=256)) > 3 * MAX_KL, what     # (measured: 0.032, 0.39)
        finally:
            lm.config = cfg
    saved = cpu_be._GLU["swiglu_oai"]
    try:      # the same GLU without the clamp
        cpu_be._GLU["swiglu_oai"] = _unclamped
        assert drift(Engine(lm, n_ctx=256)) > 3 * MAX_KL
    finally:
        cpu_be._GLU["swiglu_oai"] = saved


def _unclamped(g, u):
    g[:] = (u + 1) * g / (1 + np.exp(-1.702 * g))


def test_bf16_checkpoint_and_gguf(tmp_path):
    from quant.convert import convert
    d = make_tiny("gptoss", tmp_path / "ck", dtype="bfloat16")
    ids = prompt_ids()
    ref = transformers_logits(d, ids)
    lm = load_model(d)
    assert {t.qtype.name for n, t in lm.tensors.items() if n.endswith("_exps.weight")} == {"BF16"}
    _agree(engine_logits(lm, ids), ref, "gptoss bf16 safetensors")
    g = GGUFFile(convert(d, tmp_path / "bf16.gguf", "bf16", progress=False)["path"])
    for n in ("ffn_gate_inp.weight", "ffn_gate_exps.bias", "ffn_down_exps.bias", "attn_sinks.weight"):
        assert g.tensors[f"blk.0.{n}"].ggml_type == 0                 # F32, as llama.cpp's converter writes them
    _agree(engine_logits(load_model(g.path), ids), ref, "gptoss bf16 GGUF")


def test_q8_0_gguf_against_transformers_on_the_same_rounded_weights(tiny, tmp_path):
    """A Q8_0 file against transformers running the weights as the file rounds them.  This
    random model is sensitive to rounding (transformers itself, fed the Q8_0-rounded
    weights, moves from its F16 logits by mean KL 0.032, top-1 0.833: measured), so the
    F16 logits are no fair bar; what remains against the rounded weights is ours: int8
    activations into the matmuls, as llama.cpp's CPU path (measured KL 0.014, top-1 0.896;
    against the F16 logits 0.031, 0.833); and the file holds the bytes that quantizing on
    load gives."""
    from transformers import AutoModelForCausalLM

    from quant import GGMLType, QTensor, dequantize, quantize
    from quant.convert import convert
    d, ids, ref = tiny
    lm = load_model(convert(d, tmp_path / "q8.gguf", "q8_0", progress=False)["path"])
    assert lm.tensors["blk.0.ffn_gate_exps.weight"].qtype.name == "Q8_0"
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")

    def rounded(a):         # rows along the last axis, as GGUF stores them
        q = quantize(np.ascontiguousarray(a.reshape(-1, a.shape[-1])), GGMLType.Q8_0)
        return dequantize(QTensor("x", GGMLType.Q8_0, (a.size // a.shape[-1], a.shape[-1]), q)).reshape(a.shape)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim < 2 or n.endswith("router.weight"):      # (F32 in the file)
                continue
            a = p.numpy()
            experts = n.endswith(("gate_up_proj", "down_proj"))      # HF keeps these as x @ W
            a = rounded(a.swapaxes(-1, -2)).swapaxes(-1, -2) if experts else rounded(a)
            p.copy_(torch.from_numpy(np.ascontiguousarray(a)))
        refq = m(torch.tensor([ids])).logits[0].numpy()
    ours = engine_logits(lm, ids)
    print(f"gptoss transformers on the Q8_0-rounded weights vs F16: top-1 "
          f"{(refq.argmax(-1) == ref.argmax(-1)).mean():.4f}, mean KL {kl(ref, refq).mean():.2e}")
    _agree(ours, ref, "gptoss q8_0 GGUF vs F16 transformers", 0.7, 0.08)
    _agree(ours, refq, "gptoss q8_0 GGUF vs transformers on its rounded weights", 0.8, 0.05)
    on_load = load_model(d, quant="int8")
    for n, t in on_load.tensors.items():
        assert np.array_equal(lm.tensors[n].data, t.data), n


def test_greedy_generation_equals_transformers(tiny):
    """16 greedy tokens after the 96-token prompt (every step past the window of 8)."""
    from transformers import AutoModelForCausalLM

    from runtime.engine import Engine
    d, ids, _ = tiny
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                         pad_token_id=0)
    want = out[0, len(ids):].tolist()
    eng = Engine(load_model(d), n_ctx=256)
    seq = eng.new_sequence()
    t = int(eng.prefill(seq, ids).argmax())
    got = [t]
    for _ in range(15):
        t = int(eng.step([seq], [[t]])[0].argmax())
        got.append(t)
    assert got == want


# ---- batch invariance ----------------------------------------------------------------------------------------

def test_batched_decode_gives_each_sequence_its_own_logits(tiny):
    """B sequences decoding together get bit for bit what each gets alone (a row's sinks,
    window and experts do not depend on the other rows)."""
    from runtime.engine import Engine
    d, _, _ = tiny
    eng = Engine(load_model(d), n_ctx=256)
    prompts = [prompt_ids(seed)[:n] for seed, n in ((1, 20), (2, 33), (3, 7), (4, 50), (5, 12))]
    assert_batch_invariant(eng, prompts)


def test_verify_rows_equal_single_steps(tiny):
    from runtime.engine import Engine
    d, ids, _ = tiny
    assert_verify_rows_equal_single_steps(Engine(load_model(d), n_ctx=256), ids)


def test_fused_k_quant_experts_with_biases_equal_the_expert_by_expert_path(tmp_path):
    """Q4_K_M experts (rows of 256) take quant/moe_cpu.py's fused kernels: the biases and
    the clamped SwiGLU there give bit for bit the expert-by-expert path's logits."""
    from quant.convert import convert
    from runtime.engine import Engine
    d = make_tiny("gptoss", tmp_path / "ck", hidden_size=256, intermediate_size=256)
    lm = load_model(convert(d, tmp_path / "q4.gguf", "q4_k_m", progress=False)["path"])
    assert lm.tensors["blk.0.ffn_gate_exps.weight"].qtype.name == "Q4_K"
    ids = prompt_ids()[:12]
    out = {}
    for fused in (True, False):
        eng = Engine(lm, n_ctx=64)
        eng.backend.moe_fused = fused
        out[fused] = eng.step([eng.new_sequence()], [ids], all_logits=True)
    assert np.array_equal(out[True], out[False])


# ---- what info shows -----------------------------------------------------------------------------------------

def test_info_shows_total_and_active_parameters(tiny, capsys):
    from runtime.cli import main
    d, _, _ = tiny
    lm = load_model(d)
    cfg = lm.config
    per_expert = 3 * cfg.d_model * cfg.d_ff_expert + 2 * cfg.d_ff_expert + cfg.d_model   # weights and biases
    experts = sum(int(np.prod(t.shape)) for n, t in lm.tensors.items() if "_exps." in n)
    assert experts == cfg.n_layers * cfg.n_experts * per_expert
    assert lm.n_active_params == lm.n_params - cfg.n_layers * (cfg.n_experts - cfg.n_experts_used) * per_expert
    assert main(["info", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "gpt-oss"
    assert info["parameters"] == lm.n_params and info["active_parameters"] == lm.n_active_params
    assert info["experts"]["count"] == 8 and info["experts"]["used"] == 2


# ---- refusing what we do not implement ---------------------------------------------------------------------

@pytest.mark.parametrize("changes,match", [
    ({"swiglu_limit": 10.0}, "swiglu_limit"),
    ({"swiglu_alpha": 1.0}, "swiglu_alpha"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]},
     "chunked_attention"),
])
def test_unimplemented_configs_are_refused(tiny, tmp_path, changes, match):
    d = edit_config(tiny[0], tmp_path / "ck", **changes)
    with pytest.raises(CheckpointError, match=match):
        load_model(d)


def test_gguf_strictness_and_layer_pattern(tiny, tmp_path):
    """Keys llama.cpp's gpt-oss reads that we do not implement are refused; the window
    pattern as llama.cpp spells it (default 2, a number, or a per-layer array); our
    converter writes a non-default pattern as the array, which reads back."""
    from quant.convert import convert
    g = GGUFFile(convert(tiny[0], tmp_path / "f16.gguf", "f16", progress=False)["path"])
    meta = g.metadata
    assert "gpt-oss.attention.sliding_window_pattern" not in meta        # the default, as llama.cpp's converter
    shapes = {n: t.shape for n, t in g.tensors.items()}
    cfg = config_from_gguf(meta, shapes)
    assert (cfg.sliding_window, cfg.local_layers, cfg.expert_glu) == (8, (0, 2), "swiglu_oai")
    check_tensors(cfg, shapes, "x.gguf")
    assert config_from_gguf({**meta, "gpt-oss.attention.sliding_window_pattern": 4}, shapes).local_layers == (0, 1, 2)
    assert config_from_gguf({**meta, "gpt-oss.attention.sliding_window_pattern": [False, True, True, False]},
                            shapes).local_layers == (1, 2)
    for key, value in [("gpt-oss.rope.freq_base_swa", 10000.0), ("gpt-oss.expert_gating_func", 3),
                       ("gpt-oss.expert_weights_scale", 2.0)]:
        with pytest.raises(UnsupportedModelFile, match=key.split(".", 1)[1]):
            config_from_gguf({**meta, key: value}, shapes)
    missing = dict(shapes)
    del missing["blk.1.attn_sinks.weight"]
    with pytest.raises(UnsupportedModelFile, match="lacks tensor blk.1.attn_sinks.weight"):
        check_tensors(cfg, missing, "x.gguf")
    d = edit_config(tiny[0], tmp_path / "ck",
                    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    g2 = GGUFFile(convert(d, tmp_path / "p.gguf", "f16", progress=False)["path"])
    assert list(g2.metadata["gpt-oss.attention.sliding_window_pattern"]) == [False, True, True, False]
    assert load_model(g2.path).config.local_layers == (1, 2)


# ---- MXFP4: gpt-oss's own checkpoint format --------------------------------------------------------------------

def mxfp4_checkpoint(src, dst):
    """gpt-oss's own checkpoint layout from a float one: the experts' gate_up_proj and
    down_proj as MXFP4 `*_blocks` (uint8 [E, rows, cols / 32, 16], element 2i in byte i's low
    nibble) and `*_scales` (E8M0 [E, rows, cols / 32]), rows as GGUF has them, and
    config.json's quantization_config, as openai/gpt-oss-20b ships."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from quant import GGMLType, quantize
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    for k in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        a = np.ascontiguousarray(t.pop(k).astype(np.float32).swapaxes(-1, -2))      # [E, rows, cols]
        E, rows, cols = a.shape
        g = quantize(a.reshape(-1, cols), GGMLType.MXFP4).reshape(E * rows, cols // 32, 17)   # ggml blocks
        q = np.concatenate([g[:, :, 1:] & 15, g[:, :, 1:] >> 4], axis=-1)          # the 32 codes in order
        t[k + "_blocks"] = np.ascontiguousarray((q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(E, rows, -1, 16))
        t[k + "_scales"] = np.ascontiguousarray(g[:, :, 0].reshape(E, rows, -1))
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def mxfp4(tiny, tmp_path_factory):
    d = mxfp4_checkpoint(tiny[0], tmp_path_factory.mktemp("mxfp4") / "ck")
    ids = tiny[1]
    return d, ids, transformers_logits(d, ids)       # (transformers dequantizes MXFP4 on the CPU)


def test_mxfp4_checkpoint_runs_as_transformers_runs_it(mxfp4, tmp_path):
    """openai/gpt-oss's own layout: the experts load as MXFP4 blocks, bits moved only; against
    transformers on the same folder (it dequantizes them exactly), what remains is the int8
    activations the MXFP4 kernels take, as llama.cpp's (measured: top-1 0.885, mean KL 0.0093);
    as F16 (the blocks dequantized on conversion) it is transformers' exactly."""
    from quant.convert import convert
    d, ids, ref = mxfp4
    lm = load_model(d)
    assert {lm.tensors[f"blk.0.ffn_{p}_exps.weight"].qtype.name for p in ("gate", "up", "down")} == {"MXFP4"}
    _agree(engine_logits(lm, ids), ref, "gptoss MXFP4 folder", 0.85, 0.02)
    f16 = convert(d, tmp_path / "f16.gguf", "f16", progress=False)["path"]
    _agree(engine_logits(load_model(f16), ids), ref, "gptoss MXFP4 folder -> F16 GGUF")
    ours = load_model(convert(d, tmp_path / "mx.gguf", "mxfp4_moe", progress=False)["path"])
    for n, t in lm.tensors.items():
        if n.endswith("_exps.weight"):
            assert ours.tensors[n].qtype.name == "MXFP4" and np.array_equal(ours.tensors[n].data, t.data), n


def test_llama_cpp_converts_the_mxfp4_checkpoint_to_the_same_blocks(mxfp4, tmp_path):
    """llama.cpp's converter repacks gpt-oss's MXFP4 blocks itself (the files people
    download are made so): its GGUF holds the blocks we read from the folder, byte for byte,
    and runs as the folder does."""
    from tiny_models import llama_cpp_convert, llama_cpp_converter
    script = llama_cpp_converter()
    if script is None:
        pytest.skip("llama.cpp's converter could not be fetched")
    d, ids, ref = mxfp4
    lm = load_model(d)
    theirs = load_model(llama_cpp_convert(script, d, tmp_path / "lcpp.gguf"))
    for n, t in lm.tensors.items():
        if n.endswith("_exps.weight"):
            assert theirs.tensors[n].qtype.name == "MXFP4" and np.array_equal(theirs.tensors[n].data, t.data), n
    ours = engine_logits(lm, ids)
    assert np.array_equal(engine_logits(theirs, ids), ours) or float(kl(ours, engine_logits(theirs, ids)).mean()) < 1e-6


def test_fused_mxfp4_experts_with_biases_equal_the_expert_by_expert_path(mxfp4):
    """MXFP4 experts take quant/moe_cpu.py's fused kernels (the 32-element family): with the
    biases and the clamped SwiGLU, a step of up to exact_rows tokens gives bit for bit the
    expert-by-expert path's logits."""
    from runtime.engine import Engine
    d, ids, _ = mxfp4
    lm = load_model(d)
    out = {}
    for fused in (True, False):
        eng = Engine(lm, n_ctx=64)
        eng.backend.moe_fused = fused
        out[fused] = eng.step([eng.new_sequence()], [ids[:12]], all_logits=True)
    assert np.array_equal(out[True], out[False])
