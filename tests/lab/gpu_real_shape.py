"""A random-weight model of a real shape that the CLI, the server and constraints can run:
`PYTHONPATH=tests python -m lab.gpu_real_shape SHAPE OUT.gguf --tokenizer TOK.gguf [--mix Q4_K_M]`.

The GPU machine has no network and carries 64 MiB, so real models do not go there; speed
does not depend on the weights' values, but serving and constrained decoding need a real
tokenizer: its keys come from a tokenizer-only GGUF (`tests/gpu/prepare_device.py` writes
`.devmodels/qwen-tok.gguf`, Qwen2.5's vocabulary and chat template).  SHAPE: lab.synth.SHAPES
(Q05, Q15; L8 takes the Qwen vocabulary too, so its output layer is 151,936 rows, not 128,256).
"""
from __future__ import annotations

import argparse
import sys

from lab.synth import SHAPES, write_random_gguf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--mix", default="Q4_K_M")
    a = ap.parse_args(argv)
    spec = dict(SHAPES[a.shape])
    spec["vocab"] = max(spec["vocab"], 151936)
    write_random_gguf(a.out, mix=a.mix, tokenizer_from=a.tokenizer, **spec)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
