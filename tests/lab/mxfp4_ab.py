"""MXFP4 against Q4_0 / Q8_0 on one matrix shape, alternating call by call in one process
(a shared machine's speed drifts by more than the difference between kernels: medians of
per-round ratios, as quant/NOTES.md asks).

    PYTHONPATH=tests python -m lab.mxfp4_ab --shape 2880x2880 --rows 1,8,64,512 -t 2 --rounds 30

Each round times every type once (a batch of calls lasting ~20 ms, weights rotated
through copies larger than the last-level cache for 1-16 rows); prints per type the
median ms a call and the median of the round-by-round ratio to MXFP4.
"""
from __future__ import annotations

import argparse
import math
import time

import numba
import numpy as np

from quant import GGMLType, QTensor, Scratch, matmul_into, quantize
from runtime.bench.kernels import ROTATE_BYTES


def _weights(qt, M, K, rng, copies):
    raw = quantize(rng.standard_normal((M, K), np.float32) * np.float32(0.02), qt)
    return [QTensor(f"w{i}", qt, (M, K), raw if i == 0 else raw.copy()) for i in range(copies)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2880x2880")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--types", default="MXFP4,Q4_0,Q8_0")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--cpu", action="store_true", help="process CPU time instead of wall time")
    a = ap.parse_args(argv)
    if a.threads:
        numba.set_num_threads(a.threads)
    clock = time.process_time if a.cpu else time.perf_counter
    M, K = (int(v) for v in a.shape.lower().split("x"))
    types = [GGMLType[t] for t in a.types.split(",")]
    rng = np.random.default_rng(0)
    for n in (int(r) for r in a.rows.split(",")):
        x = rng.standard_normal((n, K)).astype(np.float32)
        out = np.empty((n, M), np.float32)
        sets = {}
        for t in types:
            nb = M * K // 32 * {GGMLType.MXFP4: 17, GGMLType.Q4_0: 18, GGMLType.Q8_0: 34}.get(t, 34)
            sets[t] = _weights(t, M, K, rng, max(1, math.ceil(ROTATE_BYTES / nb)) if n <= 16 else 1)
        scratch = Scratch()
        inner = {}
        for t, Ws in sets.items():              # warm up, and calls a batch of ~20 ms
            matmul_into(x, Ws[0], out, scratch)
            t0 = time.perf_counter()
            matmul_into(x, Ws[-1], out, scratch)
            inner[t] = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-6)))
        times = {t: [] for t in types}
        for r in range(a.rounds):
            for t in (types if r % 2 == 0 else types[::-1]):
                Ws = sets[t]
                t0 = clock()
                for i in range(inner[t]):
                    matmul_into(x, Ws[i % len(Ws)], out, scratch)
                times[t].append((clock() - t0) / inner[t])
        base = np.array(times[types[0]])
        print(f"{M}x{K}, {n} rows, {numba.get_num_threads()} threads, {a.rounds} rounds "
              f"({'cpu' if a.cpu else 'wall'} clock):")
        for t in types:
            v = np.array(times[t])
            print(f"  {t.name:>6}: {np.median(v) * 1e3:8.3f} ms a call   ratio to {types[0].name} "
                  f"{np.median(v / base):.3f}")


if __name__ == "__main__":
    main()
