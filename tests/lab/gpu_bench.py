"""GPU benchmark: pp512 / tg128 at batch 1 on random-weight GGUFs of real shapes,
with HF transformers (bf16, same GPU) measured side by side in the same run.

    python -m lab.gpu_bench --shapes Q15,L8 --mixes Q4_K_M,Q4_0,Q8_0 --hf --out bench.json

The GPU machine has no network and takes few files, so the models are built
there (tests/lab/synth.py): speed does not depend on weight values.
llama.cpp's figures for the same shapes on the same H200 are quoted from the
issue (commit 0c1e57098, `llama-bench -ngl 99 -p 512 -n 128 -fa 1`).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# llama.cpp CUDA on the H200 (from the issue): (pp512, tg128) t/s
LLAMA_CPP = {("Q15", "Q4_K_M"): (27078, 565), ("Q15", "Q4_0"): (28498, 667), ("Q15", "Q8_0"): (31259, 530),
             ("L8", "Q4_K_M"): (9782, 276), ("L8", "Q4_0"): (11408, 334)}
# HF transformers bf16 static cache + torch.compile (from the issue), tg t/s
HF_COMPILED = {"Q15": 264, "L8": 136}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def copy_bandwidth(cp, nbytes=4 << 30, reps=10) -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = cp.empty(nbytes // 4, cp.float32)
    a.fill(1.0)
    b = cp.empty_like(a)
    b[...] = a
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(reps):
        s.record()
        b[...] = a
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(ts)


_RAW = {}


def matvec_bandwidth(cp, qc, qtype, M, K, reps=50) -> float:
    """One decode matvec alone (weights read once), bytes of W per second; rotates
    over enough weights to defeat the L2."""
    from quant import QTensor
    from lab.synth import _Noise, random_weight
    raw = _RAW.get((qtype, M, K))
    if raw is None:                     # made once a run: variants compare the same bytes
        raw = _RAW[(qtype, M, K)] = random_weight(qtype, (M, K), _Noise(1))
    Ws = [qc.upload(QTensor("w", qtype, (M, K), raw)) for _ in range(4)]
    x = cp.asarray(np.random.default_rng(0).standard_normal((1, K)).astype(np.float32))
    y = cp.empty((1, M), cp.float32)
    return Ws[0].nbytes / _graph_seconds(cp, lambda i: qc.matmul(x, [Ws[i]], [y]), len(Ws), reps)


def _graph_seconds(cp, launch, n_bufs, reps) -> float:
    """Seconds per launch(i) (i: which of n_bufs buffers, in turn), replayed from a
    CUDA graph: Python's launch overhead would otherwise be what we time."""
    cp.cuda.runtime.deviceSynchronize()     # inputs written on the default stream must land first
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for j in range(n_bufs):
            launch(j)
        stream.begin_capture()
        for i in range(reps):
            launch(i % n_bufs)
        graph = stream.end_capture()
        graph.launch(stream)
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record(stream)
        graph.launch(stream)
        e.record(stream)
        e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / 1e3 / reps


_READ = r"""
extern "C" __global__ void read16(const uint4* __restrict__ a, long long n, unsigned* out) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(a + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}
// the same with the loads mvk makes (L1::no_allocate) and a .L2::256B prefetch size
extern "C" __global__ void read16p(const uint4* __restrict__ a, long long n, unsigned* out) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a + i));
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}
"""


def read_bandwidth(cp, nbytes, reps=50, kernel="read16") -> float:
    """A read-only streaming kernel over nbytes (4 buffers in turn, past the L2), bytes
    per second: what a matvec of that size could read at best.  kernel: read16
    (ld.global.cs), read16p (ld.global.nc.L1::no_allocate.L2::256B, sm_80+)."""
    f = cp.RawKernel(_READ, kernel)
    bufs = [cp.ones(nbytes // 4, cp.uint32) for _ in range(4)]
    out = cp.zeros(1, cp.uint32)
    n = nbytes // 16
    sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    grid = (min((n + 255) // 256, sms * 8),)
    t = _graph_seconds(cp, lambda i: f(grid, (256,), (bufs[i], np.int64(n), out)), len(bufs), reps)
    return nbytes / t


def mega_sweep(eng, configs, n_gen=128):
    """Graph replay of one decode step with the megakernel built for each (chunks a slot,
    ring slots cap, L2-prefetch slots before attention / before a barrier) in configs
    (0: the default), on the engine as it is.  n_gen: tg128's, so the replayed step's
    context (and its attention splits) is the main table's."""
    from lab.mega import MegaDecode
    from runtime.bench.speed import time_tg
    be = eng.backend
    out = []
    for cfg in configs:
        be._megas.clear()
        be._graphs.clear()
        try:
            if cfg[0] == "bulk":        # ("bulk", slots, slot KB, flags...)
                mega = MegaDecode(be, eng.model, bulk=(int(cfg[1]), int(cfg[2]) * 1024, cfg[3:]))
            else:
                sub, st, pfa, pfb = (int(v) for v in cfg)
                mega = MegaDecode(be, eng.model, sub=sub or None, max_stages=st or None, pfa=pfa, pfb=pfb)
            be._megas[id(eng.model)] = (eng.model, mega)
            tg = time_tg(eng, n_gen, np.random.default_rng(1))
            ms = be.replay_ms()
            row = dict(mega.config(), tg=tg, replay_ms=ms, failed=mega.failed())
        except Exception as e:
            row = {"config": cfg, "error": f"{type(e).__name__}: {e}"}
        log(f"  mega sweep: {row}")
        out.append(row)
    be._megas.clear()
    be._graphs.clear()
    return out


def mega_profile(eng):
    """Where a megakernel decode step's time goes: a build with clock stamps, a few steps."""
    from lab.mega import MegaDecode
    from runtime.bench.speed import time_tg
    be = eng.backend
    try:
        be._megas.clear()
        be._graphs.clear()
        mega = MegaDecode(be, eng.model, prof=True)
        be._megas[id(eng.model)] = (eng.model, mega)
        time_tg(eng, 4, np.random.default_rng(1))
        prof = mega.profile()
        log("  mega profile (us a step: per op kind, mean over layers): " + "; ".join(
            f"{k} n={v['n']} max {v['max_us']:.2f} mean {v['mean_us']:.2f} quant {v['quant_us']:.2f} "
            f"barrier {v['barrier_us']:.2f}" for k, v in prof.items() if isinstance(v, dict))
            + f"; block total {prof['block_total_us']:.1f}")
    except Exception as e:
        prof = {"error": f"{type(e).__name__}: {e}"}
        log(f"  mega profile failed: {prof['error']}")
    be._megas.clear()
    be._graphs.clear()
    return prof


def tg_host_paths(eng, reps, n_gen, rng, paths):
    """tg n_gen with each host path of the CUDA backend (backend.host_path: "old" packs the
    step anew and brings the logits to the host for np.argmax, "new" fills the graph's
    input in place and takes the argmax on the device), on the same engine, repetitions
    interleaved (old, new, old, new, ...) after one untimed run each.  Per path: the tg
    runs, the graph replay of that path's decode graph after each (ms, 50 replays), and
    host ms a token (1/tg minus the replay)."""
    from runtime.bench.speed import mean_sd, time_tg
    be = eng.backend
    # (the "old" host path left the backend in session 29: "new" had measured faster)
    out = {p: {"runs": [], "replay_runs": []} for p in paths}
    for p in paths:
        time_tg(eng, n_gen, rng)            # warm-up: capture the decode graphs
    for _ in range(reps):
        for p in paths:
            out[p]["runs"].append(time_tg(eng, n_gen, rng))
            out[p]["replay_runs"].append(be.replay_ms())
    for p, r in out.items():
        r["tg"] = mean_sd(r["runs"])
        r["graph_replay_ms"] = statistics.mean(r["replay_runs"])
        hosts = [1e3 / t - ms for t, ms in zip(r["runs"], r["replay_runs"])]
        r["host_ms_per_token"] = statistics.mean(hosts)
        r["host_ms_runs"] = hosts
    return out


def graph_parts(eng, reps=100):
    """GPU microseconds of each piece a decode graph adds around the forward: each piece
    captured `reps` times in a row into one graph, replayed, time / reps.  The step
    buffer's H2D copy (the old path does it before the graph, the new one inside it),
    the argmax kernel writing to the device or into pinned host memory (the new path),
    a 4-byte D2H copy, and the logits row's D2H copy (the old path, after the graph)."""
    import cupy as cp
    be = eng.backend
    rt = cp.cuda.runtime
    sp = be.stream.ptr
    n_in = be._last_graph["host"].size
    V = eng.config.vocab_size
    pinned = lambda n, dt: np.frombuffer(cp.cuda.alloc_pinned_memory(n * np.dtype(dt).itemsize), dt, n)
    host_in, host_id, host_logits = pinned(n_in, np.int32), pinned(1, np.int32), pinned(V, np.float32)
    host_4 = pinned(1, np.int32)
    dev_in = cp.zeros(n_in, cp.int32)
    with be.stream:
        x = cp.random.default_rng(0).standard_normal((1, V), dtype=cp.float32)
        dev_id = cp.zeros(1, cp.int32)
    parts = {
        "h2d_step": lambda: rt.memcpyAsync(dev_in.data.ptr, host_in.ctypes.data, host_in.nbytes,
                                           rt.memcpyHostToDevice, sp),
        "argmax_to_device": lambda: be._argmax(x),
        "argmax_to_host": lambda: be._argmax(x, host_out=host_id),
        "d2h_4_bytes": lambda: rt.memcpyAsync(host_4.ctypes.data, dev_id.data.ptr, 4, rt.memcpyDeviceToHost, sp),
        "d2h_logits": lambda: rt.memcpyAsync(host_logits.ctypes.data, x.data.ptr, x.nbytes, rt.memcpyDeviceToHost, sp),
    }
    out = {}
    with be.stream:
        for name, f in parts.items():
            f()
            be.stream.begin_capture()
            try:
                for _ in range(reps):
                    f()
            finally:
                graph = be.stream.end_capture()
            graph.launch(be.stream)
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record(be.stream)
            graph.launch(be.stream)
            e.record(be.stream)
            e.synchronize()
            out[name] = 1e3 * cp.cuda.get_elapsed_time(s, e) / reps
    be.stream.synchronize()
    assert int(host_id[0]) == int(np.argmax(x.get()[0]))
    log("  graph parts (us each, in a graph): " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    return out


def bench_ours(path, reps, n_prompt, n_gen, sweep=None, profile=False, host_paths=("new",), parts=False):
    import cupy as cp
    from lab.synth import load_weights_only
    from runtime.bench.speed import measure, time_pp, weight_bytes_per_token
    from runtime.engine import Engine
    lm = load_weights_only(path)
    t0 = time.perf_counter()
    eng = Engine(lm, device="cuda", n_ctx=max(1024, n_prompt + n_gen + 16))
    load_s = time.perf_counter() - t0
    est = eng.backend.estimate
    rng = np.random.default_rng(0)
    pp = measure(lambda: time_pp(eng, n_prompt, rng), reps, eng)
    by_host = tg_host_paths(eng, reps, n_gen, rng, host_paths)
    main_path = "new" if "new" in host_paths else host_paths[-1]
    main = by_host[main_path]
    tg = main["tg"]
    mem = eng.backend.memory_report()
    replay = main["graph_replay_ms"]
    parts_us = graph_parts(eng) if parts else None
    # one decode step eagerly, op by op, for where the time goes
    seq = eng.new_sequence()
    eng.step([seq], [[100] * 64])
    eng.backend.profile_next = True
    eng.step([seq], [[101]])
    eng.release(seq)
    prof = eng.backend.last_profile
    per_tok = weight_bytes_per_token(lm)       # (a mixture of experts: the chosen experts' share)
    row = {"pp": pp, "tg": tg, "load_s": load_s, "weight_bytes": lm.weight_bytes,
           "bytes_per_token": per_tok, "weight_GBps": per_tok * tg[0] / 1e9, "memory": mem,
           "estimate": est, "graph_replays": eng.backend.graph_replays,
           "graph_replay_ms": replay, "graph_tg": 1e3 / replay, "graph_GBps": per_tok / replay / 1e6,
           "host_ms_per_token": main["host_ms_per_token"], "host_path": main_path, "by_host": by_host, "graph_parts_us": parts_us,
           "profile_ms": prof, "profile_total_ms": sum(t for _, t in prof)}
    row["pdl"] = eng.backend.use_pdl
    mega = eng.backend._megas.get(id(eng.model))
    row["mega"] = (mega[1].config() if mega and not isinstance(mega[1], str) else (mega[1] if mega else None))
    for p, r in by_host.items():
        log(f"  host path {p}: tg {r['tg'][0]:.1f} ± {r['tg'][1]:.1f} t/s, graph replay {r['graph_replay_ms']:.4f} ms, "
            f"host {r['host_ms_per_token']:.4f} ms a token (runs {', '.join(f'{h:.4f}' for h in r['host_ms_runs'])})")
    log(f"  decode step: graph replay {replay:.3f} ms ({1e3 / replay:.0f} t/s); megakernel {row['mega']}; "
        f"eager op sum {row['profile_total_ms']:.3f} ms; top ops: " + "; ".join(f"{k} {v:.3f}" for k, v in prof[:8]))
    if sweep:
        row["mega_sweep"] = mega_sweep(eng, sweep)
    if profile:
        row["mega_profile"] = mega_profile(eng)
    del eng, lm
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    return row


def bench_hf(shape, reps, n_prompt, n_gen):
    import torch
    import transformers
    spec = dict(shape)
    common = dict(hidden_size=spec["d_model"], intermediate_size=spec["d_ff"], num_hidden_layers=spec["n_layers"],
                  num_attention_heads=spec["n_heads"], num_key_value_heads=spec["n_kv_heads"],
                  vocab_size=spec["vocab"], rope_theta=spec["rope_theta"], max_position_embeddings=4096,
                  tie_word_embeddings=spec["tied"])
    if spec["arch"] == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    else:
        cfg = transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        except TypeError:
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model = model.eval()
    vocab = spec["vocab"]

    def pp():
        ids = torch.randint(100, vocab - 1000, (1, n_prompt), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=True)
        torch.cuda.synchronize()
        return n_prompt / (time.perf_counter() - t)

    def tg():
        ids = torch.randint(100, vocab - 1000, (1, 1), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n_gen, min_new_tokens=n_gen, do_sample=False)
        torch.cuda.synchronize()
        assert out.shape[1] == n_gen + 1
        return n_gen / (time.perf_counter() - t)

    from runtime.bench.speed import measure
    row = {"pp": measure(pp, reps), "tg": measure(tg, reps), "transformers": transformers.__version__,
           "torch": torch.__version__}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="Q15,L8")
    ap.add_argument("--mixes", default="Q4_K_M,Q4_0,Q8_0")
    ap.add_argument("--dir", default="/tmp/llamba-bench")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--hf", action="store_true", help="also HF transformers bf16 on the same GPU")
    ap.add_argument("--micro", action="store_true", help="matvec bandwidth of single kernels")
    ap.add_argument("--micro-types", default="", help="only these weight types in --micro (e.g. Q6_K,Q4_0)")
    ap.add_argument("--micro-shapes", default="", help="only these matvecs in --micro (e.g. Q4_K:14336x4096,Q6_K:4096x14336)")
    ap.add_argument("--micro-reps", type=int, default=1,
                    help="--micro: the variants measured this many times in turn (v1, v2, .., v1, v2, ..); "
                         "each variant's GB/s the mean")
    ap.add_argument("--model-variants", default="",
                    help="variants for the whole-model runs (default: --variants); 'best': the --micro variant "
                         "with the highest geometric mean GB/s other than the first")
    ap.add_argument("--rpw", default="", help="float matvec rows-per-block values to compare (e.g. 2,4,8)")
    ap.add_argument("--rpw-int8", default="", help="integer matvec rows-per-warp values to compare (e.g. 1,2,4)")
    ap.add_argument("--ncu-kernel", action="store_true", help="run one Q4_K matvec eagerly (for ncu) and exit")
    ap.add_argument("--variants", default="int8",
                    help="decode paths to measure: int8 (default: a kernel an op, the default integer matvec), mvs, "
                         "mvk (integer matvec with weights straight into registers, persistent grid; mvk4: for Q4_K "
                         "alone, mvkr: for Q4_K, Q6_K, Q4_0 where MVK_RULES allows, mvkall: every shape of them), mega "
                         "(the decode megakernel, LLAMBA_CUDA_MEGA=1), float, fmv (float weights by the generic mv, not mvf); any of them @HINTS: with the weight loads' cache hints "
                         "(quant.cuda.W_HINT / W_PF), HINTS '+'-joined of 256 (.L2::256B), 128 (.L2::128B), ef "
                         "(L2 evict_first), 256ef / 128ef (both), h0 (none), pfN (mvk: prefetch.global.L2 N steps ahead), "
                         "pdlN (captured steps with programmatic dependent launch, quant/cuda/pdl.py MODE N), stN (mvk pipeline stages), "
                         "fuN / frN / frsN (mvf: word steps a group, rows a warp above / at most 4096 rows), irsN (integer "
                         "matvec's rows a warp at most 4096 rows), "
                         "e.g. int8@256+pf4")
    ap.add_argument("--mvk-sweep", default="",
                    help="mvk configs R:BPS[:S[:NA]],... (rows a warp : blocks an SM, 0 = occupancy : stages : "
                         "weights past L1) timed on Q4_K matvecs")
    ap.add_argument("--mega-sweep", default="",
                    help="megakernel configs to time on L8 (each mix run with the mega variant) after its run: "
                         "sub:stages:pfa:pfb,... (0 for sub/stages: the default), e.g. 4:0:4:1,2:0:4:1; for the "
                         "bulk-copy ring (Q8_0, sm_90+) bulk:slots:slot KB[:flags], e.g. bulk:4:32,bulk:4:32:XATT")
    ap.add_argument("--mega-profile", action="store_true", help="time each op of a megakernel step (clock stamps)")
    ap.add_argument("--graph-parts", action="store_true",
                    help="time the pieces a decode graph adds around the forward (copies, argmax)")
    ap.add_argument("--keep", action="store_true", help="keep the model files in --dir (e.g. for llama-bench after)")
    ap.add_argument("--tokenizer", default=None,
                    help="a GGUF whose tokenizer the files get (llama.cpp loads none without; .devmodels/qwen-tok.tok)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import cupy as cp
    import quant.cuda as qc
    from quant import GGMLType
    from runtime.backend.cuda import probe
    from lab.synth import SHAPES, write_random_gguf
    info = probe()
    if args.ncu_kernel:
        from quant import QTensor
        from lab.synth import _Noise, random_weight
        for qt in (GGMLType.Q4_K, GGMLType.Q8_0):
            W = qc.upload(QTensor("w", qt, (14336, 4096), random_weight(qt, (14336, 4096), _Noise(1))))
            x = cp.ones((1, 4096), cp.float32)
            y = cp.empty((1, 14336), cp.float32)
            for _ in range(4):
                qc.matmul(x, [W], [y])
        cp.cuda.runtime.deviceSynchronize()
        return
    bw = copy_bandwidth(cp)
    log(f"device {info['name']} sm_{info['cc']}, copy bandwidth {bw / 1e9:.0f} GB/s")
    result = {"device": info, "copy_GBps": bw / 1e9, "runs": [], "micro": []}
    for rpw in ([int(v) for v in args.rpw.split(",")] if args.rpw else []):
        qc.set_rows_per_block(rpw)
        for qt, M, K in [(GGMLType.Q4_K, 14336, 4096), (GGMLType.Q4_K, 4096, 14336), (GGMLType.Q4_0, 14336, 4096)]:
            g = matvec_bandwidth(cp, qc, qt, M, K) / 1e9
            log(f"rows/block {rpw}: matvec {qt.name} {M}x{K}: {g:.0f} GB/s")
    if args.rpw:
        qc.set_rows_per_block(4)
    import lab.mega as cm
    int8_default, kernel_default, mega_default = qc.INT8_MATVEC, qc.INT8_KERNEL, cm.ENABLED
    mvk_on_default, rules_default = set(qc.MVK_ON), qc.MVK_RULES
    hints_default = (qc.W_HINT, qc.W_PF)
    float_mv_default = qc.FLOAT_MV
    mvf_default = (qc.MVF_U, qc.MVF_ROWS, qc.MVF_ROWS_SMALL)
    int8_rs_default = qc.INT8_ROWS_SMALL
    pdl_default = qc.pdl.MODE
    stages_default = qc.MVK_STAGES
    mvk_cfg_default = (qc.MVK_ROWS, qc.MVK_BPS, qc.MVK_STAGES, qc.MVK_V)
    hint_codes = {"256": 1, "128": 2, "ef": 3, "256ef": 4, "128ef": 5}

    def use(variant):
        variant, _, hints = variant.partition("@")
        h, pf = hints_default
        qc.pdl.MODE = pdl_default
        qc.MVK_STAGES = stages_default
        qc.MVF_U, qc.MVF_ROWS, qc.MVF_ROWS_SMALL = mvf_default
        qc.INT8_ROWS_SMALL = int8_rs_default
        for tok in [t for t in hints.split("+") if t]:
            if tok.startswith("irs"):
                qc.INT8_ROWS_SMALL = int(tok[3:])
            elif tok.startswith("fu"):
                qc.MVF_U = int(tok[2:])
            elif tok.startswith("frs"):
                qc.MVF_ROWS_SMALL = int(tok[3:])
            elif tok.startswith("fr"):
                qc.MVF_ROWS = int(tok[2:])
            elif tok.startswith("pdl"):
                qc.pdl.MODE = int(tok[3:])
            elif tok.startswith("st"):
                qc.MVK_STAGES = int(tok[2:])
            elif tok.startswith("pf"):
                pf = int(tok[2:])
            elif tok == "h0":
                h = 0
            else:
                h = hint_codes[tok]
        qc.set_weight_hints(h, pf)
        # mvk: mvk for the default types (qc.MVK_ON); mvk4: for Q4_K alone; mvkr: for all of
        # qc.MVK_TYPES where MVK_RULES allows; mvkall: every shape of all of them
        qc.INT8_MATVEC = variant in ("int8", "mvk", "mvkr", "mvkall", "mvk4", "mvs", "mega", "fmv")
        qc.FLOAT_MV = "mv" if variant == "fmv" else float_mv_default
        qc.set_int8_kernel("mvk" if variant in ("mvk4", "mvkr", "mvkall") else variant if variant in ("mvk", "mvs")
                           else ("mvs" if variant == "mega" else kernel_default))
        qc.MVK_ON = ({GGMLType.Q4_K} if variant == "mvk4" else set(qc.MVK_TYPES) if variant in ("mvkr", "mvkall")
                     else set(mvk_on_default))
        qc.MVK_RULES = rules_default and variant != "mvkall"
        cm.ENABLED = variant == "mega"

    for rpw in ([int(v) for v in args.rpw_int8.split(",")] if args.rpw_int8 else []):
        qc.set_int8_rows_per_warp(rpw)
        for qt, M, K in [(GGMLType.Q4_K, 14336, 4096), (GGMLType.Q6_K, 4096, 14336), (GGMLType.Q4_0, 14336, 4096),
                         (GGMLType.Q8_0, 14336, 4096), (GGMLType.Q4_K, 1024, 4096)]:
            g = matvec_bandwidth(cp, qc, qt, M, K) / 1e9
            log(f"int8 rows/warp {rpw}: matvec {qt.name} {M}x{K}: {g:.0f} GB/s")
    if args.rpw_int8:
        qc.set_int8_rows_per_warp(4)
    if args.mvk_sweep:
        # mvk's rows a warp (R) and resident blocks an SM (0: its occupancy), single matvecs
        use("mvk")
        for cfg in args.mvk_sweep.split(","):
            r, b, st, na = ([int(v) for v in cfg.split(":")] + [2, 0])[:4]
            qc.MVK_ROWS, qc.MVK_BPS, qc.MVK_STAGES, qc.MVK_V = r, b, st, na
            qc._mods.by_type.clear()
            qc._bps.clear()
            for qt, M, K in [(GGMLType.Q4_K, 14336, 4096), (GGMLType.Q4_K, 4096, 14336), (GGMLType.Q4_K, 4096, 4096),
                             (GGMLType.Q4_K, 8960, 1536)]:
                g = matvec_bandwidth(cp, qc, qt, M, K) / 1e9
                log(f"mvk R={r} bps={b} S={st} V={na}: matvec {qt.name} {M}x{K}: {g:.0f} GB/s ({100 * g / (bw / 1e9):.0f}% of copy)"
                    f" occupancy {dict(qc._bps)}")
        qc.MVK_ROWS, qc.MVK_BPS, qc.MVK_STAGES, qc.MVK_V = mvk_cfg_default
        qc._mods.by_type.clear()
        qc._bps.clear()
        qc.INT8_MATVEC = int8_default
        qc.set_int8_kernel(kernel_default)
    if args.micro:
        for kern in ("read16", "read16p") if int(info["cc"]) >= 80 else ("read16",):
            for nbytes in (33030144, 8257536, 1 << 30):
                g = read_bandwidth(cp, nbytes, kernel=kern) / 1e9
                log(f"read-only kernel {kern} {nbytes} bytes: {g:.0f} GB/s ({100 * g / (bw / 1e9):.0f}% of copy)")
                result.setdefault("read", []).append({"kernel": kern, "bytes": nbytes, "GBps": g})
        # single matvecs: the megakernel's are mvs's (variant int8)
        for variant in [v for _ in range(args.micro_reps)
                        for v in dict.fromkeys("int8" if v == "mega" else v for v in args.variants.split(","))]:
            use(variant)
            for qt, M, K in [(GGMLType.Q4_K, 14336, 4096), (GGMLType.Q4_K, 4096, 14336), (GGMLType.Q4_K, 4096, 4096),
                             (GGMLType.Q6_K, 4096, 14336), (GGMLType.Q4_0, 14336, 4096),
                             (GGMLType.Q8_0, 14336, 4096), (GGMLType.Q4_K, 8960, 1536),
                             (GGMLType.Q6_K, 151936, 1536), (GGMLType.Q6_K, 128256, 4096),
                             (GGMLType.Q6_K, 1536, 8960), (GGMLType.Q6_K, 1024, 4096),
                             (GGMLType.Q4_0, 4096, 14336), (GGMLType.Q4_0, 4096, 4096),
                             (GGMLType.Q4_0, 8960, 1536), (GGMLType.Q4_0, 1536, 8960),
                             (GGMLType.F16, 14336, 4096), (GGMLType.F16, 4096, 14336), (GGMLType.F16, 4096, 4096),
                             (GGMLType.F16, 1024, 4096), (GGMLType.F16, 128256, 4096), (GGMLType.BF16, 14336, 4096),
                             # gpt-oss-20b's experts (d_model = expert width = 2880) and MXFP4 at L8's width
                             (GGMLType.MXFP4, 2880, 2880), (GGMLType.Q4_0, 2880, 2880), (GGMLType.Q8_0, 2880, 2880),
                             (GGMLType.MXFP4, 14336, 4096)]:
                if args.micro_types and qt.name not in args.micro_types.split(","):
                    continue
                if args.micro_shapes and f"{qt.name}:{M}x{K}" not in args.micro_shapes.split(","):
                    continue
                g = matvec_bandwidth(cp, qc, qt, M, K) / 1e9
                result["micro"].append({"variant": variant, "type": qt.name, "M": M, "K": K, "GBps": g,
                                        "of_copy": g / (bw / 1e9)})
                kn = (qc._int8_name(qt, 1, M, K) if qt in qc.INT8_STRUCT
                      else qc._mvf_name(qt, 1, M) if qc._mvf_applies(qt, K) else "mv")
                bps = qc._bps.get((kn, qc.W_HINT, qc.W_PF))
                log(f"{variant} matvec {qt.name} {M}x{K}: {g:.0f} GB/s ({100 * g / (bw / 1e9):.0f}% of copy)  "
                    f"[{kn}{f', {bps} blocks an SM' if bps else ''}]")
        qc.INT8_MATVEC = int8_default
        qc.set_int8_kernel(kernel_default)
        qc.MVK_ON, qc.MVK_RULES = set(mvk_on_default), rules_default
        qc.set_weight_hints(*hints_default)
        cm.ENABLED = mega_default
        # each variant against the first over the same matvecs: geometric mean of the ratios
        names = list(dict.fromkeys(r["variant"] for r in result["micro"]))
        if names:
            mean = {}                         # (variant, matvec) -> GB/s runs
            for r in result["micro"]:
                mean.setdefault((r["variant"], r["type"], r["M"], r["K"]), []).append(r["GBps"])
            mean = {k: statistics.mean(v) for k, v in mean.items()}
            result["micro_mean"] = [dict(zip(("variant", "type", "M", "K"), k), GBps=g, of_copy=g / (bw / 1e9))
                                    for k, g in mean.items()]
            if args.micro_reps > 1:
                for (v, t, M, K), g in mean.items():
                    log(f"mean of {args.micro_reps}: {v} matvec {t} {M}x{K}: {g:.0f} GB/s ({100 * g / (bw / 1e9):.1f}% of copy)")
            gm = {}
            for v in names:
                rs = [g / mean[(names[0],) + k[1:]] for k, g in mean.items() if k[0] == v]
                gm[v] = float(np.exp(np.mean(np.log(rs))))
                log(f"micro {v}: geometric mean {gm[v]:.4f} x {names[0]} over {len(rs)} matvecs")
            result["micro_gmean"] = gm
            result["best"] = max(names[1:], key=gm.get) if len(names) > 1 else names[0]
            log(f"best micro variant: {result['best']}")
    model_variants = [result.get("best", v) if v == "best" else v
                      for v in (args.model_variants or args.variants).split(",")]
    sweep = [tuple(c.split(":")) for c in args.mega_sweep.split(",") if c]
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    for shape in [v for v in args.shapes.split(",") if v]:
        spec = SHAPES[shape]
        for mix in args.mixes.split(","):
            path = d / f"{shape}-{mix}.gguf"
            t = time.perf_counter()
            write_random_gguf(path, mix=mix, tokenizer_from=args.tokenizer, **spec)
            log(f"{path.name}: written in {time.perf_counter() - t:.1f}s, {path.stat().st_size / 2**30:.2f} GiB")
            for variant in model_variants:
                use(variant)
                try:
                    row = bench_ours(path, args.repetitions, args.n_prompt, args.n_gen,
                                     sweep=sweep if (variant == "mega" and shape == "L8") else None,
                                     profile=args.mega_profile and variant == "mega",
                                     parts=args.graph_parts)
                except Exception as e:     # report and go on to the next model
                    row = {"error": f"{type(e).__name__}: {e}"}
                row.update(shape=shape, mix=mix, engine="llamba-cuda" + ("" if variant == "int8" else "-" + variant))
                log(json.dumps(row, default=str))
                for hp, r in (row.get("by_host") or {}).items():
                    if hp != row["host_path"]:      # the other host paths: a row each, same pp and profile
                        result["runs"].append(dict(row, engine=row["engine"] + f" (host {hp})", tg=r["tg"],
                                                   graph_replay_ms=r["graph_replay_ms"],
                                                   graph_tg=1e3 / r["graph_replay_ms"],
                                                   graph_GBps=row["bytes_per_token"] / r["graph_replay_ms"] / 1e6,
                                                   weight_GBps=row["bytes_per_token"] * r["tg"][0] / 1e9,
                                                   host_ms_per_token=r["host_ms_per_token"], host_path=hp))
                result["runs"].append(row)
            qc.INT8_MATVEC = int8_default
            qc.set_int8_kernel(kernel_default)
            qc.MVK_ON, qc.MVK_RULES = set(mvk_on_default), rules_default
            qc.set_weight_hints(*hints_default)
            cm.ENABLED = mega_default
            if not args.keep:
                path.unlink()
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        if args.hf:
            try:
                row = bench_hf(spec, args.repetitions, args.n_prompt, args.n_gen)
            except Exception as e:
                row = {"error": f"{type(e).__name__}: {e}"}
            row.update(shape=shape, mix="bf16", engine="hf-transformers")
            result["runs"].append(row)
            log(json.dumps(row, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print_table(result)


def print_table(result):
    bw = result["copy_GBps"]
    hf = {r["shape"]: r for r in result["runs"] if r["engine"] == "hf-transformers" and "tg" in r}
    print(f"\ndevice: {result['device']['name']}, copy bandwidth {bw:.0f} GB/s")
    print("| shape | quant | engine | pp512 t/s | tg128 t/s | vs llama.cpp pp / tg | weights GB/s (% copy) "
          "| graph replay ms (weights % copy) | host ms/token | tg vs HF default / compiled |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["runs"]:
        if "error" in r:
            print(f"| {r['shape']} | {r['mix']} | {r['engine']} | error: {r['error'][:80]} |")
            continue
        pp, tg = r["pp"][0], r["tg"][0]
        ref = LLAMA_CPP.get((r["shape"], r["mix"]))
        ours = r["engine"].startswith("llamba-cuda")
        vs = f"{pp / ref[0]:.2f}x / {tg / ref[1]:.2f}x" if ref and ours else ""
        gbs = f"{r['weight_GBps']:.0f} ({100 * r['weight_GBps'] / bw:.0f}%)" if "weight_GBps" in r else ""
        rep = (f"{r['graph_replay_ms']:.4f} ({100 * r['graph_GBps'] / bw:.0f}%)" if "graph_GBps" in r else "")
        host = f"{r['host_ms_per_token']:.4f}" if "host_ms_per_token" in r else ""
        h = hf.get(r["shape"])
        vh = (f"{tg / h['tg'][0]:.1f}x / {tg / HF_COMPILED[r['shape']]:.2f}x"
              if h and ours else "")
        print(f"| {r['shape']} | {r['mix']} | {r['engine']} | {pp:.0f} ± {r['pp'][1]:.0f} | {tg:.1f} ± {r['tg'][1]:.1f} "
              f"| {vs} | {gbs} | {rep} | {host} | {vh} |")


if __name__ == "__main__":
    main()
