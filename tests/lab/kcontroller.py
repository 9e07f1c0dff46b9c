"""`python -m lab.kcontroller`: the draft-length controller replayed offline.

A whole speculative bench run swings by 5-10% with this machine's drift, more
than the controller changes it is meant to judge.  So this tool measures, once:

* for each bench prompt, the target's greedy output (n tokens) and, per position,
  whether the draft's argmax (teacher-forced on that output, one prefill) is the
  target's token: under greedy decoding that decides every round exactly;
* step costs, in one-token target steps: the target with 1..9 rows, the draft with
  1 and 2 rows.

Then it replays policies on those data: each fixed k, and the adaptive
KController itself (the Drafter's plain probes included), with every step cost
multiplied by a random-walk drift and per-step noise, over several seeds and six
generations through one controller, as the bench runs them.  Output: median and
10th percentile of the speedup over the target alone under the same drift.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from runtime.bench.speculative import DEFAULT_PROMPTS
from runtime.engine import Engine
from runtime.generate import Generation
from runtime.sampling import SamplingParams
from runtime.speculative import DEFAULT_DRAFT_QUANT, DEFAULT_DRAFT_VOCAB, Drafter, KController


def agreement(target: Engine, drafter: Drafter, prompts, n: int) -> list[np.ndarray]:
    """Per prompt: bool per emitted position, whether the draft guesses the target's token."""
    out = []
    for p in prompts:
        ids = target.tokenizer.encode(p)
        g = Generation(target, ids, SamplingParams(temperature=0.0), max_tokens=n).run()
        target.release(g.seq)
        toks = list(g.ids)
        D = drafter.draft
        seq = D.new_sequence()
        lg = np.asarray(D.step([seq], [ids + toks], all_logits=True))
        D.release(seq)
        guess = lg[len(ids) - 1:len(ids) + len(toks) - 1].argmax(1)
        if drafter.vocab_ids is not None:
            guess = drafter.vocab_ids[guess]
        out.append(guess == np.asarray(toks))
    return out


def step_costs(eng: Engine, rows, ctx_ids, reps: int) -> dict:
    """Median seconds of an eng step of r rows after len(ctx_ids) tokens of context."""
    seq = eng.new_sequence()
    eng.step([seq], [ctx_ids])
    base = len(seq)
    res = {}
    for r in rows:
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            eng.step([seq], [ctx_ids[:r]], all_logits=True, argmax=True)
            ts.append(time.perf_counter() - t0)
            eng.cache.truncate(seq, base)
        res[r] = statistics.median(ts[1:])
    eng.release(seq)
    return res


def replay(policy, match_sets, verify, d1, d2, seed, noise, drift, gens=6):
    """Speedup of `policy` (a fixed k, or "adaptive") over the target alone on the
    agreement data, costs in target steps times drift and noise."""
    rng = np.random.default_rng(seed)
    f = 1.0

    def cost(c):
        nonlocal f
        f = min(max(f * math.exp(rng.normal(0, drift)), 0.7), 1.4)
        return c * f * math.exp(rng.normal(0, noise))

    ctl = None
    t_spec = t_alone = 0.0
    for g in range(gens):
        match = match_sets[g % len(match_sets)]
        n = len(match)
        for _ in range(n - 1):
            t_alone += cost(1.0)
        if policy == "adaptive":
            if ctl is None:
                ctl = KController(k_max=8, adaptive=True, k_fixed=3)
            else:
                ctl.new_generation(8, True, 3)
        h, dpos, rounds = 1, 0, 0
        while h < n:
            if policy != "adaptive":
                k = policy
            elif Drafter.probe_due(ctl, rounds, True):
                k = 0
            else:
                k = ctl.choose()
            rounds += 1
            if k == 0:
                dt = cost(1.0)
                t_spec += dt
                h += 1
                if ctl is not None:
                    ctl.observe_plain(dt)
                continue
            first = cost(d1 if h - dpos <= 1 else d2)
            steps = [cost(d1) for _ in range(k - 1)]
            vt = cost(verify(k + 1))
            a = 0
            while a < k and h + a < n and match[h + a]:
                a += 1
            t_spec += first + sum(steps) + vt
            # the draft keeps history + the accepted drafts: the next round feeds 1 token, or 2
            dpos = h + a if a < k else h + k - 1
            h += a + 1
            if ctl is not None:
                ctl.observe_round(k, a, sum(steps) / len(steps) if steps else None, vt,
                                  catch_s=first, round_s=first + sum(steps) + vt)
    return t_alone / t_spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.kcontroller", description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--noise", type=float, default=0.06, help="per-step lognormal sigma")
    ap.add_argument("--drift", type=float, default=0.01, help="random-walk sigma a step")
    args = ap.parse_args(argv)
    target = Engine(args.model)
    drafter = Drafter.load(args.draft_model, target, k=3, adaptive=False,
                           draft_vocab=DEFAULT_DRAFT_VOCAB, draft_quant=DEFAULT_DRAFT_QUANT)
    matches = agreement(target, drafter, DEFAULT_PROMPTS, args.n)
    print("draft agreement per prompt: " + " ".join(f"{m.mean():.3f}" for m in matches))
    ctx = target.tokenizer.encode(DEFAULT_PROMPTS[0]) * 40
    ctx = ctx[:120]
    t = step_costs(target, range(1, 10), ctx, 5)
    d = step_costs(drafter.draft, (1, 2), ctx, 9)
    V = {r: t[r] / t[1] for r in t}
    d1, d2 = d[1] / t[1], d[2] / t[1]
    print("costs in one-token target steps: draft 1 row %.3f, 2 rows %.3f; target rows 2-9: %s"
          % (d1, d2, " ".join(f"{V[r]:.2f}" for r in range(2, 10))))

    def verify(rows):
        return V[rows] if rows in V else V[9] + (rows - 9) * (V[9] - V[8])
    for pol in (2, 3, 4, 5, "adaptive"):
        r = [replay(pol, matches, verify, d1, d2, s, args.noise, args.drift) for s in range(args.seeds)]
        print(f"{'k = ' + str(pol) if pol != 'adaptive' else 'adaptive':10s} median {statistics.median(r):.3f}x"
              f"  p10 {np.percentile(r, 10):.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
