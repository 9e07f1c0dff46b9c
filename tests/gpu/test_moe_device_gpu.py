"""A mixture of experts' decode steps routed on the device (quant/cuda/qmoe.cuh,
CUDABackend._moe_on_device) against the host-routed path (moe.py, then a matvec an
expert: what LLAMBA_MOE_DEVICE=0 runs):

* the routing kernel (moe_route) gives moe.route's experts and weights bit for bit: ties,
  underflowing terms, expert counts not a multiple of 32, renormalized or not;
* each id-indexed matvec (mvk4k_id, mvkt_id, mvs_id) gives every (row, slot) pair the
  bits of the per-expert matvec, for every integer type, gate/up in one launch and down
  with SiLU . up folded into its rounding;
* whole random-weight qwen3moe models (tiny; M18's, M30's and gpt-oss-20b's (MXFP4 experts)
  layer shapes cut to 2 layers; 60 experts with a down of K = 160; gpt-oss itself, scaled down
  and at gpt-oss-20b's layer shape: router and expert biases by id, the clamped SwiGLU):
  greedy decode gives bit-identical logits
  both ways, decode steps replay CUDA graphs (the host path's never do), graph replay
  equals the eager step, verify rows of 1-8 equal single steps, 8 sequences decoding
  together equal each alone, and the CPU backend agrees within test_moe_gpu's bounds."""
from __future__ import annotations

import numpy as np
import pytest

from checkpoints.ckpt_helpers import assert_batch_invariant
from test_models import _greedy, _rel
from test_moe_gpu import NEAR_TIE, _margin

pytestmark = pytest.mark.gpu

INT8_TYPES = ["Q4_K", "Q6_K", "Q4_0", "Q8_0", "Q5_K", "Q5_0", "Q4_1", "Q5_1", "MXFP4"]


# ---------------------------------------------------------------- the routing kernel
def _logits(n, E, rng):
    lg = (rng.standard_normal((n, E)) * 2).astype(np.float32)
    lg[1] = 0.5                                     # one value: the lowest indices win
    lg[2, ::3] = lg[2].max() + 1                    # ties among the largest
    lg[3] *= 400                                    # most terms underflow to 0 (ties at 0)
    lg[4] = np.round(lg[4])                         # many ties
    lg[5] = (rng.standard_normal(E) * 1e-20).astype(np.float32)   # every term rounds to 1.0
    lg[6] = -lg[6] - 100                            # all negative, far from 0
    return lg


@pytest.mark.parametrize("E,k", [(8, 8), (16, 4), (60, 6), (128, 8), (512, 32)])
@pytest.mark.parametrize("norm", [True, False])
def test_route_kernel_equals_host_route(E, k, norm):
    import cupy as cp
    import quant.cuda as qc
    from runtime.backend import moe
    rng = np.random.default_rng(E * 31 + k)
    n, K = 8, 512
    lg = _logits(n, E, rng)
    ids_ref, w_ref = np.empty((n, k), np.int32), np.empty((n, k), np.float32)
    moe.route(lg, k, norm, ids_ref, w_ref)
    x = rng.standard_normal((n, K)).astype(np.float32)
    ids, w = cp.full(n * k, -1, cp.int32), cp.full(n * k, np.nan, cp.float32)
    acts = qc.moe_route(cp.asarray(x), cp.asarray(lg), k, norm, ids, w, 256, qc.Workspace())
    cp.cuda.runtime.deviceSynchronize()
    got_ids, got_w = ids.get().reshape(n, k), w.get().reshape(n, k)
    for t in range(n):
        assert np.array_equal(got_ids[t], ids_ref[t]), (t, got_ids[t], ids_ref[t])
        assert np.array_equal(got_w[t].view(np.int32), w_ref[t].view(np.int32)), (t, got_w[t], w_ref[t])
    # the same launch rounds x exactly as q8_act does (blocks of 256, mvk's run sums)
    ref = qc._quantize_act(cp.asarray(x), 256, qc.Workspace())
    for a, b in zip(acts[256], ref):
        assert np.array_equal(a.get(), b.get())


def test_route_kernel_blocks_of_32():
    import cupy as cp
    import quant.cuda as qc
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 352)).astype(np.float32)
    lg = rng.standard_normal((3, 40)).astype(np.float32)
    ids, w = cp.empty(3 * 5, cp.int32), cp.empty(3 * 5, cp.float32)
    acts = qc.moe_route(cp.asarray(x), cp.asarray(lg), 5, True, ids, w, 32, qc.Workspace())
    ref = qc._quantize_act(cp.asarray(x), 32, qc.Workspace())
    assert acts[32][3] is None and ref[3] is None
    for a, b in zip(acts[32][:3], ref[:3]):
        assert np.array_equal(a.get(), b.get())


# ---------------------------------------------------------------- the matvecs by expert id
@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("M,K", [(250, 768), (768, 2048), (2304, 256), (128, 4096), (40, 352), (2880, 2880)])
def test_matvec_ids_equals_expert_matvec(qtype, M, K):
    """gate/up (two tensors, k pairs a row of x) and down (SiLU . up folded, a pair a row)
    by expert id against qc.matmul of each pair's expert alone: bit for bit.  Shapes: K of
    3 super-blocks (M30's down), M30's gate/up, Q6_K past mvk's rows (mvs), Q4_0's
    4096-wide rule (mvs), a width of 11 blocks of 32 (legacy types), gpt-oss's experts (90
    blocks of 32: MXFP4's 17-byte blocks leave rows at any byte alignment)."""
    import cupy as cp
    import quant.cuda as qc
    from quant import GGMLType, QTensor
    from lab.synth import _Noise, random_weight
    from runtime.backend.cuda import CUDABackend
    t = GGMLType[qtype]
    if K % qc._KBLOCK[t][0]:
        pytest.skip(f"{qtype} rows are whole blocks of {qc._KBLOCK[t][0]}")
    be = CUDABackend()
    E, n, k = 12, 8, 4
    P = n * k
    G, U = (be.upload(QTensor(f"{s}_exps", t, (E, M, K), random_weight(t, (E * M, K), _Noise(i))))
            for i, s in ((1, "gate"), (2, "up")))
    D = (be.upload(QTensor("down_exps", t, (E, K, M), random_weight(t, (E * K, M), _Noise(3))))
         if M % qc._KBLOCK[t][0] == 0 else None)      # (down's rows are M wide)
    assert isinstance(G, qc.DeviceExperts) and G.shape == (M, K)
    cp.cuda.runtime.deviceSynchronize()         # (uploads on the backend's stream; all below on the default one)
    rng = np.random.default_rng(M + K)
    ids = rng.integers(0, E, P).astype(np.int32)
    ids[:k] = 7                                 # one row whose slots share an expert
    x = cp.asarray(rng.standard_normal((n, K)).astype(np.float32))
    ids_d = cp.asarray(ids)
    g, u = cp.full((P, M), np.nan, cp.float32), cp.full((P, M), np.nan, cp.float32)
    qc.matvec_ids(x, [G, U], ids_d, [g, u], k, qc.Workspace())
    ws = qc.Workspace()
    for p in range(P):
        rg, ru = cp.empty((1, M), cp.float32), cp.empty((1, M), cp.float32)
        qc.matmul(x[p // k:p // k + 1], [G[ids[p]], U[ids[p]]], [rg, ru], ws=ws)
        assert np.array_equal(g[p].get(), rg[0].get()), ("gate", p, ids[p])
        assert np.array_equal(u[p].get(), ru[0].get()), ("up", p, ids[p])
    if D is None:
        return
    y = cp.full((P, K), np.nan, cp.float32)
    qc.matvec_ids(g, [D], ids_d, [y], 1, qc.Workspace(), prologue=("silu", u))
    for p in range(P):
        ry = cp.empty((1, K), cp.float32)
        qc.matmul(g[p:p + 1], [D[ids[p]]], [ry], ws=ws, prologue=("silu", u[p:p + 1]))
        assert np.array_equal(y[p].get(), ry[0].get()), ("down", p, ids[p])


# ---------------------------------------------------------------- whole models
def _shapes():
    from lab.synth import SHAPES
    return {
        # test_moe_gpu's: 16 experts of 256, 4 a token, head dim 64
        "tiny": dict(arch="qwen3moe", n_layers=2, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2, vocab=1000,
                     tied=False, rope_theta=1e6, n_experts=16, n_experts_used=4, d_ff_expert=256),
        # 60 experts (not a multiple of 32), 6 a token, experts' down of K = 160 (Q5_0 / Q8_0
        # under Q4_K_M: mvs_id)
        "odd": dict(arch="qwen3moe", n_layers=2, d_model=256, d_ff=0, n_heads=4, n_kv_heads=2, vocab=1000,
                    tied=True, rope_theta=1e6, n_experts=60, n_experts_used=6, d_ff_expert=160),
        "m18": dict(SHAPES["M18"], n_layers=2, vocab=4096),
        # M30's layers (Q4_K and, in layer 1, Q6_K downs of K = 768; head dim 128)
        "m30": dict(SHAPES["M30"], n_layers=2, vocab=4096),
        # gpt-oss-20b's experts (32 of 2880, 4 a token; MXFP4_MOE: experts MXFP4, the rest Q8_0)
        "go": dict(SHAPES["GO20"], n_layers=2, vocab=4096),
        # gpt-oss itself (router and expert biases, the clamped SwiGLU, sinks, a window in
        # layer 0): test_gpt_oss_gpu's scaled-down layers, and gpt-oss-20b's
        "oss": dict(arch="gpt-oss", n_layers=2, d_model=256, d_ff=256, n_heads=8, n_kv_heads=2, vocab=1000,
                    tied=False, rope_theta=150000.0, n_experts=8, n_experts_used=2, d_ff_expert=256, head_dim=64,
                    sliding_window=16),
        "g20": dict(SHAPES["G20"], n_layers=2, vocab=4096),
    }


CASES = [("tiny", "Q4_K_M"), ("tiny", "Q8_0"), ("tiny", "Q4_0"), ("tiny", "Q5_K"), ("odd", "Q4_K_M"),
         ("m18", "Q4_K_M"), ("m30", "Q4_K_M"), ("tiny", "MXFP4_MOE"), ("go", "MXFP4_MOE"),
         ("oss", "MXFP4_MOE"), ("oss", "Q4_K_M"), ("g20", "MXFP4_MOE")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-{m}" for s, m in CASES])
def pair(request, tmp_path_factory):
    """(shape, mix, lm, engine routing decode on the device, engine routing on the host)."""
    from lab.synth import load_weights_only, write_random_gguf
    from runtime.engine import Engine
    shape, mix = request.param
    p = write_random_gguf(tmp_path_factory.mktemp("moedev") / f"{shape}-{mix}.gguf", mix=mix, seed=11,
                          **_shapes()[shape])
    lm = load_weights_only(p)
    dev = Engine(lm, device="cuda", n_ctx=512)
    host = Engine(lm, device="cuda", n_ctx=512)
    dev.backend.moe_on_device = True           # (the default; the host-routed engine is the reference)
    host.backend.moe_on_device = False
    yield shape, mix, lm, dev, host
    del dev, host
    import cupy as cp
    cp.get_default_memory_pool().free_all_blocks()


def test_device_routing_equals_host_routing(pair):
    """A 20-token prompt (routed on the host both ways), then 12 greedy steps: the device
    path's logits equal the host path's bit for bit at every step, and only its decode
    steps replay graphs."""
    shape, mix, lm, dev, host = pair
    ids = np.random.default_rng(4).integers(1, lm.config.vocab_size, 20).tolist()
    r0 = dev.backend.graph_replays
    toks, got = _greedy(dev, ids, 12)
    _, want = _greedy(host, ids, 12, forced=toks)
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), (shape, mix, i, float(np.abs(np.asarray(a) - b).max()))
    assert dev.backend.graph_replays - r0 >= 10          # decode steps replayed (the first eager)
    assert host.backend.graph_replays == 0


def test_graph_replay_equals_eager_step(pair):
    _, _, lm, dev, _ = pair
    ids = np.random.default_rng(6).integers(1, lm.config.vocab_size, 9).tolist()
    toks, replayed = _greedy(dev, ids, 8)
    dev.backend.use_graphs = False
    try:
        r0 = dev.backend.graph_replays
        _, eager = _greedy(dev, ids, 8, forced=toks)
        assert dev.backend.graph_replays == r0
    finally:
        dev.backend.use_graphs = True
    for i, (a, b) in enumerate(zip(replayed, eager)):
        assert np.array_equal(a, b), (i, float(np.abs(np.asarray(a) - b).max()))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
def test_verify_rows_equal_single_steps(pair, rows):
    from test_verify_invariance_gpu import _verify_and_singles
    _, _, _, dev, _ = pair
    batched, single = _verify_and_singles(dev, 40, rows, rows)
    assert np.array_equal(batched, single), float(np.abs(batched - single).max())


def test_eight_sequences_decoding_together_equal_each_alone(pair):
    """A step of 8 sequences (8 rows: eager, routed on the device) gives each row the bits
    of that sequence's own step, though the rows share experts."""
    _, _, lm, dev, _ = pair
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, lm.config.vocab_size, n).tolist() for n in (12, 30, 5, 21, 9, 17, 3, 26)]
    n_steps = 4

    assert_batch_invariant(dev, prompts, n_steps)


def test_device_routing_matches_cpu(pair):
    """Against the CPU backend (its own int8 rounding, not the GPU's): test_moe_gpu's bounds."""
    from runtime.engine import Engine
    shape, mix, lm, dev, _ = pair
    if shape not in ("m18", "m30"):
        pytest.skip("test_moe_gpu compares the tiny model with the CPU")
    ref = Engine(lm, device="cpu", n_ctx=512)
    ids = np.random.default_rng(4).integers(1, lm.config.vocab_size, 8).tolist()
    toks, logits = _greedy(dev, ids, 12)
    _, ref_logits = _greedy(ref, ids, 12, forced=toks)
    errs = [_rel(g, r) for g, r in zip(logits, ref_logits)]
    print(f"{shape} {mix}: logits rel err vs CPU median {np.median(errs):.2e} max {max(errs):.2e}")
    assert float(np.median(errs)) < 5e-2
    for i, t in enumerate(toks):
        r = ref_logits[i]
        assert t == int(np.argmax(r)) or _margin(r) < NEAR_TIE, f"step {i}: {t} vs {int(np.argmax(r))}"
