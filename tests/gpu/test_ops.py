"""The CUDA backend's ops against the CPU backend's on the same inputs."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.engine import Step

pytestmark = pytest.mark.gpu


def _rel(a, ref):
    a = np.asarray(a, np.float64)
    assert np.all(np.isfinite(a)), "non-finite or unwritten output"
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def backends():
    from runtime.backend.cpu import CPUBackend
    from runtime.backend.cuda import CUDABackend
    return CPUBackend(), CUDABackend()


def test_rmsnorm_glu_add_rows(backends):
    import cupy as cp
    cpu, gpu = backends
    rng = np.random.default_rng(0)
    for shape in [(5, 576), (3, 4, 64), (1, 1536)]:
        x = rng.standard_normal(shape).astype(np.float32) * 3
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        ref = cpu.rmsnorm(x, w, 1e-6)
        got = gpu.rmsnorm(cp.asarray(x), cp.asarray(w), 1e-6)
        gpu._flush()            # the backend defers RMSNorm/GLU/RoPE to the next op; run them now
        got = got.get()
        assert _rel(got, ref) < 1e-6
    for kind in ("silu", "gelu", "swiglu_oai"):      # (swiglu_oai: gpt-oss's, clamped at 7: the * 4 reaches it)
        g = rng.standard_normal((4, 1000)).astype(np.float32) * 4
        u = rng.standard_normal((4, 1000)).astype(np.float32)
        gd = cp.asarray(g)
        gpu.glu(gd, cp.asarray(u), kind)
        gpu._flush()
        assert _rel(gd.get(), cpu.glu(g.copy(), u, kind)) < 1e-6
    x = rng.standard_normal((3, 100)).astype(np.float32)
    y = rng.standard_normal((3, 100)).astype(np.float32)
    xd = cp.asarray(x)
    gpu.add(xd, cp.asarray(y))
    assert np.array_equal(xd.get(), x + y)
    rows = gpu.rows(xd, cp.asarray(np.array([2, 0], np.int32))).get()
    assert np.array_equal(rows, (x + y)[[2, 0]])


def test_two_norms_of_one_width_launch_together_with_the_same_bits(backends):
    """Qwen3's / Gemma 3's q and k heads: a second RMSNorm of the same width is deferred with
    the first and both run in one launch (rmsnorm2), each row's bits those of rmsnorm alone;
    a norm that reads the pending one's output, or of another width, flushes it first."""
    import cupy as cp
    cpu, gpu = backends
    rng = np.random.default_rng(3)
    q = cp.asarray(rng.standard_normal((5, 16, 128)).astype(np.float32) * 3)
    k = cp.asarray(rng.standard_normal((5, 2, 128)).astype(np.float32))
    wq, wk = (cp.asarray(rng.standard_normal(128).astype(np.float32)) for _ in range(2))
    alone = []
    for x, w in ((q, wq), (k, wk)):
        out = gpu.rmsnorm(x, w, 1e-6)
        gpu._flush()
        alone.append(out.get())
    a = gpu.rmsnorm(q, wq, 1e-6)
    b = gpu.rmsnorm(k, wk, 1e-6)
    assert gpu._pnorm is not None and gpu._pnorm2 is not None     # one launch for both
    gpu._flush()
    assert np.array_equal(a.get(), alone[0]) and np.array_equal(b.get(), alone[1])
    a = gpu.rmsnorm(q, wq, 1e-6)
    c = gpu.rmsnorm(a, wk, 1e-6)                                  # reads the first's output: not paired
    assert gpu._pnorm2 is None
    gpu._flush()
    assert np.array_equal(a.get(), alone[0])
    assert _rel(c.get(), cpu.rmsnorm(alone[0], wk.get(), 1e-6)) < 1e-6


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("pos_scale", [1.0, 8.0])
@pytest.mark.parametrize("rope_dim,mscale", [(64, 1.0), (64, 1.3466), (48, 1.19)])
def test_rope(backends, neox, pos_scale, rope_dim, mscale):
    """mscale: YaRN's / LongRoPE's magnitude on cos and sin; with partial RoPE (Phi-4-mini)
    the dims past rope_dim stay as they are."""
    import cupy as cp
    cpu, gpu = backends
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4, 64)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 4000, 31], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, rope_dim, 2) / rope_dim)).astype(np.float32)

    class S:
        positions = pos
    ref = x.copy()
    cpu.rope(ref, S, inv_freq, neox, pos_scale, mscale)
    if mscale != 1.0 and neox:
        assert np.array_equal(ref[..., rope_dim:], x[..., rope_dim:])
        assert np.allclose(np.linalg.norm(ref[..., :rope_dim], axis=-1),
                           mscale * np.linalg.norm(x[..., :rope_dim], axis=-1), rtol=1e-5)

    class D:
        positions = cp.asarray(pos)
    xd = cp.asarray(x)
    gpu.rope(xd, D, inv_freq, neox, pos_scale, mscale)
    gpu._flush()
    assert _rel(xd.get(), ref) < 1e-6


def _paged_step(rng, seq_lens, new, block_size, window, n_blocks):
    """A step over len(seq_lens) sequences with seq_lens[i] cached tokens and new[i] new ones,
    their blocks scattered over the pool."""
    perm = rng.permutation(n_blocks)
    tables, slots, pos, owner = [], [], [], []
    used = 0
    for i, (L, k) in enumerate(zip(seq_lens, new)):
        nb = -(-(L + k) // block_size)
        blocks = perm[used:used + nb]
        used += nb
        tables.append(blocks)
        for p in range(L, L + k):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
            pos.append(p)
            owner.append(i)
    mb = max(len(t) for t in tables)
    bt = np.zeros((len(tables), mb), np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    n = len(pos)
    return Step(tokens=np.zeros(n, np.int32), positions=np.array(pos, np.int32), slots=np.array(slots, np.int32),
                seq_of_token=np.array(owner, np.int32), block_tables=bt,
                logit_rows=np.array([n - 1], np.int64), block_size=block_size, attn_scale=0.125,
                attn_splits=1, windows=[window])


@pytest.mark.parametrize("hd,heads,kvh", [(64, 9, 3), (128, 12, 2), (256, 4, 1), (128, 32, 8), (64, 64, 8)])
@pytest.mark.parametrize("case", ["prefill", "decode", "decode-split", "window", "prompt", "prompt-window",
                                  "prompt-long", "tiles", "tiles-split", "tiles-window"])
@pytest.mark.parametrize("sinks", [False, True])
def test_paged_attention(backends, hd, heads, kvh, case, sinks, monkeypatch):
    """(sinks: gpt-oss's attention sinks, a logit per query head in each row's softmax
    denominator, from below the scores to above them; (64, 64, 8) is gpt-oss-20b's attention)"""
    import cupy as cp
    import runtime.backend.cuda as CB
    from runtime.backend.cuda import _DevStep, _pack_step, _views
    cpu, gpu = backends
    rng = np.random.default_rng(hd + heads)
    bs, n_blocks = 16, 64
    window = 0
    if case == "prefill":
        lens, new = [0, 37], [20, 5]
    elif case in ("window", "tiles-window"):
        lens, new, window = [300, 10], [3, 1], 64
    elif case == "prompt":          # one sequence's prompt after 37 cached tokens: the tiled kernel
        lens, new = [37], [40]
    elif case == "prompt-window":   # a sliding window shorter than the prompt
        lens, new, window = [10], [60], 24
    elif case == "prompt-long":     # many key tiles, a partial last query tile
        lens, new = [0], [203]
    else:
        lens, new = [450], [1]
    step = _paged_step(rng, lens, new, bs, window, n_blocks)
    # attn_tiles (long-context decode): 451 keys in one split (15 tiles), in 5 splits of 91
    # (3 tiles, the last partial); a sliding window over several tokens and sequences
    splits = 5 if case in ("decode-split", "tiles-split") else 1
    tiles = case.startswith("tiles")
    n_slots = n_blocks * bs
    kpool = (rng.standard_normal((n_slots, kvh, hd)) * 2).astype(np.float16)
    vpool = rng.standard_normal((n_slots, kvh, hd)).astype(np.float16)
    n = len(step.tokens)
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    k = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    sk = np.linspace(-4.0, 8.0, heads).astype(np.float32) if sinks else None
    sk_d = cp.asarray(sk) if sinks else None

    cpu.alloc_kv(1, n_slots, kvh, hd)
    cpu.kv.k[0][:] = kpool.view(np.uint16)
    cpu.kv.v[0][:] = vpool.view(np.uint16)
    step.attn_splits = 1
    cpu.arena.reset()
    ref = cpu.attention(q, k, v, 0, step, sinks=sk).copy()

    gpu.alloc_kv(1, n_slots, kvh, hd)
    gpu.kv.k[0][:] = cp.asarray(kpool)
    gpu.kv.v[0][:] = cp.asarray(vpool)
    flat, layout = _pack_step(step)
    dstep = _DevStep(step, _views(cp.asarray(flat), layout), splits, tiles)
    assert dstep.prompt_tiles == case.startswith("prompt")
    # (short prompt chunks split their keys only when their blocks are very few: here
    # they split whenever their blocks are fewer than the GPU runs at once)
    monkeypatch.setattr(CB, "PREFILL_SPLIT_MIN_KEYS", 0)
    gpu.arena.reset()
    got = gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), 0, dstep, sinks=sk_d).get()
    # prompts at the head dims in MMA_HEAD_DIMS take the tensor cores (attn_prefill_mma): q
    # and the softmax weights in fp16, as the prompt's GEMMs take their operands
    mma = dstep.prompt_tiles and CB.PREFILL_MMA and hd in CB.MMA_HEAD_DIMS
    assert _rel(got, ref) < (4e-3 if mma else 1e-5), case
    if mma:
        # these chunks make few blocks, so their keys were split over several (merged by
        # attn_merge); the same chunk in one launch of whole key ranges
        pq = CB.MMA_ROWS // (heads // kvh)
        assert gpu._prefill_splits((n + pq - 1) // pq * kvh, 256) > 1
        monkeypatch.setattr(CB, "PREFILL_MAX_SPLITS", 1)
        gpu.arena.reset()
        got1 = gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), 0, dstep, sinks=sk_d).get()
        assert _rel(got1, ref) < 4e-3, case
        assert _rel(got, got1) < 4e-3, case     # (each share rounds P to fp16 against its own max)
        # and the float32 kernel, which takes the other head dims
        monkeypatch.setattr(CB, "PREFILL_MMA", False)
        gpu.arena.reset()
        got32 = gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), 0, dstep, sinks=sk_d).get()
        assert _rel(got32, ref) < 1e-5, case
        assert _rel(got, got32) < 4e-3, case
    # the new tokens' K/V landed in the same slots, in fp16
    assert np.array_equal(gpu.kv.k[0].get().view(np.uint16), cpu.kv.k[0])
    assert np.array_equal(gpu.kv.v[0].get().view(np.uint16), cpu.kv.v[0])
    if case == "prefill":
        # RoPE of q and k folded into the KV write, against CPU RoPE then attention; with
        # YaRN's magnitude on cos and sin too (mscale, the same for q and k)
        inv_freq = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
        for mscale in (1.0, 1.3466):
            qr, kr = q.copy(), k.copy()
            cpu.rope(qr, step, inv_freq, True, 1.0, mscale)
            cpu.rope(kr, step, inv_freq, True, 1.0, mscale)
            cpu.arena.reset()
            ref2 = cpu.attention(qr, kr, v, 0, step, sinks=sk).copy()
            qd, kd = cp.asarray(q), cp.asarray(k)
            gpu.arena.reset()
            gpu.rope(qd, dstep, inv_freq, True, 1.0, mscale)
            gpu.rope(kd, dstep, inv_freq, True, 1.0, mscale)
            assert len(gpu._propes) == 2          # deferred: attention fuses them into the KV write
            got2 = gpu.attention(qd, kd, cp.asarray(v), 0, dstep, sinks=sk_d).get()
            # a magnitude on q and k sharpens the softmax: the keys' one-ulp fp16 differences
            # (below) weigh more (measured 1.5-1.9e-5 at 1.3466 with 32 heads over 8)
            assert _rel(got2, ref2) < (1e-5 if mscale == 1.0 else 4e-5), mscale
            # rotated keys in fp16: equal up to one fp16 rounding step (the GPU may fuse a*c - b*s)
            k_gpu = gpu.kv.k[0].get().astype(np.float32)
            k_cpu = cpu.kv.k[0].view(np.float16).astype(np.float32)
            assert np.allclose(k_gpu, k_cpu, rtol=2e-3, atol=1e-6), mscale


@pytest.mark.parametrize("hd,heads,kvh", [(64, 9, 3), (128, 12, 2), (256, 4, 1)])
@pytest.mark.parametrize("case", ["prefill", "decode", "decode-split", "prompt", "prompt-long", "tiles-split"])
def test_paged_attention_k16v8(backends, hd, heads, kvh, case, monkeypatch):
    """The k16v8 cache (K f16, V q8_0) on the GPU against the CPU's, from the same stored
    pools: every attention kernel's V8 variant, kv_write_v8 and RoPE before the write (not
    fused for a q8_0 V).  The tile kernels stage V in fp16 (q x scale rounded once) and
    the prompt's tensor-core kernel rounds q and P to fp16: 4e-3; the decode kernel reads
    V in float32 as the CPU does: 1e-5.  The new tokens' V: the CPU's int8 values and
    scales, bar a rare value one step off (its division may round differently)."""
    import cupy as cp
    import runtime.backend.cuda as CB
    from runtime.backend.cuda import _DevStep, _pack_step, _views
    cpu, gpu = backends
    rng = np.random.default_rng(hd + heads + 1)
    bs, n_blocks = 16, 64
    lens, new = {"prefill": ([0, 37], [20, 5]), "prompt": ([37], [40]), "prompt-long": ([0], [203])}.get(
        case, ([450], [1]))
    step = _paged_step(rng, lens, new, bs, 0, n_blocks)
    splits = 5 if case.endswith("split") else 1
    tiles = case.startswith("tiles")
    n_slots = n_blocks * bs
    kpool = (rng.standard_normal((n_slots, kvh, hd)) * 2).astype(np.float16)
    vq = rng.integers(-127, 128, (n_slots, kvh, hd)).astype(np.int8)
    vs = (rng.random((n_slots, kvh, hd // 32)) * 0.02 + 0.001).astype(np.float16)
    n = len(step.tokens)
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    k = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)

    cpu.alloc_kv(1, n_slots, kvh, hd, cache_type="k16v8")
    cpu.kv.k[0][:] = kpool.view(np.uint16)
    cpu.kv.v[0][:] = vq
    cpu.kv.v_scale[0][:] = vs.view(np.uint16)
    step.attn_splits = 1
    qr, kr = q.copy(), k.copy()
    cpu.rope(qr, step, inv_freq, True)
    cpu.rope(kr, step, inv_freq, True)
    cpu.arena.reset()
    ref = cpu.attention(qr, kr, v, 0, step).copy()

    gpu.alloc_kv(1, n_slots, kvh, hd, cache_type="k16v8")
    assert gpu.kv.nbytes == n_slots * gpu.kv.bytes_per_token == n_slots * cpu.kv.bytes_per_token
    gpu.kv.k[0][:] = cp.asarray(kpool)
    gpu.kv.v[0][:] = cp.asarray(vq)
    gpu.kv.v_scale[0][:] = cp.asarray(vs)
    flat, layout = _pack_step(step)
    dstep = _DevStep(step, _views(cp.asarray(flat), layout), splits, tiles)
    monkeypatch.setattr(CB, "PREFILL_SPLIT_MIN_KEYS", 0)
    qd, kd = cp.asarray(q), cp.asarray(k)
    gpu.arena.reset()
    gpu.rope(qd, dstep, inv_freq, True)
    gpu.rope(kd, dstep, inv_freq, True)
    got = gpu.attention(qd, kd, cp.asarray(v), 0, dstep).get()
    staged = dstep.prompt_tiles or tiles
    assert _rel(got, ref) < (4e-3 if staged else 1e-5), (case, _rel(got, ref))
    # the new tokens' V in q8_0 as the CPU stored it; K in fp16 (one rounding step apart)
    gv, cv = gpu.kv.v[0].get().astype(np.int32), cpu.kv.v[0].astype(np.int32)
    assert np.abs(gv - cv).max() <= 1 and (gv != cv).mean() < 1e-3
    assert np.array_equal(gpu.kv.v_scale[0].get().view(np.uint16), cpu.kv.v_scale[0])
    k_gpu = gpu.kv.k[0].get().astype(np.float32)
    k_cpu = cpu.kv.k[0].view(np.float16).astype(np.float32)
    assert np.allclose(k_gpu, k_cpu, rtol=2e-3, atol=1e-6)
    # copy_block and a context shift move V's values and scales as stored
    src = int(step.slots[0]) // bs
    gpu.kv.copy_block(src, n_blocks - 1, bs)
    assert np.array_equal(gpu.kv.v[0][(n_blocks - 1) * bs:].get(), gpu.kv.v[0][src * bs:(src + 1) * bs].get())
    assert np.array_equal(gpu.kv.v_scale[0][(n_blocks - 1) * bs:].get(),
                          gpu.kv.v_scale[0][src * bs:(src + 1) * bs].get())
    v_src, s_src = gpu.kv.v[0][16:32].get(), gpu.kv.v_scale[0][16:32].get()
    gpu.kv.shift(0, np.arange(16, 32), np.arange(0, 16), -16, inv_freq, True)
    assert np.array_equal(gpu.kv.v[0][:16].get(), v_src) and np.array_equal(gpu.kv.v_scale[0][:16].get(), s_src)
