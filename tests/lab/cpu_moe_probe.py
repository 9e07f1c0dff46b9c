"""Where a `--cpu-moe` decode token's host time goes: the CPU half of the moe op
(CPUBackend.moe_routed) for one token, on expert tensors of a real shape, timed per
kernel call.

    python -m lab.cpu_moe_probe [--shape M30] [--layers 4] [--threads T] [--steps 200]

Random Q4_K_M experts of the shape's layer (gate/up Q4_K, down Q6_K or Q4_K) for
`--layers` layers (more bytes than the last-level cache, as a 48-layer model's are), and
random router logits a step so each step reads other experts.  Prints the median time a
layer, the chosen experts' bytes over it (GB/s), and each kernel's share: a small
kernel's time is mostly Numba's dispatch, the two parallel ones the weight reads.
Also a plain memory-read rate on the same threads (numpy over a large buffer, one
thread; the kernels' sweep) for the physical limit.
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="M30")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--down", default="Q6_K", choices=("Q6_K", "Q4_K"))
    ap.add_argument("--rows", type=int, default=1, help="tokens a step")
    a = ap.parse_args(argv)

    from lab.synth import SHAPES, random_weight
    from quant.tensor import QTensor
    from quant.types import GGMLType
    from runtime.backend.cpu import CPUBackend

    s = SHAPES[a.shape]
    E, k, d, ff = s["n_experts"], s["n_experts_used"], s["d_model"], s["d_ff_expert"]
    cpu = CPUBackend(threads=a.threads)
    q4k, qd = GGMLType.Q4_K, GGMLType[a.down]
    layers = []
    nbytes = 0
    for li in range(a.layers):
        ts = []
        for name, qt, shape in (("gate", q4k, (E, ff, d)), ("up", q4k, (E, ff, d)), ("down", qd, (E, d, ff))):
            raw = random_weight(qt, shape)
            t = QTensor(f"blk.{li}.ffn_{name}_exps.weight", qt, shape, raw.reshape(-1))
            ts.append(cpu.upload(t))
            nbytes += raw.nbytes
        layers.append(ts)
    per_expert = nbytes / a.layers / E
    print(f"{a.shape}: {E} experts of {d}x{ff}, {k} a token; {a.layers} layers, {nbytes / 2**30:.2f} GiB; "
          f"{cpu.threads} threads; down {a.down}")

    times = collections.defaultdict(float)
    counts = collections.Counter()
    real_call = cpu.scratch.call

    def timed(fn, *args, **kw):
        t0 = time.perf_counter()
        r = real_call(fn, *args, **kw)
        times[getattr(fn, "__name__", str(fn))] += time.perf_counter() - t0
        counts[getattr(fn, "__name__", str(fn))] += 1
        return r

    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.rows, d)).astype(np.float32)
    steps = []
    for step in range(a.steps + 20):
        if step == 20:                                   # warm-up (compile) done
            times.clear()
            counts.clear()
            cpu.scratch.call = timed
        logits = rng.standard_normal((a.rows, E)).astype(np.float32) * 2
        t0 = time.perf_counter()
        cpu.arena.reset()
        cpu.moe_routed(x, logits, layers[step % a.layers], k, True)
        steps.append(time.perf_counter() - t0)
    cpu.scratch.call = real_call
    st = np.array(steps[20:])
    med = float(np.median(st))
    read = per_expert * k * a.rows if a.rows == 1 else per_expert * min(E, k * a.rows)
    print(f"a layer: median {med * 1e6:.0f} us (p10 {np.percentile(st, 10) * 1e6:.0f}, p90 "
          f"{np.percentile(st, 90) * 1e6:.0f}); {read / 2**20:.1f} MiB of experts -> {read / med / 1e9:.1f} GB/s")
    tot = sum(times.values())
    for name, t in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {t / a.steps * 1e6:8.1f} us a layer  ({counts[name] // a.steps} calls)  {t / tot:5.1%}")
    print(f"  (outside the kernel calls: {(st.sum() - tot) / a.steps * 1e6:.1f} us a layer)")

    # the physical limit: a read sweep over a buffer larger than the cache, on all threads
    from numba import njit, prange, set_num_threads

    @njit(parallel=True, nogil=True)
    def sweep(buf, nch):
        per = buf.size // nch
        acc = np.zeros(nch, np.uint64)
        for c in prange(nch):
            s = np.uint64(0)
            for i in range(c * per, (c + 1) * per, 64):
                s += buf[i]
            acc[c] = s
        return acc.sum()

    set_num_threads(cpu.threads)
    big = np.ones(1 << 31, np.uint8)
    sweep(big, cpu.threads * 4)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        sweep(big, cpu.threads * 4)
        ts.append(time.perf_counter() - t0)
    print(f"memory read (one byte a cache line over 2 GiB, {cpu.threads} threads): "
          f"{big.nbytes / min(ts) / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
