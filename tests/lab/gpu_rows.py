"""How the integer decode matvec's time grows with the rows of x (1 to 8: a server's decode
rows share one forward): GPU microseconds of one launch, replayed from a CUDA graph over
weights rotated past the L2, for each kernel family.

    PYTHONPATH=tests python -m lab.gpu_rows [--kernels mvk,mvs] [--rows 1,2,4,8]

A matvec bound by its weight reads costs about the same at 8 rows as at 1; the ratio says how
far from that each kernel is.
"""
from __future__ import annotations

import argparse

import numpy as np

SHAPES = [("Q4_K", 14336, 4096), ("Q4_K", 4096, 14336), ("Q4_K", 4096, 4096), ("Q6_K", 4096, 14336),
          ("Q6_K", 151936, 4096), ("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="mvk,mvs")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    import cupy as cp
    import quant.cuda as qc
    from quant import GGMLType, QTensor
    from lab.gpu_bench import _graph_seconds
    from lab.synth import _Noise, random_weight
    rows = [int(r) for r in a.rows.split(",")]
    default = qc._int8_kernel()
    for qt_name, M, K in SHAPES:
        qt = GGMLType[qt_name]
        raw = random_weight(qt, (M, K), _Noise(1))
        n_bufs = max(2, int(np.ceil(120e6 / len(raw))))          # past the L2 (50 MB on an H100)
        Ws = [qc.upload(QTensor("w", qt, (M, K), raw)) for _ in range(n_bufs)]
        for kern in a.kernels.split(","):
            qc.set_int8_kernel(kern)
            us = {}
            for n in rows:
                x = cp.asarray(np.random.default_rng(n).standard_normal((n, K)).astype(np.float32))
                y = cp.empty((n, M), cp.float32)
                us[n] = 1e6 * _graph_seconds(cp, lambda i: qc.matmul(x, [Ws[i]], [y]), n_bufs, a.reps)
            name = qc._int8_name(qt, rows[-1], M, K)
            print(f"{qt_name} {M}x{K} {kern:4s} [{name}]: " + ", ".join(f"{n} rows {us[n]:.1f} us" for n in rows)
                  + f"; {rows[-1]} over 1: {us[rows[-1]] / us[rows[0]]:.2f}x; 1 row "
                  f"{Ws[0].nbytes / us[rows[0]] / 1e3:.0f} GB/s", flush=True)
        del Ws
    qc.set_int8_kernel(default)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
