"""The CPU backend's moe op on gpt-oss-20b's expert shapes (32 experts of 2880 x 2880, 4 a
token) in MXFP4 (or another type): the fused kernels (quant/moe_cpu.py, int8 activations)
against the expert-by-expert path (one matmul per chosen expert: int8 up to 31 rows an
expert, the bf16 GEMM from 32), alternating in one process; CPU time when --cpu (a shared
machine), medians over rounds.

    PYTHONPATH=tests python -m lab.mxfp4_moe_ab --rows 1,4,64,512 -t 1 --cpu --rounds 7
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from quant import GGMLType, QTensor
from runtime.backend.cpu import CPUBackend


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,64")
    ap.add_argument("--type", default="MXFP4")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args(argv)
    from lab.synth import _Noise, random_weight
    qt = GGMLType[a.type]
    E, d, ff, k = 32, 2880, 2880, 4
    be = CPUBackend(threads=a.threads or None)
    noise = _Noise(1)
    experts = tuple(be.upload(QTensor(f"ffn_{n}_exps", qt, (E, M, K), random_weight(qt, (E * M, K), noise)))
                    for n, M, K in (("gate", ff, d), ("up", ff, d), ("down", d, ff)))
    rng = np.random.default_rng(0)
    r = (rng.standard_normal((E, d)) / d ** 0.5).astype(np.float32)
    router = be.upload(QTensor("router", GGMLType.F32, (E, d), r))
    clock = time.process_time if a.cpu else time.perf_counter
    for n in (int(r) for r in a.rows.split(",")):
        x = rng.standard_normal((n, d)).astype(np.float32)
        logits = be.matmul(x, router).copy()
        paths = {"fused": lambda: be.moe(x, router, experts, k, True),
                 "by-expert": lambda: be._moe_by_expert(x, logits, experts, k, True)}
        res = {p: [] for p in paths}
        for p, f in paths.items():        # compile, warm
            be.arena.reset()
            f()
        for r in range(a.rounds):
            for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                be.arena.reset()
                t0 = clock()
                paths[p]()
                res[p].append(clock() - t0)
        f, b = np.array(res["fused"]), np.array(res["by-expert"])
        print(f"{qt.name} experts, {n} tokens, {numba.get_num_threads()} threads ({'cpu' if a.cpu else 'wall'}): "
              f"fused {np.median(f) * 1e3:.2f} ms, by-expert {np.median(b) * 1e3:.2f} ms, "
              f"ratio fused/by-expert {np.median(f / b):.3f}", flush=True)


if __name__ == "__main__":
    main()
