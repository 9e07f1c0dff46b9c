"""Micro-benchmark of the quantized CPU matmul: python -m runtime.bench.kernels

For each weight type and real model weight shape it times y = x @ W.T with 1
and 8 activation rows and reports GB/s of weight bytes read, next to a plain
numpy float32 matmul of the same logical size and the machine's measured
memory bandwidth.  Weights are rotated through enough copies to exceed the
last-level cache, so decode-sized calls measure memory, not cache, speed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import quant  # noqa: F401  (first: it points Numba's cache at quant/kernel_cache.py's folder)
import numba
import numpy as np
from numba import njit, prange

from quant import TYPE_INFO, GGMLType, QTensor, Scratch, matmul_into, quantize
from quant.matmul_cpu import kernel_name, matmul_float_fma

# (M, K) in numpy order = (out_features, in_features)
SHAPES = {
    "1536x8960": (1536, 8960),     # Qwen2.5-1.5B ffn_down
    "8960x1536": (8960, 1536),     # Qwen2.5-1.5B ffn_gate / ffn_up
    "49152x576": (49152, 576),     # SmolLM2-135M output (GGUF dims 576 x 49152)
}
REAL_MODEL_TYPES = ["Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q8_0"]


def _llc_bytes() -> int:
    """The largest CPU cache Linux reports (0 where it does not say)."""
    best = 0
    try:
        for d in os.scandir("/sys/devices/system/cpu/cpu0/cache"):
            try:
                with open(os.path.join(d.path, "size")) as f:
                    v = f.read().strip()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
            best = max(best, int(v.rstrip("KMG") or 0) * mult)
    except OSError:
        pass
    return best


# weights rotated through more than twice the last-level cache (at least 96 MiB):
# a fixed 96 MiB left this bench reading a 300 MiB-L3 Xeon's cache, not its memory
ROTATE_BYTES = max(96 << 20, 2 * _llc_bytes())


def _weights(qtype: GGMLType, M: int, K: int, rng) -> np.ndarray:
    """Realistic bytes for qtype: encoded from Gaussians where an encoder exists,
    otherwise random quants with small finite f16 scales (speed does not depend
    on the values)."""
    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
                 GGMLType.Q4_K, GGMLType.MXFP4):
        return quantize(rng.standard_normal((M, K), np.float32) * np.float32(0.02), qtype)
    be, bb = TYPE_INFO[qtype]
    raw = rng.integers(0, 256, (M, K // be, bb), dtype=np.uint8)
    halves = {GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
              GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}[qtype]
    for off in halves:
        s = rng.uniform(-0.01, 0.01, (M, K // be)).astype(np.float16)
        raw[:, :, off:off + 2] = s.view(np.uint8).reshape(M, K // be, 2)
    return raw.reshape(M, -1)


CLOCK = time.perf_counter


def _time(fn, reps: int, min_time: float = 0.3) -> float:
    """Median seconds per call over `reps` timed batches (after one warm-up)."""
    fn()
    t0 = CLOCK()
    fn()
    one = max(CLOCK() - t0, 1e-7)
    inner = max(1, int(min_time / reps / one))
    ts = []
    for _ in range(reps):
        t0 = CLOCK()
        for _ in range(inner):
            fn()
        ts.append((CLOCK() - t0) / inner)
    return float(np.median(ts))


@njit(cache=True, fastmath=True)
def _read_chunk(a, lo, hi):
    b = a[lo:hi]   # (indexing a[i] with i from range(lo, hi) would keep Numba's
    s = np.float32(0.0)   # negative-index check and block vectorization)
    for i in range(b.size):
        s += b[i]
    return s


@njit(parallel=True, cache=True)
def _parallel_read(a, nch):
    # stream the buffer once with all threads (a vectorized float32 sum per chunk)
    n = a.size
    per = (n + nch - 1) // nch
    part = np.zeros(nch, np.float32)
    for c in prange(nch):
        part[c] = _read_chunk(a, c * per, min(n, (c + 1) * per))
    return part.sum()


def memory_bandwidth(nbytes: int = 256 << 20, reps: int = 7) -> dict:
    """copy: np.copyto of nbytes (one thread), counted as read + write
    (STREAM convention).  read: all threads summing a buffer (what a matvec does)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    t = _time(lambda: np.copyto(b, a), reps, 0.5)
    nch = 8 * numba.get_num_threads()
    tr = _time(lambda: _parallel_read(a, nch), reps, 0.5)
    return {"copy_GBps": 2 * nbytes / t / 1e9, "read_GBps": nbytes / tr / 1e9}


def bench_one(qtype: GGMLType, M: int, K: int, rows: int, rng, reps: int, fma: bool = False) -> dict:
    raw = _weights(qtype, M, K, rng)
    copies = max(1, math.ceil(ROTATE_BYTES / raw.nbytes))
    Ws = [QTensor(f"w{i}", qtype, (M, K), raw if i == 0 else raw.copy()) for i in range(copies)]
    x = rng.standard_normal((rows, K)).astype(np.float32)
    out = np.empty((rows, M), np.float32)
    scratch = Scratch()
    it = [0]

    def step():
        matmul_into(x, Ws[it[0] % copies], out, scratch)
        it[0] += 1

    t = _time(step, reps)
    res = {"type": qtype.name, "shape": f"{M}x{K}", "rows": rows, "weight_MB": raw.nbytes / 1e6,
           "ms": t * 1e3, "GBps": raw.nbytes / t / 1e9, "kernel": kernel_name(qtype, rows, K)}
    if fma and qtype not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) and rows < 32:
        def step_fma():
            matmul_float_fma(x, Ws[it[0] % copies], out, scratch)
            it[0] += 1
        tf = _time(step_fma, reps)
        res["fma_variant_GBps"] = raw.nbytes / tf / 1e9
    return res


def bench_numpy_f32(M: int, K: int, rows: int, rng, reps: int) -> dict:
    w = rng.standard_normal((M, K), np.float32)
    copies = max(1, math.ceil(ROTATE_BYTES / w.nbytes))
    ws = [w] + [w.copy() for _ in range(copies - 1)]
    x = rng.standard_normal((rows, K)).astype(np.float32)
    out = np.empty((rows, M), np.float32)
    it = [0]

    def step():
        np.matmul(x, ws[it[0] % copies].T, out=out)
        it[0] += 1

    t = _time(step, reps)
    return {"type": "numpy-f32", "shape": f"{M}x{K}", "rows": rows, "weight_MB": w.nbytes / 1e6,
            "ms": t * 1e3, "GBps": w.nbytes / t / 1e9, "kernel": "np.matmul"}


def call_overhead(qtype: GGMLType = GGMLType.Q4_1, M: int = 576, K: int = 576, reps: int = 7) -> dict:
    """Per-call cost on a small (cache-resident) matrix: what ~150 calls per token pay."""
    rng = np.random.default_rng(0)
    W = QTensor("w", qtype, (M, K), _weights(qtype, M, K, rng))
    x = rng.standard_normal((1, K)).astype(np.float32)
    out = np.empty((1, M), np.float32)
    s = Scratch()
    t_into = _time(lambda: matmul_into(x, W, out, s), reps)
    from quant import matmul
    t_mm = _time(lambda: matmul(x, W, out), reps)
    Wt = QTensor("t", GGMLType.Q8_0, (32, 32), _weights(GGMLType.Q8_0, 32, 32, rng))
    xt = x[:, :32].copy()
    ot = np.empty((1, 32), np.float32)
    t_tiny = _time(lambda: matmul_into(xt, Wt, ot, s), reps)
    return {"type": qtype.name, "shape": f"{M}x{K}", "matmul_into_us": t_into * 1e6,
            "matmul_us": t_mm * 1e6, "tiny_32x32_matmul_into_us": t_tiny * 1e6}


ASM_OPS = ["vpdpbusd", "vpdpwssd", "vpmaddubsw", "vpmaddwd", "vpmullw", "vcvtph2ps", "vfmadd",
           "vcvtdq2ps", "zmm", "ymm"]


def asm_report() -> dict:
    """Count SIMD instructions in the generated code of each type's row kernel.

    Cached Numba code cannot be inspected, so each kernel's Python source is
    compiled afresh (same flags, no cache) on a small input."""
    import re

    from quant import kernels_float as KF, kernels_k as KK, kernels_legacy as KL
    from quant.act_quant import quantize_q8_32, quantize_q8_256
    rng = np.random.default_rng(0)
    K, M = 512, 4
    x = rng.standard_normal((2, K)).astype(np.float32)
    rep = {}

    def count(name, fn, *args):
        g = numba.njit(fastmath=True)(fn.py_func)
        g(*args)
        asm = g.inspect_asm(g.signatures[0])
        rep[name] = {op: len(re.findall(r"\b" + op, asm)) for op in ASM_OPS}

    x32 = (np.empty((2, K), np.int16), np.empty((2, K // 32), np.float32), np.empty((2, K // 32), np.float32))
    quantize_q8_32(x, *x32)
    x256 = (np.empty((2, K), np.int16), np.empty((2, K // 256), np.float32), np.empty((2, K // 32), np.int32))
    quantize_q8_256(x, *x256)
    out = np.empty((2, M), np.float32)
    for t, fn in [(GGMLType.Q4_0, KL.rows_q4_0), (GGMLType.Q4_1, KL.rows_q4_1), (GGMLType.Q5_0, KL.rows_q5_0),
                  (GGMLType.Q5_1, KL.rows_q5_1), (GGMLType.Q8_0, KL.rows_q8_0)]:
        w = QTensor("w", t, (M, K), _weights(t, M, K, rng)).data
        count(t.name, fn, w, *x32, out, np.empty(K, np.int16), np.empty((2, K // 32), np.float32),
              np.empty(32, np.float32), 0, M)
    for t, fn in [(GGMLType.Q4_K, KK.rows_q4_k), (GGMLType.Q5_K, KK.rows_q5_k), (GGMLType.Q6_K, KK.rows_q6_k)]:
        w = QTensor("w", t, (M, K), _weights(t, M, K, rng)).data
        count(t.name, fn, w, *x256, out, np.empty(2, np.float32), np.empty(256, np.int16),
              np.empty(8, np.int32), 0, M)
    w = QTensor("w", GGMLType.Q4_K, (M, K), _weights(GGMLType.Q4_K, M, K, rng)).data
    count("fma-variant", KF.rows_dequant_fma, int(GGMLType.Q4_K), x, w, out, np.empty(K, np.float32), 32, 0, M)
    count("F16", KF.rows_f16, x, rng.standard_normal((M, K)).astype(np.float16).view(np.uint16), out,
          np.empty(K, np.float32), False, 0, M)
    count("F32", KF.rows_f32, x, rng.standard_normal((M, K)).astype(np.float32), out, 0, M)
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(t.name for t in TYPE_INFO),
                    help="comma-separated GGML types (default: all 12; 'real' = types in the test models)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated MxK (numpy order)")
    ap.add_argument("--rows", default="1,8", help="comma-separated activation row counts")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions (median reported)")
    ap.add_argument("--threads", type=int, default=0, help="Numba threads (default: all)")
    ap.add_argument("--fma", action="store_true",
                    help="also time the float-FMA variant (dequantize row, f32 FMA) of each quantized type")
    ap.add_argument("--asm", action="store_true",
                    help="print the SIMD instructions in each type's kernel and exit")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: elapsed time (default); cpu: process CPU time - on a machine shared "
                         "with other busy processes, use with --threads 1 to measure what one core does "
                         "while it runs")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    ap.add_argument("--int16", action="store_true",
                    help="time the portable int16 kernels even where the CPU has AVX512-VNNI")
    a = ap.parse_args(argv)
    if a.asm:
        for name, counts in asm_report().items():
            print(f"{name:>12}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v))
        return 0
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.int16:
        from quant import matmul_cpu
        matmul_cpu.USE_VNNI = False
    if a.threads:
        numba.set_num_threads(a.threads)
    types = REAL_MODEL_TYPES if a.types == "real" else [t.strip() for t in a.types.split(",") if t.strip()]
    from quant.types import SUPPORTED
    by_name = {GGMLType(t).name.upper(): GGMLType(t) for t in SUPPORTED}
    unknown = [t for t in types if t.upper() not in by_name]
    if unknown:
        print(f"error: unknown type(s) {', '.join(unknown)}; choose from {', '.join(by_name)}", file=sys.stderr)
        return 2
    types = [by_name[t.upper()] for t in types]
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",") if s.strip()]
    rows = [int(r) for r in a.rows.split(",")]
    rng = np.random.default_rng(0)

    bw = memory_bandwidth()
    res = {"machine": {"cpus": os.cpu_count(), "numba_threads": numba.get_num_threads(), "clock": a.clock,
                       "load_avg_1min": os.getloadavg()[0], **bw},
           "overhead": call_overhead(), "results": []}
    if not a.json:
        print(f"memory bandwidth: copy {bw['copy_GBps']:.1f} GB/s (np.copyto, read+write), "
              f"parallel read {bw['read_GBps']:.1f} GB/s; numba threads {numba.get_num_threads()}; "
              f"{a.clock} clock; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        o = res["overhead"]
        print(f"per-call time {o['type']} {o['shape']} n=1: matmul_into {o['matmul_into_us']:.1f} us, "
              f"matmul {o['matmul_us']:.1f} us; fixed overhead (Q8_0 32x32): "
              f"{o['tiny_32x32_matmul_into_us']:.1f} us")
        print(f"{'type':>9} {'shape':>10} {'rows':>4} {'MB':>7} {'ms':>8} {'GB/s':>6} "
              f"{'%copy':>6} {'%read':>6} {'f32 GB/s':>8} {'fma GB/s':>8}  kernel")
    for (M, K) in shapes:
        for n in rows:
            ref = bench_numpy_f32(M, K, n, rng, a.reps)
            res["results"].append(ref)
            for t in types:
                if K % TYPE_INFO[t][0]:
                    continue   # e.g. K-quants need K % 256 == 0; SmolLM2's 576 is not
                r = bench_one(t, M, K, n, rng, a.reps, fma=a.fma)
                r["pct_copy_bw"] = 100 * r["GBps"] / bw["copy_GBps"]
                r["pct_read_bw"] = 100 * r["GBps"] / bw["read_GBps"]
                r["numpy_f32_GBps"] = ref["GBps"]
                res["results"].append(r)
                if not a.json:
                    print(f"{r['type']:>9} {r['shape']:>10} {n:>4} {r['weight_MB']:7.2f} {r['ms']:8.3f} "
                          f"{r['GBps']:6.1f} {r['pct_copy_bw']:5.0f}% {r['pct_read_bw']:5.0f}% "
                          f"{ref['GBps']:8.1f} {r.get('fma_variant_GBps', float('nan')):8.1f}  "
                          f"{r['kernel']}", flush=True)
    if a.json:
        json.dump(res, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
