"""Where a prompt's time goes on the GPU: `PYTHONPATH=tests python -m lab.gpu_prefill` (on the device).

For random-weight models of the issue's shapes (tests/lab/synth.py), a 512-token
prompt step timed with each prompt attention kernel (`attn_prefill_mma` on the tensor cores,
with its key splits by the default rule, never and at every context; `attn_prefill` in
float32) and with the decode kernel, alternating in one process; then one step's eager
GPU-time profile by op, and 2048- and 4096-token prompts fed in steps of 512.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np


def _pp(eng, toks, chunk=512):
    import cupy as cp
    seq = eng.new_sequence()
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for i in range(0, len(toks), chunk):
        eng.step([seq], [toks[i:i + chunk]])
    cp.cuda.runtime.deviceSynchronize()
    t = time.perf_counter() - t0
    eng.release(seq)
    return t


KNOBS = ("PREFILL_TILED_MIN", "PREFILL_ROWS", "PREFILL_MMA", "PROMPT_GRAPH_ROWS", "PREFILL_MAX_SPLITS",
         "PREFILL_SPLIT_MIN_KEYS")


def _use(CB, cfg: dict) -> None:
    """Set the prompt path's knobs (runtime.backend.cuda's names in KNOBS)."""
    for k, v in cfg.items():
        setattr(CB, k, v)


def main(argv=None) -> int:
    import runtime.backend.cuda as CB
    from lab.synth import SHAPES, load_weights_only, write_random_gguf
    from runtime.engine import Engine
    shapes = (argv or sys.argv[1:]) or ["L8:Q4_K_M", "Q15:Q4_K_M"]
    rng = np.random.default_rng(0)
    for spec in shapes:
        shape, mix = spec.split(":")
        path = f"/tmp/llamba-{shape}-{mix}.gguf"
        if not os.path.exists(path):
            write_random_gguf(path, mix=mix, **SHAPES[shape])
        eng = Engine(load_weights_only(path), device="cuda", n_ctx=4096)
        toks = [int(t) for t in rng.integers(100, 30000, 4096)]
        default = {k: getattr(CB, k) for k in KNOBS}
        eager = dict(default, PROMPT_GRAPH_ROWS=0)
        variants = (("tensor cores, graph replay", default),
                    ("tensor cores, no key splits, graph replay", dict(default, PREFILL_MAX_SPLITS=1)),
                    ("tensor cores, key splits at every context, graph replay",
                     dict(default, PREFILL_SPLIT_MIN_KEYS=0)),
                    ("tensor cores, eager", eager),
                    ("float32 tiles, eager", dict(eager, PREFILL_ROWS=32, PREFILL_MMA=False)),
                    ("decode kernel, eager", dict(eager, PREFILL_TILED_MIN=1 << 30, PREFILL_MMA=False)))
        best = {}
        for _ in range(2):
            for label, cfg in variants:
                _use(CB, cfg)
                eng.backend.invalidate_plans()     # (graphs hold the kernels they were captured with)
                _pp(eng, toks[:512])
                _pp(eng, toks[:512])               # (the first chunk of a length runs eagerly, the second is captured)
                t = min(_pp(eng, toks[:512]) for _ in range(3))
                best[label] = min(best.get(label, t), t)
        for label, t in best.items():
            print(f"{shape} {mix} pp512 [{label}]: {1e3 * t:.2f} ms = {512 / t:.0f} t/s", flush=True)
        _use(CB, default)
        eng.backend.profile_next = True
        seq = eng.new_sequence()
        eng.step([seq], [toks[:512]])
        eng.release(seq)
        prof = eng.backend.last_profile
        print(f"  one step's GPU time {sum(t for _, t in prof):.2f} ms: "
              + "; ".join(f"{k} {v:.2f}" for k, v in prof[:10]), flush=True)
        for label, cfg in variants:
            _use(CB, cfg)
            eng.backend.invalidate_plans()
            for n in (2048, 4096):
                if label.startswith("decode") and n > 2048:
                    continue
                _pp(eng, toks[:n])
                t = min(_pp(eng, toks[:n]) for _ in range(2))
                print(f"  {n} tokens in steps of 512 [{label}]: {1e3 * t:.1f} ms = {n / t:.0f} t/s", flush=True)
        _use(CB, default)
        del eng
    return 0


if __name__ == "__main__":
    sys.exit(main())
