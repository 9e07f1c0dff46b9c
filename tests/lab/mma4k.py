"""Lab: the Q4_K tensor-core matvecs for 9-32 rows (tests/lab/mma4k.cu: mma4k_i8, s8 MMAs and the
scales on the integer pipe; mma4k_t<NT>, f16 MMAs with the run scales folded into the weights
and 8 NT outputs a warp sharing the activations, which it takes as
fp16 codes made by codes_f16, timed with it; and for Q6_K, mma6k_s against mvs and mma6k_k against mvkt)
against the product's decode matvec (mvk4k): every output bit for bit equal to the row's own
1-row result, then GPU time against mvk in forwards of at most 8 rows (a server's step today).

    PYTHONPATH=tests python -m lab.mma4k [--rows 1,8,9,16,17,32] [--kernels mma4k_i8,mma4k_t<2>,mma4k_t<4>] [--no-q6]

Exit status 1 when any output differs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (8960, 1536), (1536, 8960)]
# Q6_K: where the product takes mvs (more than MVK_Q6K_MAX_M rows) mma6k_s keeps mvs's order,
# where it takes mvkt mma6k_k keeps mvkt's
SHAPES6 = [(4096, 14336), (151936, 1536), (8960, 1280), (1024, 4096), (1536, 8960), (256, 1536)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,9,16,17,32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--kernels", default="mma4k_i8,mma4k_t<2>,mma4k_t<4>", help="the Q4_K kernels")
    ap.add_argument("--no-q6", action="store_true", help="skip Q6_K (mma6k_s / mma6k_k)")
    a = ap.parse_args(argv)
    import cupy as cp
    import quant.cuda as qc
    from quant import GGMLType, QTensor
    from lab.gpu_bench import _graph_seconds
    from lab.synth import _Noise, random_weight
    kernels = a.kernels.split(",")
    mod = cp.RawModule(code=(Path(__file__).with_name("mma4k.cu")).read_text(), options=("-std=c++17",),
                       name_expressions=[k for k in kernels if "<" in k])
    get = lambda k: mod.get_function(k)
    ws = qc.Workspace()
    rows = [int(r) for r in a.rows.split(",")]
    N = max(rows)
    bad_all = 0
    jobs = [(GGMLType.Q4_K, M, K, kernels) for M, K in SHAPES]
    if not a.no_q6:
        jobs += [(GGMLType.Q6_K, M, K, ["mma6k_k" if qc._mvk_applies(GGMLType.Q6_K, K, M) else "mma6k_s"])
                 for M, K in SHAPES6]
    for qt, M, K, knames in jobs:
        raw = random_weight(qt, (M, K), _Noise(M + K))
        n_bufs = max(2, int(np.ceil(120e6 / len(raw))))
        Ws = [qc.upload(QTensor("w", qt, (M, K), raw)) for _ in range(n_bufs)]
        W = Ws[0]
        x = cp.asarray(np.random.default_rng(K).standard_normal((N, K)).astype(np.float32))
        ref = cp.empty((N, M), cp.float32)
        for r in range(N):                      # each row alone: what it gets in a 1-row step
            qc.matmul(x[r:r + 1], [W], [ref[r:r + 1]], ws=ws)
        ref_h = ref.get()

        def ours(n, Wt, y, kname):
            xq, xd, xs, xi = qc._quantize_act(x[:n], 256, ws)
            if kname.startswith("mma6k"):
                get(kname)(((M + 31) // 32, (n + 15) // 16), (128,),
                           (Wt.data, np.int32(M), np.int32(K), np.int64(Wt.row_nbytes), xq, xd, y, np.int32(M),
                            np.int32(n)))
                return
            if kname.startswith("mma4k_t<"):
                nt = int(kname[8:-1])
                x16 = ws.get("lab_x16", n * K, cp.float16, keep=True)
                bs16 = ws.get("lab_bs16", n * K // 16, cp.float16, keep=True)
                get("codes_f16")(((n * K + 255) // 256,), (256,), (xq, xi, np.int64(n * K), x16, bs16))
                get(kname)(((M + 32 * nt - 1) // (32 * nt), (n + 15) // 16), (128,),
                           (Wt.data, np.int32(M), np.int32(K), np.int64(Wt.row_nbytes), x16, xd, bs16, y,
                            np.int32(M), np.int32(n)))
                return
            get(kname)(((M + 31) // 32, (n + 15) // 16), (128,),
                       (Wt.data, np.int32(M), np.int32(K), np.int64(Wt.row_nbytes), xq, xd, xi, y, np.int32(M),
                        np.int32(n)))

        line = []
        for n in rows:
            y1 = cp.empty((n, M), cp.float32)
            groups = [(s, min(n, s + 8)) for s in range(0, n, 8)]
            t_mvk = _graph_seconds(cp, lambda i: [qc.matmul(x[s:e], [Ws[i]], [y1[s:e]], ws=ws) for s, e in groups],
                                   n_bufs, a.reps)
            part = [f"{n} rows: mvk x{len(groups)} {1e6 * t_mvk:.1f} us"]
            for kname in knames:
                y = cp.full((n, M), np.nan, cp.float32)
                ours(n, W, y, kname)
                got = y.get()
                bad = int((got.view(np.uint32) != ref_h[:n].view(np.uint32)).sum())
                bad_all += bad
                err = float(np.nanmax(np.abs(got - ref_h[:n]))) if bad else 0.0
                t = _graph_seconds(cp, lambda i: ours(n, Ws[i], y1, kname), n_bufs, a.reps)
                part.append(f"{kname} {1e6 * t:.1f} us, {bad} differ" + (f" (max |d| {err:.3g})" if bad else ""))
            line.append(", ".join(part))
        print(f"{qt.name} {M}x{K} [{qc._int8_name(qt, 1, M, K)}]: " + "; ".join(line), flush=True)
        del Ws
    print("bit for bit" if bad_all == 0 else f"{bad_all} outputs differ")
    return 0 if bad_all == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
