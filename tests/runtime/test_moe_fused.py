"""The CPU's fused mixture-of-experts kernels (quant/moe_cpu.py, CPUBackend._moe_fused)
against the expert-by-expert path (one matmul call per chosen expert, the path they
replace): bit for bit.  Both run each chosen expert's run of rows through the same
VNNI row kernels on the same int8 activations, the fused one straight from the 3-D
tensor's bytes, so nothing may differ, whatever the step's row count or the experts
its tokens chose.  And a routed model's decode steps are recorded and replayed
(cpu_plan.py) with the logits of the plain forward; --cpu-moe's host function
(moe_host_fn.py) gives moe_routed's bits."""
from __future__ import annotations

import numpy as np
import pytest

from quant import GGMLType, QTensor
from quant import matmul_cpu
from runtime.backend.cpu import CPUBackend

pytestmark = pytest.mark.skipif(not matmul_cpu.USE_VNNI, reason="the fused kernels need AVX512-VNNI or AVX2")

_SCALES = {GGMLType.Q4_K: (0, 2), GGMLType.Q6_K: (208,)}


def _blocks(rng, qtype, rows, K):
    """Random K-quant blocks with finite, realistic f16 scales; MXFP4 and Q8_0 blocks with
    realistic E8M0 / f16 scales."""
    if qtype == GGMLType.MXFP4:
        raw = rng.integers(0, 256, (rows, K // 32, 17), dtype=np.uint8)
        raw[:, :, 0] = rng.integers(116, 122, (rows, K // 32))
        return raw.reshape(rows, -1)
    if qtype == GGMLType.Q8_0:
        raw = rng.integers(0, 256, (rows, K // 32, 34), dtype=np.uint8)
        raw[:, :, 0:2] = rng.uniform(-2e-4, 2e-4, (rows, K // 32)).astype(np.float16).view(np.uint8).reshape(
            rows, K // 32, 2)
        return raw.reshape(rows, -1)
    bb = {GGMLType.Q4_K: 144, GGMLType.Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, (rows, K // 256, bb), dtype=np.uint8)
    for off in _SCALES[qtype]:
        s = rng.uniform(-0.02, 0.02, (rows, K // 256)).astype(np.float16)
        raw[:, :, off:off + 2] = s.view(np.uint8).reshape(rows, K // 256, 2)
    return raw.reshape(rows, -1)


def _experts(rng, be, E, d, ff, down_type, up_type=GGMLType.Q4_K):
    out = []
    for name, qt, M, K in (("gate", up_type, ff, d), ("up", up_type, ff, d), ("down", down_type, d, ff)):
        t = QTensor(f"ffn_{name}_exps", qt, (E, M, K), _blocks(rng, qt, E * M, K))
        out.append(be.upload(t))
    return tuple(out)


# (gate/up, down): K-quant experts (Q4_K_M), gpt-oss's MXFP4 (all three; d = 2880 = 90
# blocks: the row kernel's 2-block tail), and one family for x and another for h
TYPES = [(GGMLType.Q4_K, GGMLType.Q4_K, 512), (GGMLType.Q4_K, GGMLType.Q6_K, 512),
         (GGMLType.MXFP4, GGMLType.MXFP4, 2880), (GGMLType.Q4_K, GGMLType.Q8_0, 512),
         (GGMLType.MXFP4, GGMLType.Q6_K, 512)]


@pytest.mark.parametrize("up_type,down_type,d", TYPES, ids=lambda t: getattr(t, "name", str(t)))
@pytest.mark.parametrize("n", [1, 2, 3, 9, 16, 40])
def test_fused_moe_equals_expert_by_expert(up_type, down_type, d, n):
    rng = np.random.default_rng(n)
    E, ff, k = 16, 256, 4
    be = CPUBackend(threads=2)
    be.moe_fused_rows = 64
    experts = _experts(rng, be, E, d, ff, down_type, up_type)
    router = be.upload(QTensor("router", GGMLType.F32, (E, d), rng.standard_normal((E, d)).astype(np.float32)))
    x = rng.standard_normal((n, d)).astype(np.float32)
    be.arena.reset()
    fused = be.moe(x, router, experts, k, True).copy()
    assert be.recordable
    logits = be.matmul(x, router).copy()        # (the router's logits, as the moe op computes them)
    be.arena.reset()
    plain = be._moe_by_expert(x, logits, experts, k, True)
    assert np.array_equal(fused, plain)
    # the entry the CUDA backend's host experts take (--cpu-moe): the logits given, not the router
    be.arena.reset()
    assert np.array_equal(be.moe_routed(x, logits, experts, k, True), fused)
    assert np.isfinite(fused).all() and np.abs(fused).max() > 0


@pytest.mark.parametrize("up_type,down_type,d,glu", [(GGMLType.Q4_K, GGMLType.Q6_K, 512, "silu"),
                                                     (GGMLType.MXFP4, GGMLType.MXFP4, 2880, "swiglu_oai")],
                         ids=["q4k-q6k-silu", "mxfp4-biases-swiglu_oai"])
def test_host_function_equals_moe_routed(up_type, down_type, d, glu):
    """--cpu-moe's host function (runtime/backend/moe_host_fn.py: the fused path as one native
    call a CUDA graph's host node makes, from a descriptor of pointers), called through a C
    function pointer from a thread that is not Python's main one, with 1 thread asked for:
    CPUBackend.moe_routed's bits, for 1 to 40 rows, with gpt-oss's expert biases and SwiGLU."""
    import ctypes
    import threading

    from runtime.backend import moe_host_fn
    rng = np.random.default_rng(3)
    E, ff, k = 16, 256, 4
    be = CPUBackend(threads=2)
    experts = _experts(rng, be, E, d, ff, down_type, up_type)
    kinds = moe_cpu_kinds(experts)
    biases = None
    if glu == "swiglu_oai":
        biases = [rng.standard_normal((E, m)).astype(np.float32) * 0.01 for m in (ff, ff, d)]
    call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(moe_host_fn.host_fn().address)
    for n in (1, 3, 8, 40):
        x = rng.standard_normal((n, d)).astype(np.float32)
        logits = rng.standard_normal((n, E)).astype(np.float32)
        be.arena.reset()
        want = be.moe_routed(x, logits, experts, k, True, biases, glu).copy()
        out = np.full((n, d), np.nan, np.float32)
        dsc = moe_host_fn.descriptor(n, x, logits, out, experts, k, True, kinds, glu, 1, biases)
        t = threading.Thread(target=call, args=(dsc.ctypes.data,))
        t.start()
        t.join()
        assert np.array_equal(out, want), (n, float(np.nanmax(np.abs(out - want))))


def moe_cpu_kinds(experts):
    from quant import moe_cpu
    kinds = moe_cpu.fused_kinds(*(e.whole for e in experts))
    assert kinds is not None
    return kinds


@pytest.mark.parametrize("n", [3, 20, 31])
def test_fused_mxfp4_long_runs_equal_expert_by_expert(n):
    """A tie-routed step (a zero router: every token picks experts 0 and 1): runs of n rows,
    one group of up to 16 rows and then a second, partial one, through the row-group kernels
    the expert-by-expert path runs for them (up to 31 rows; 32 and more take its bf16 GEMM)."""
    rng = np.random.default_rng(n)
    E, d, ff, k = 4, 2880, 256, 2
    be = CPUBackend(threads=2)
    experts = _experts(rng, be, E, d, ff, GGMLType.MXFP4, GGMLType.MXFP4)
    router = be.upload(QTensor("router", GGMLType.F32, (E, d), np.zeros((E, d), np.float32)))
    x = rng.standard_normal((n, d)).astype(np.float32)
    be.arena.reset()
    fused = be.moe(x, router, experts, k, True).copy()
    logits = be.matmul(x, router).copy()
    be.arena.reset()
    plain = be._moe_by_expert(x, logits, experts, k, True)
    assert np.array_equal(fused, plain)
    assert np.isfinite(fused).all() and np.abs(fused).max() > 0


def test_routed_decode_steps_replay(tmp_path):
    """A qwen3moe of Q4_K/Q6_K experts: decode and verify-like steps with plans and the
    fused kernels give the logits of plain expert-by-expert forwards, and they replay."""
    from lab.synth import load_weights_only, write_random_gguf
    from runtime.engine import Engine
    path = write_random_gguf(tmp_path / "moe.gguf", "qwen3moe", n_layers=2, d_model=256, d_ff=0, n_heads=4,
                             n_kv_heads=2, vocab=512, tied=True, n_experts=16, n_experts_used=4, d_ff_expert=256)
    lm = load_weights_only(path)

    def walk(fused):
        eng = Engine(lm, n_ctx=256, threads=2)
        eng.backend.moe_fused = fused
        if not fused:
            eng.backend.plans = None
        seqs = [eng.new_sequence() for _ in range(3)]
        last = [int(eng.step([s], [list(range(5 + i, 30 + 3 * i))])[0].argmax()) for i, s in enumerate(seqs)]
        out = []
        for _ in range(6):
            o = eng.step(seqs[:1], [[last[0]]])
            out.append(o[0])
            last[0] = int(o[0].argmax())
        for _ in range(4):
            o = eng.step(seqs, [[t] for t in last])
            out.extend(o)
            last = [int(r.argmax()) for r in o]
        for i in range(3):
            out.extend(eng.step(seqs[1:2], [[last[1] + i, 7, 8, 9]], all_logits=True))
        return out, eng.backend.plans

    fused, plans = walk(True)
    plain, _ = walk(False)
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert np.array_equal(a, b), f"row {i}"
    assert plans.replayed >= 4 and not plans.broken and not plans.refused
