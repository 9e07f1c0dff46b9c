"""The serving ceilings below the HTTP server: decode tokens/s of Engine.step with B rows
(B sequences, one token each) against one row, and the same through the Scheduler alone
(run_until_idle, no server), with the CPU step plans recorded/replayed counted.

    PYTHONPATH=tests python -m lab.serve_engine -m MODEL -t 2 [--device cuda] [-B 8] [--rounds 5] [--sched] [--exact]

Without --exact, B rows go to Engine.step at once: above the backend's exact_rows that is a
prompt-style forward (CUDA: cuBLAS GEMMs), whose rows are not each one's own alone.  With
--exact they go in forwards of at most exact_rows rows, one after another, as the Scheduler
sends decode rows (session 36 compared tensor-core 32-row steps against the former by mistake).

Rounds alternate 1-row and B-row blocks (the machine is shared: medians of ratios).
"""
from __future__ import annotations

import argparse
import statistics
import time


def engine_rounds(eng, B: int, rounds: int, steps: int, ctx: int = 40, exact: bool = False):
    vocab = eng.config.vocab_size
    cap = max(1, getattr(eng.backend, "exact_rows", 1)) if exact else B

    def step(group):
        for i in range(0, len(group), cap):
            eng.step(group[i:i + cap], [[1] for _ in group[i:i + cap]], argmax=True)

    seqs = [eng.new_sequence() for _ in range(B)]
    for i, s in enumerate(seqs):
        eng.step([s], [[(7919 * (j + 31 * i) + 11) % vocab for j in range(ctx)]])
    plans = getattr(eng.backend, "plans", None)
    res = []
    for r in range(rounds):
        row = {}
        for b in (1, B) if r % 2 == 0 else (B, 1):
            group = seqs[:b]
            for _ in range(2):         # record the plan outside the timing
                step(group)
            rec0 = plans.recorded if plans else 0
            t = time.perf_counter()
            for _ in range(steps):
                step(group)
            dt = time.perf_counter() - t
            row[b] = (b * steps / dt, (plans.recorded - rec0) if plans else 0)
            for s in group:            # keep the context fixed
                eng.cache.truncate(s, ctx)
        res.append(row)
        print(f"round {r}: 1 row {row[1][0]:.2f} tok/s, {B} rows {row[B][0]:.2f} tok/s, "
              f"ratio {row[B][0] / row[1][0]:.2f}  (recordings in timing: {row[1][1]}, {row[B][1]})", flush=True)
    for s in seqs:
        eng.release(s, keep_cached=False)
    ratios = [r[B][0] / r[1][0] for r in res]
    print(f"median: 1 row {statistics.median(r[1][0] for r in res):.2f} tok/s, {B} rows "
          f"{statistics.median(r[B][0] for r in res):.2f} tok/s, ratio {statistics.median(ratios):.2f}")


def sched_rounds(eng, B: int, rounds: int, n: int, ab_merge: bool = False):
    """The same B prompts (bench-serve's mix) one client at a time, then B at once, through the
    Scheduler alone; the engine steps timed by kind (prompt chunk, decode rows)."""
    from collections import defaultdict
    from runtime.bench.serve import prompts
    from runtime.sampling import SamplingParams
    from runtime.scheduler import Request, Scheduler
    plans = getattr(eng.backend, "plans", None)
    step = eng.step
    merge = getattr(eng, "merge_rows", None)
    acc = defaultdict(lambda: [0, 0.0, 0])

    be = eng.backend

    def timed(seqs, toks, **kw):
        setups, replays = getattr(be, "setup_events", 0), getattr(be, "graph_replays", 0)
        t = time.perf_counter()
        out = step(seqs, toks, **kw)
        rows = sum(len(x) for x in toks)
        kind = "decode" if rows == len(toks) else ("mixed" if rows <= 16 else "prompt")
        # (a GPU backend: the step replayed from a graph, or one that captured a new graph)
        if getattr(be, "setup_events", 0) != setups:
            kind += "+setup"
        elif getattr(be, "graph_replays", 0) != replays:
            kind += "@graph"
        a = acc[kind]
        a[0] += rows
        a[1] += time.perf_counter() - t
        a[2] += 1
        return out
    eng.step = timed
    for r in range(rounds):
        ids = [eng.tokenizer.encode(t) for t in prompts(B, 100 + r)]
        row = {}
        runs = [(1, merge), (B, merge)] if not ab_merge else [(B, None), (B, merge)]
        for c, mr in runs if r % 2 == 0 else runs[::-1]:
            eng.merge_rows = mr
            sch = Scheduler(eng, max_running=c, prefix_cache=False)
            reqs = [Request(x, SamplingParams(temperature=0.0), max_tokens=n) for x in ids]
            rec0, rep0 = (plans.recorded, plans.replayed) if plans else (0, 0)
            acc.clear()
            t = time.perf_counter()
            if c == 1:
                for q in reqs:
                    sch.submit(q)
                    sch.run_until_idle()
            else:
                for q in reqs:
                    sch.submit(q)
                sch.run_until_idle()
            dt = time.perf_counter() - t
            toks = sum(len(q.output) for q in reqs)
            row[(c, mr)] = toks / dt
            parts = ", ".join(f"{k} {v[0]} rows {v[2]} steps {v[1]:.2f} s" for k, v in sorted(acc.items()))
            print(f"  {c} client(s), merge {mr}: {toks / dt:.2f} tok/s, {dt:.1f} s ({parts}; outside steps "
                  f"{dt - sum(v[1] for v in acc.values()):.2f} s), {sch.stats.forwards} forwards, "
                  f"{(plans.recorded - rec0) if plans else 0} recordings, {(plans.replayed - rep0) if plans else 0} replays "
                  f"of {sum(v[2] for k, v in acc.items() if not k.startswith('prompt'))} small forwards", flush=True)
        a, b = runs
        print(f"round {r}: ratio {b} / {a}: {row[b] / row[a]:.2f}", flush=True)
    eng.step = step
    eng.merge_rows = merge


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("-B", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="decode steps a block (0: no engine rounds)")
    p.add_argument("--sched", action="store_true", help="through the Scheduler (prompts + decode) too")
    p.add_argument("-n", type=int, default=32, help="tokens a request (--sched)")
    p.add_argument("--ab-merge", action="store_true", help="--sched: B clients with prompt merging off and on")
    p.add_argument("--exact", action="store_true", help="B rows in forwards of at most exact_rows rows (as served)")
    a = p.parse_args()
    from runtime.engine import Engine
    from runtime.warmup import warm_up
    eng = Engine(a.model, device=a.device, threads=a.threads, n_ctx=4096, cache_blocks=2048)
    warm_up(eng, notice=print)
    if a.steps:
        engine_rounds(eng, a.B, a.rounds, a.steps, exact=a.exact)
        if a.exact:
            print(f"(forwards of at most {eng.backend.exact_rows} rows)")
    if a.sched:
        sched_rounds(eng, a.B, a.rounds, a.n, a.ab_merge)
    pl = getattr(eng.backend, "plans", None)
    if pl:
        print(f"plans: recorded {pl.recorded}, replayed {pl.replayed}, held {len(pl.plans)}")


if __name__ == "__main__":
    main()
