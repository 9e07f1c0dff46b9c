"""Step plans in scheduler runs (closed loops of C clients over bench-serve's prompt mix): small forwards
replayed, recorded, or run plain (a key met the first time).

    PYTHONPATH=tests python -m lab.serve_plans MODEL TOKENS
"""
import os, sys
from runtime.engine import Engine
from runtime.bench.serve import prompts
from runtime.sampling import SamplingParams
from runtime.scheduler import Request, Scheduler
m = sys.argv[1]; n = int(sys.argv[2])
eng = Engine(os.path.expanduser(m), threads=2, n_ctx=4096, cache_blocks=4096)
pl = eng.backend.plans
small = [0]
raw = eng.step
def st(seqs, toks, **kw):
    if sum(len(t) for t in toks) <= 16: small[0] += 1
    return raw(seqs, toks, **kw)
eng.step = st
for c, nreq, seed in ((1, 6, 5), (8, 24, 7), (1, 6, 5)):
    ids = [eng.tokenizer.encode(t) for t in prompts(nreq, seed)]
    sch = Scheduler(eng, max_running=8, prefix_cache=False)
    r0, p0, s0 = pl.recorded, pl.replayed, small[0]
    pending = [Request(x, SamplingParams(temperature=0.0), max_tokens=n) for x in ids]
    live = []
    while pending or live:       # a closed loop of c clients
        while pending and len(live) < c:
            live.append(sch.submit(pending.pop(0)))
        sch.step()
        live = [q for q in live if not q.done.is_set()]
    sm = small[0] - s0; rec = pl.recorded - r0; rep = pl.replayed - p0
    print(f"C={c}: {sm} small forwards: {rep} replays, {rec} recordings, {sm - rep - rec} plain; {len(pl.plans)} plans held", flush=True)
