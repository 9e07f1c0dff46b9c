"""Compile the CPU backend's kernels that the GPU tests use as their reference into the
Numba cache, in a process of its own: `python -m lab.cpu_warm` (tests on PYTHONPATH).

On a fresh GPU machine they compile for minutes inside the first test that builds a CPU
engine; tests/gpu/device_moe.sh starts this beside the GPU-only tests instead.  A tiny
random qwen3moe in Q4_K_M, Q8_0, F16 (the latter on test_models' float CPU backend) and MXFP4_MOE:
a prompt, decode steps and a 3-row step."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(arch="qwen3moe", n_layers=1, d_model=256, d_ff=0, n_heads=4, n_kv_heads=2, vocab=500, tied=False,
             rope_theta=1e6, n_experts=8, n_experts_used=2, d_ff_expert=256)


def main() -> int:
    from lab.synth import load_weights_only, write_random_gguf
    from runtime.engine import Engine
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for mix in ("Q4_K_M", "Q8_0", "F16", "MXFP4_MOE"):
            lm = load_weights_only(write_random_gguf(Path(d) / f"{mix}.gguf", mix=mix, **SHAPE))
            e = Engine(lm, device="cpu", n_ctx=256)
            if mix == "F16":
                sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
                from test_models import _float_cpu_backend
                e.backend.__class__ = _float_cpu_backend()
            s = e.new_sequence()
            e.prefill(s, list(range(1, 40)))
            for i in range(3):
                e.step([s], [[5 + i]])
            e.step([s], [[7, 8, 9]], all_logits=True)
            e.release(s)
            print(f"{mix}: warm after {time.perf_counter() - t:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
