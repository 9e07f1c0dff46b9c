"""What the HTTP server adds to a single stream's decode, under the same load: rounds alternate
(A) a request handed to the scheduler in-process and (B) the same request streamed over HTTP
by a client in another process (as bench-serve does), on one engine.  Each reports its
inter-token time (p50) and the engine steps' own time (Engine.step, p50) while it decoded.

    PYTHONPATH=tests python -m lab.serve_overhead -m MODEL -t 2 [--rounds 6] [-n 64] [-C 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

CLIENT = r"""
import json, sys, time, httpx, asyncio
url, prompt, n, c = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
async def one(client):
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    st = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if any(x.get("text") for x in ev.get("choices", [])):
                    st.append(time.perf_counter())
    return st
async def main():
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*[one(client) for _ in range(c)])
print(json.dumps(asyncio.run(main())))
"""


def thread_cpu() -> dict:
    """CPU seconds of each of this process's threads, by name."""
    import os
    out = {}
    hz = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            s = open(f"/proc/self/task/{tid}/stat").read()
        except OSError:
            continue
        f = s[s.rindex(")") + 2:].split()
        name = names.get(int(tid), "numba-worker")
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / hz
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("-n", type=int, default=64)
    p.add_argument("-C", type=int, default=1, help="requests at once in each round")
    a = p.parse_args()
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams
    from runtime.scheduler import Request
    from runtime.server import BackgroundServer
    from runtime.server.host import ModelHost, ServeConfig
    from runtime.warmup import warm_up
    eng = Engine(a.model, threads=a.threads, n_ctx=4096, cache_blocks=2048)
    warm_up(eng, notice=print)
    steps: list[tuple[float, int]] = []
    raw = eng.step

    def timed(seqs, toks, **kw):
        t = time.perf_counter()
        out = raw(seqs, toks, **kw)
        steps.append((time.perf_counter() - t, sum(len(x) for x in toks)))
        return out
    eng.step = timed
    mh = ModelHost.from_engine(eng, ServeConfig(n_ctx=4096, parallel=8), model_id="m")
    srv = BackgroundServer(mh, port=0)
    url = srv.start().removesuffix("/v1")
    prompts = [f"Write a long story about topic number {i}, with many details and names.\n\n" for i in range(a.C)]
    ids = [eng.tokenizer.encode(x) for x in prompts]

    def inproc():
        reqs = []
        for x in ids:
            st = []
            reqs.append((Request(x, SamplingParams(temperature=0.0), max_tokens=a.n,
                                 on_event=lambda ev, st=st: ev.token is not None and st.append(time.perf_counter())),
                         st))
        for r, _ in reqs:
            mh.scheduler.submit(r)
        for r, _ in reqs:
            r.done.wait()
        return [st for _, st in reqs]

    def http():
        out = subprocess.run([sys.executable, "-c", CLIENT, url, prompts[0], str(a.n), str(a.C)],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    for f in (inproc, http):       # first pass: prefix cached, plans recorded
        f()
    res = {"in-process": [], "http": []}
    for r in range(a.rounds):
        for name, f in (("in-process", inproc), ("http", http)) if r % 2 == 0 else (("http", http),
                                                                                     ("in-process", inproc)):
            steps.clear()
            c0 = thread_cpu()
            stamps = f()
            c1 = thread_cpu()
            itl = [b - x for st in stamps for x, b in zip(st, st[1:])]
            dec = [t for t, n in steps if n == a.C]
            row = (1e3 * statistics.median(itl), 1e3 * statistics.median(dec), len(stamps[0]))
            res[name].append(row)
            ntok = sum(len(x) for x in stamps)
            cpu = ", ".join(f"{k} {1e3 * (c1[k] - c0.get(k, 0)) / ntok:.2f}" for k in sorted(c1)
                            if c1[k] - c0.get(k, 0) > 0)
            print(f"round {r} {name:10s}: ITL p50 {row[0]:6.1f} ms, engine step p50 {row[1]:6.1f} ms "
                  f"({row[2]} tokens); CPU ms a token: {cpu}", flush=True)
    for name, rows in res.items():
        print(f"median {name:10s}: ITL {statistics.median(x[0] for x in rows):6.1f} ms, "
              f"step {statistics.median(x[1] for x in rows):6.1f} ms")
    ratio = [h[0] / i[0] for h, i in zip(res["http"], res["in-process"])]
    print(f"ITL http / in-process: median {statistics.median(ratio):.2f} ({', '.join(f'{x:.2f}' for x in ratio)})")
    srv.stop()


if __name__ == "__main__":
    main()
