"""`PYTHONPATH=tests python -m lab.gpu_spec`: what speculative decoding costs on a GPU.

The real Qwen2.5-Coder pair does not travel to the GPU test machine (64 MiB of
files a call), so this times random-weight models of its shapes (Q15 target,
Q05 draft; speed does not depend on the weight values): the target's one-token
step, its verify step of k+1 rows, and the draft's step; then the speedup those
costs give at an acceptance rate measured on the real pair (CPU bench):
tokens a round = sum(alpha^i, i = 0..k), cost = k draft steps + one verify step.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def _median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.gpu_spec")
    ap.add_argument("--dir", default="/tmp/llamba-bench")
    ap.add_argument("--target-mix", default="Q4_K_M")
    ap.add_argument("--draft-mix", default="Q4_0", help="Q4_0: what --draft-quant makes of the real draft")
    ap.add_argument("--alpha", type=float, default=0.91, help="acceptance rate a draft token")
    ap.add_argument("--depth", type=int, default=200, help="tokens already in the cache")
    ap.add_argument("-r", "--repetitions", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    from lab.synth import SHAPES, load_weights_only, write_random_gguf
    from runtime.engine import Engine
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    engines = {}
    for role, shape, mix in (("target", "Q15", args.target_mix), ("draft", "Q05", args.draft_mix)):
        path = d / f"{shape}-{mix}.gguf"
        if not path.exists():
            write_random_gguf(path, mix=mix, **SHAPES[shape])
        engines[role] = Engine(load_weights_only(path), device=args.device, n_ctx=args.depth + 64)
    T, D = engines["target"], engines["draft"]
    ids = np.random.default_rng(0).integers(1, 30000, args.depth + 8).tolist()
    ts, ds = T.new_sequence(), D.new_sequence()
    T.prefill(ts, ids[:args.depth])
    D.prefill(ds, ids[:args.depth])

    def step(eng, seq, rows):
        def run():
            base = len(seq)
            eng.step([seq], [ids[:rows]], argmax=True, all_logits=rows > 1)
            eng.cache.truncate(seq, base)
        return run

    t1 = _median_ms(step(T, ts, 1), args.repetitions)
    td = _median_ms(step(D, ds, 1), args.repetitions)
    print(f"{T.backend.device_name}: target {args.target_mix} one-token step {t1:.3f} ms, "
          f"draft {args.draft_mix} step {td:.3f} ms ({td / t1:.2f} target steps), depth {args.depth}")
    print(f"{'k':>2} {'verify ms':>10} {'verify/step':>12} {'tokens/round':>13} {'speedup':>8}  (acceptance {args.alpha:.0%})")
    for k in range(1, 7):
        tv = _median_ms(step(T, ts, k + 1), args.repetitions)
        tokens = sum(args.alpha ** i for i in range(k + 1))
        print(f"{k:>2} {tv:10.3f} {tv / t1:12.2f} {tokens:13.2f} {tokens * t1 / (k * td + tv):7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
