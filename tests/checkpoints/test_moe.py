"""Qwen3-MoE (mixture of experts) beyond what test_tiny_families checks for every family
(F16 from the safetensors folder, our GGUF and llama.cpp's GGUF against transformers):
the routing itself, BF16 and quantized files, batch invariance of the `moe` op, the
parameter counts `info` shows, and the refusals (what would change the math and is
not implemented)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ckpt_helpers import (assert_batch_invariant, assert_verify_rows_equal_single_steps, edit_config,
                          engine_logits, kl)
from models import UnsupportedModelFile, check_tensors, config_from_gguf
from models.hf_config import CheckpointError
from runtime.backend import moe
from runtime.gguf_file import GGUFFile
from runtime.loader import load_model
from tiny_models import make_tiny, prompt_ids, transformers_logits

pytest.importorskip("transformers")
MIN_TOP1, MAX_KL = 0.99, 1e-3
# against transformers on the F16 weights, as test_safetensors_checkpoint's QUANT_BOUNDS:
# scheme -> (max mean KL, min top-1)
QUANT_BOUNDS = {"q8_0": (0.01, 0.95), "q4_k_m": (0.4, 0.6)}


@pytest.fixture(scope="module")
def moe_tiny(tmp_path_factory):
    """The tiny Qwen3-MoE checkpoint (8 experts, 2 a token), its prompt and transformers' logits."""
    d = make_tiny("qwen3moe", tmp_path_factory.mktemp("moe") / "qwen3moe")
    ids = prompt_ids()
    return d, ids, transformers_logits(d, ids)


def _agree(ours, ref, what, min_top1=MIN_TOP1, max_kl=MAX_KL):
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    mean_kl = float(kl(ref, ours).mean())
    print(f"{what}: top-1 {top1:.4f}, mean KL {mean_kl:.2e}")
    assert top1 >= min_top1, f"{what}: top-1 agreement {top1:.3f}"
    assert mean_kl <= max_kl, f"{what}: mean KL {mean_kl:.2e}"


# ---- routing ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm", [True, False])
def test_routing_and_grouping_match_a_plain_reference(norm):
    rng = np.random.default_rng(0)
    n, E, k = 37, 16, 4
    logits = rng.normal(size=(n, E)).astype(np.float32)
    w, tokens, starts, pos = moe.plan(logits, k, norm)
    p = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.sort(np.argsort(-p, axis=-1, kind="stable")[:, :k], axis=-1)    # ascending expert ids
    want_w = np.take_along_axis(p, top, -1)
    if norm:
        want_w /= want_w.sum(-1, keepdims=True)
    np.testing.assert_allclose(w, want_w, rtol=1e-6)
    # every expert's run holds exactly the tokens that chose it, in token order
    for e in range(E):
        run = tokens[starts[e]:starts[e + 1]]
        assert run.tolist() == [t for t in range(n) if e in top[t]]
    # and pos points each (token, slot) at its place in the runs
    for t in range(n):
        for j in range(k):
            r = pos[t, j]
            assert tokens[r] == t and starts[top[t, j]] <= r < starts[top[t, j] + 1]
    # a decode step (one token) runs only its k experts
    _, _, starts1, _ = moe.plan(logits[:1], k, norm)
    assert int((np.diff(starts1) > 0).sum()) == k


@pytest.mark.parametrize("norm", [True, False])
def test_prompt_rows_routed_in_parallel_get_the_serial_bits(norm):
    """From moe.ROUTE_PAR_ROWS rows on, route_group routes the rows in parallel: every row's
    experts and weights are those of the one-row-at-a-time route, bit for bit (the GPU's
    routing kernel is held to the same operations)."""
    rng = np.random.default_rng(1)
    n, E, k = 300, 128, 8
    assert n >= moe.ROUTE_PAR_ROWS
    from runtime.warmup import WARMUP_ROWS
    assert moe.ROUTE_PAR_ROWS <= max(WARMUP_ROWS)         # route_par compiles in the warm-up
    logits = (rng.normal(size=(n, E)) * 3).astype(np.float32)
    logits[7] = 0.5                                    # ties throughout a row
    w, tokens, starts, pos = moe.plan(logits, k, norm)
    ids, want = np.empty((n, k), np.int32), np.empty((n, k), np.float32)
    moe.route(logits, k, norm, ids, want)
    assert np.array_equal(w.view(np.int32), want.view(np.int32))
    assert np.array_equal(np.sort(np.repeat(np.arange(E), np.diff(starts))), np.sort(ids.reshape(-1)))
    assert ids[7].tolist() == list(range(k))


# ---- files against transformers ------------------------------------------------------------------------------

def test_norm_topk_false_matches_transformers_and_does_not_convert(tmp_path):
    """norm_topk_prob false (the top-k weights as softmax gave them) runs from the folder;
    a GGUF could not say it (llama.cpp's qwen3moe always renormalizes): refused."""
    from quant.convert import ConvertError, convert
    d = make_tiny("qwen3moe", tmp_path / "ck", norm_topk_prob=False)
    ids = prompt_ids()
    lm = load_model(d)
    assert lm.config.expert_norm_topk is False
    _agree(engine_logits(lm, ids), transformers_logits(d, ids), "qwen3moe norm_topk_prob=false")
    with pytest.raises(ConvertError, match="norm_topk_prob"):
        convert(d, tmp_path / "x.gguf", "f16", progress=False)


def test_bf16_checkpoint_and_gguf_match_transformers(tmp_path):
    from quant.convert import convert
    d = make_tiny("qwen3moe", tmp_path / "ck", dtype="bfloat16")
    ids = prompt_ids()
    ref = transformers_logits(d, ids)
    lm = load_model(d)
    assert {t.qtype.name for n, t in lm.tensors.items() if n.endswith("_exps.weight")} == {"BF16"}
    _agree(engine_logits(lm, ids), ref, "qwen3moe bf16 safetensors")
    path = convert(d, tmp_path / "bf16.gguf", "bf16", progress=False)["path"]
    g = GGUFFile(path)
    assert g.tensors["blk.0.ffn_gate_inp.weight"].ggml_type == 0       # the router stays F32, as llama.cpp
    _agree(engine_logits(load_model(path), ids), ref, "qwen3moe bf16 GGUF")


@pytest.fixture(scope="module")
def moe_k_quant(tmp_path_factory):
    """A Qwen3-MoE checkpoint with rows of whole 256-element super-blocks, so that the
    Q4_K_M mix quantizes the experts as Q4_K / Q6_K (at d_model 64 they fall back to Q5_0)."""
    d = make_tiny("qwen3moe", tmp_path_factory.mktemp("moe") / "k", hidden_size=256, moe_intermediate_size=256,
                  head_dim=64)
    ids = prompt_ids()
    return d, ids, transformers_logits(d, ids)


@pytest.mark.parametrize("scheme", list(QUANT_BOUNDS))
def test_quantized_gguf_stays_close(moe_k_quant, tmp_path, scheme):
    from quant.convert import convert
    d, ids, ref = moe_k_quant
    path = convert(d, tmp_path / f"{scheme}.gguf", scheme, progress=False)["path"]
    g = GGUFFile(path)
    types = [g.tensors[f"blk.{i}.{n}.weight"].ggml_type for i in (0, 1)
             for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
    if scheme == "q8_0":
        assert set(types) == {8}                                                # Q8_0
    else:   # Q4_K, and Q6_K for ffn_down_exps in the layers llama.cpp gives more bits (here the last)
        assert types == [12, 12, 12, 12, 12, 14]
    lm = load_model(path)
    max_kl, min_top1 = QUANT_BOUNDS[scheme]
    _agree(engine_logits(lm, ids), ref, f"qwen3moe {scheme} GGUF", min_top1, max_kl)
    on_load = load_model(d, quant={"q8_0": "int8", "q4_k_m": "int4"}[scheme])
    for n, t in on_load.tensors.items():      # the same bytes as quantizing on load
        assert np.array_equal(lm.tensors[n].data, t.data), n


def test_mxfp4_moe_gguf_stays_close(moe_k_quant, tmp_path):
    """llama.cpp's MXFP4_MOE mix (gpt-oss's files): experts MXFP4, every other matrix Q8_0;
    written by our converter, loaded as blocks and run through the fused expert kernels,
    within the 4-bit mix's bounds of transformers' logits on the float weights."""
    from quant.convert import convert
    d, ids, ref = moe_k_quant
    path = convert(d, tmp_path / "mxfp4.gguf", "mxfp4_moe", progress=False)["path"]
    g = GGUFFile(path)
    assert g.get("general.file_type") == 38
    for name, t in g.tensors.items():
        if len(t.shape) == 3:
            assert t.ggml_type == 39, name                                     # MXFP4
        elif len(t.shape) == 2 and not name.endswith("ffn_gate_inp.weight"):
            assert t.ggml_type == 8, name                                      # Q8_0
    lm = load_model(path)
    # measured: top-1 0.80, mean KL 2.5e-3 (q4_k_m's mix: 0.73, 8.7e-3)
    _agree(engine_logits(lm, ids), ref, "qwen3moe mxfp4_moe GGUF", 0.7, 0.01)


# ---- batch invariance ----------------------------------------------------------------------------------------

def test_batched_decode_gives_each_sequence_its_own_logits(moe_tiny):
    """Up to exact_rows (16) rows, a row's logits do not depend on what else is in the
    step: B sequences decoding together get bit for bit what each gets alone, though
    their tokens share experts (an expert's run holds rows of several sequences)."""
    from runtime.engine import Engine
    d, _, _ = moe_tiny
    eng = Engine(load_model(d), n_ctx=256)
    prompts = [prompt_ids(seed)[:n] for seed, n in ((1, 20), (2, 33), (3, 7), (4, 50), (5, 12))]
    assert_batch_invariant(eng, prompts)


def test_verify_rows_equal_single_steps(moe_tiny):
    """A k+1-token step (speculative verify) equals feeding its tokens one at a time."""
    from runtime.engine import Engine
    d, ids, _ = moe_tiny
    assert_verify_rows_equal_single_steps(Engine(load_model(d), n_ctx=256), ids)


# ---- what info shows -----------------------------------------------------------------------------------------

def test_info_shows_total_and_active_parameters(moe_tiny, capsys):
    from runtime.cli import main
    d, _, _ = moe_tiny
    lm = load_model(d)
    cfg = lm.config
    experts = sum(int(np.prod(t.shape)) for n, t in lm.tensors.items() if n.endswith("_exps.weight"))
    assert experts == cfg.n_layers * 3 * cfg.n_experts * cfg.d_model * cfg.d_ff_expert
    assert lm.n_active_params == lm.n_params - experts * (cfg.n_experts - cfg.n_experts_used) // cfg.n_experts
    assert main(["info", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == lm.n_params and info["active_parameters"] == lm.n_active_params
    assert info["experts"] == {"count": 8, "used": 2, "d_ff_expert": 32, "normalized_top_k": True}


# ---- refusing what we do not implement ---------------------------------------------------------------------

@pytest.mark.parametrize("changes,match", [
    ({"mlp_only_layers": [1]}, "dense MLP"),
    ({"decoder_sparse_step": 2}, "dense MLP"),
    ({"shared_expert_intermediate_size": 64}, "shared experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_unimplemented_moe_configs_are_refused(moe_tiny, tmp_path, changes, match):
    d = edit_config(moe_tiny[0], tmp_path / "ck", **changes)
    with pytest.raises(CheckpointError, match=match):
        load_model(d)


def test_unknown_moe_gguf_metadata_and_tensors_are_refused(moe_tiny, tmp_path):
    from quant.convert import convert
    g = GGUFFile(convert(moe_tiny[0], tmp_path / "f16.gguf", "f16", progress=False)["path"])
    shapes = {n: t.shape for n, t in g.tensors.items()}
    cfg = config_from_gguf(g.metadata, shapes)
    assert (cfg.n_experts, cfg.n_experts_used, cfg.d_ff_expert, cfg.expert_norm_topk) == (8, 2, 32, True)
    check_tensors(cfg, shapes, "x.gguf")
    for key, value in [("qwen3moe.expert_shared_feed_forward_length", 64), ("qwen3moe.expert_gating_func", 2),
                       ("qwen3moe.expert_weights_scale", 2.5)]:
        with pytest.raises(UnsupportedModelFile, match=key.split(".", 1)[1]):
            config_from_gguf({**g.metadata, key: value}, shapes)
    with pytest.raises(UnsupportedModelFile, match="expert_used_count"):
        config_from_gguf({**g.metadata, "qwen3moe.expert_used_count": 9}, shapes)
    with pytest.raises(UnsupportedModelFile, match="ffn_gate_shexp.weight is not part of a qwen3moe model"):
        check_tensors(cfg, {**shapes, "blk.0.ffn_gate_shexp.weight": (32, 64)}, "x.gguf")
    with pytest.raises(UnsupportedModelFile, match="ffn_up_exps.weight has shape"):
        check_tensors(cfg, {**shapes, "blk.1.ffn_up_exps.weight": (8, 64, 64)}, "x.gguf")
