"""Where a serving process's memory goes over rounds of distinct requests: RSS against the
KV blocks ever handed out (a pool is mapped lazily: a block costs memory from its first use),
the step plans held, and the scheduler's own objects.

    PYTHONPATH=tests python -m lab.serve_memory -m MODEL [-np 32] [--rounds 4] [--per-round 32] [-n 16]

The engine is sized as `serve` sizes it (ModelHost: parallel x ctx tokens, within 2 GiB).
"""
from __future__ import annotations

import argparse
import gc
import os
import time


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def touched_blocks(eng) -> int:
    """Blocks of group 0's pool whose pages have been written (any nonzero K byte in layer 0)."""
    import numpy as np
    k = eng.storage.k[0]
    bs = eng.block_size
    per = k.reshape(-1, bs * k.shape[1] * k.shape[2])
    return int(np.count_nonzero(per.any(axis=1)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-np", "--parallel", type=int, default=32)
    p.add_argument("-c", "--ctx", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--per-round", type=int, default=32)
    p.add_argument("-n", type=int, default=16)
    p.add_argument("--cached-cap", type=int, default=None, help="max_cached_blocks, where the cache has it")
    a = p.parse_args()
    from runtime.bench.serve import prompts
    from runtime.sampling import SamplingParams
    from runtime.scheduler import Request
    from runtime.server.host import ModelHost, ServeConfig
    mh = ModelHost(ServeConfig(model=a.model, threads=a.threads, n_ctx=a.ctx, parallel=a.parallel), announce=print)
    mh.load()
    if mh.error:
        raise SystemExit(mh.error)
    sch, eng = mh.scheduler, mh.engine
    texts = prompts(a.rounds * a.per_round, 1234)
    ids = [eng.tokenizer.encode(t) for t in texts]
    bpb = eng.storage.bytes_per_token * eng.block_size / 2**20
    print(f"start: RSS {rss_mb():.0f} MB, pool {eng.cache.num_blocks} blocks ({bpb:.2f} MiB each)", flush=True)
    k = 0
    for r in range(a.rounds):
        t = time.perf_counter()
        reqs = []
        for _ in range(a.per_round):
            q = Request(ids[k], SamplingParams(temperature=0.0), max_tokens=a.n)
            k += 1
            reqs.append(sch.submit(q))
        for q in reqs:
            q.done.wait()
        gc.collect()
        pl = eng.backend.plans
        st = eng.cache.stats()
        tb = touched_blocks(eng)
        print(f"round {r}: {time.perf_counter() - t:.1f} s, RSS {rss_mb():.0f} MB, blocks touched {tb} "
              f"({tb * bpb:.0f} MiB), cached {st.blocks_cached}, free {st.blocks_free}, "
              f"plans held {len(pl.plans) if pl else 0} (recorded {pl.recorded if pl else 0})", flush=True)
    mh.shutdown()


if __name__ == "__main__":
    main()
