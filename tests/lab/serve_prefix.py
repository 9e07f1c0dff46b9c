"""Prefix reuse across clients (issue 38's goal: 8 clients sharing a ~1,500-token system prompt get
their first token >= 5x sooner than with reuse off).

`compare` (the measurement): two real servers on loopback, `serve` with prefix reuse and the same
with `--no-prefix-cache`, both up, loaded in turn (alternating rounds, the order flipped each
round) by bench-serve's clients (runtime/bench/serve.py): C clients at once, one request each,
every prompt = the shared prefix + a short question.  Each round:
  - cold, with reuse: a prefix the server has not seen (a new prefix seed each round): the
    first client computes it, the others wait for its blocks;
  - warm, with reuse: the same prefix again behind other questions (a system prompt served
    before);
  - off: the cold wave's prompts against the server without reuse (which keeps nothing, so a
    warm wave would be alike).
Reported: time to first token p50/p99 of each wave (medians over rounds) and the ratios
off/cold and off/warm of each round, with their medians.

    PYTHONPATH=tests python -m lab.serve_prefix compare -m MODEL [-t 2] [-C 8] [--prefix 1500]
        [--rounds 3] [-n 16] [-c 4096]

`trace` (where the time goes): one cold wave of the same prompts handed to the scheduler in
this process (the engine sized as `serve` sizes it), one line per scheduler iteration: its
time, the tokens each request advanced, how many wait; then each request's time to first token.

    PYTHONPATH=tests python -m lab.serve_prefix trace -m MODEL [-t 2] [-C 8] [--prefix 1500] [--warm]
        [--no-prefix-cache]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from types import SimpleNamespace


def wave(base: str, clients: int, prefix: int, prefix_seed: int, seed: int, max_tokens: int) -> dict:
    """C clients at once, one request each, behind the shared prefix: bench-serve's summary row."""
    from runtime.bench.serve import _run_level, prompts, summarize
    args = SimpleNamespace(duration=0, requests=1, max_tokens=max_tokens, temperature=0.0, abort_fraction=0.0,
                           seed=seed, timeout=3600, model=None)
    texts = prompts(max(clients, 8), seed, prefix, prefix_seed)
    results, wall = asyncio.run(_run_level(base, {}, clients, args, texts))
    return summarize(results, wall, clients)


def compare(a) -> int:
    from lab.serve_soak import start_server, stop_server
    common = ["-m", a.model, "-t", str(a.threads), "-np", str(a.parallel), "-c", str(a.ctx)]
    servers = {}
    try:
        for label, extra in (("reuse", []), ("no-reuse", ["--no-prefix-cache"])):
            servers[label] = start_server(common + extra)
        for label in servers:       # one untimed request each: first-call costs
            wave(servers[label][1], 1, 16, 999, 999, 2)
        rows = []
        for k in range(a.rounds):
            # without reuse nothing is kept, so its cold and warm waves are alike: one wave a round,
            # the cold wave's prompts
            plan = [("reuse", "cold", 10 * k), ("reuse", "warm", 10 * k + 1), ("no-reuse", "off", 10 * k)]
            for label, kind, seed in (plan if k % 2 == 0 else plan[2:] + plan[:2]):
                load = os.getloadavg()[0]
                r = wave(servers[label][1], a.clients, a.prefix, 1000 + k, seed, a.max_tokens)
                r.update(server=label, round=k, wave=kind, load=load)
                rows.append(r)
                print(f"round {k + 1} {label:9} {kind:4}: TTFT p50 {r['ttft_p50_ms'] / 1e3:7.2f} s "
                      f"p99 {r['ttft_p99_ms'] / 1e3:7.2f} s, {r['completed']}/{r['requests']} ok, "
                      f"wall {r['wall_s']:.0f} s, load average {load:.1f}", flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(f"medians over {a.rounds} rounds (C={a.clients}, ~{a.prefix}-token shared prefix, -n {a.max_tokens}):")
    get = {(r["wave"], r["round"]): r for r in rows}
    for q in ("p50", "p99"):
        off = [get["off", k][f"ttft_{q}_ms"] / 1e3 for k in range(a.rounds)]
        line = [f"TTFT {q}: reuse off {statistics.median(off):.2f} s"]
        for kind in ("cold", "warm"):
            on = [get[kind, k][f"ttft_{q}_ms"] / 1e3 for k in range(a.rounds)]
            ratios = [y / x for x, y in zip(on, off)]
            line.append(f"{kind} {statistics.median(on):.2f} s (off/{kind} by round {[round(x, 2) for x in ratios]}, "
                        f"median {statistics.median(ratios):.2f}x)")
        print("  " + "; ".join(line))
    return 0


def trace(a) -> int:
    from runtime.bench.serve import prompts
    from runtime.sampling import SamplingParams
    from runtime.scheduler import Request
    from runtime.server.host import ModelHost, ServeConfig
    mh = ModelHost(ServeConfig(model=a.model, threads=a.threads, n_ctx=a.ctx, parallel=a.parallel,
                               prefix_cache=not a.no_prefix_cache), announce=print)
    mh.load()
    if mh.error:
        raise SystemExit(mh.error)
    sch, eng = mh.scheduler, mh.engine
    log, last = [], [time.perf_counter(), time.process_time()]
    reqs: list = []

    def on_step(s):
        now, cpu = time.perf_counter(), time.process_time()
        log.append((now - last[0], cpu - last[1], {r.id: len(r.seq) for r in s.running}, len(s.waiting),
                    sum(1 for r in reqs if r.stats.first_token is not None)))
        last[:] = now, cpu
    texts = prompts(max(a.clients, 8), a.seed, a.prefix, 1000 + a.seed)
    ids = [eng.tokenizer.encode(t) for t in texts[:a.clients]]
    if a.warm:          # the same prefix computed before, behind other questions (not traced)
        before = prompts(max(a.clients, 8), a.seed + 1, a.prefix, 1000 + a.seed)
        for q in [sch.submit(Request(eng.tokenizer.encode(t), SamplingParams(temperature=0.0), max_tokens=1))
                  for t in before[:a.clients]]:
            q.done.wait()
    print(f"prompts: {[len(x) for x in ids]} tokens; load average {os.getloadavg()[0]:.1f}", flush=True)
    sch.on_step = on_step
    t0 = time.perf_counter()
    last[:] = t0, time.process_time()
    t0m = time.monotonic()
    for x in ids:
        reqs.append(sch.submit(Request(x, SamplingParams(temperature=0.0), max_tokens=a.max_tokens)))
    for r in reqs:
        r.done.wait()
    wall = time.perf_counter() - t0
    sch.on_step = None
    prev: dict = {}
    cached = {r.id: r.stats.cached_tokens for r in reqs}
    for i, (dt, cpu, seqs, waiting, firsts) in enumerate(log):
        moved = {k: v - prev.get(k, cached.get(k, 0)) for k, v in seqs.items() if v != prev.get(k)}
        prev = seqs
        if i < a.show or firsts < len(reqs):
            print(f"step {i:3d} {dt * 1e3:8.1f} ms (CPU {cpu * 1e3:8.1f} ms)  advanced {moved}  waiting {waiting}  "
                  f"first tokens {firsts}")
    ttft = sorted(r.stats.first_token - t0m for r in reqs)
    print(f"TTFT s: {[round(x, 2) for x in ttft]}; p50 {ttft[min(len(ttft) - 1, round(0.5 * (len(ttft) - 1)))]:.2f}; "
          f"cached tokens {[r.stats.cached_tokens for r in reqs]}; wall {wall:.1f} s; "
          f"load average {os.getloadavg()[0]:.1f}")
    mh.shutdown()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["compare", "trace"])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-C", "--clients", type=int, default=8)
    p.add_argument("-np", "--parallel", type=int, default=8)
    p.add_argument("-c", "--ctx", type=int, default=4096)
    p.add_argument("--prefix", type=int, default=1500, help="shared prefix, ~tokens")
    p.add_argument("-n", "--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=0, help="trace: steps shown after the last first token")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--warm", action="store_true", help="trace: the prefix was computed before (another wave)")
    a = p.parse_args(argv)
    return compare(a) if a.mode == "compare" else trace(a)


if __name__ == "__main__":
    sys.exit(main())
