"""`python -m runtime bench --draft-model DRAFT`: speculative decoding against the
target alone, side by side.

For each repetition and prompt, the target decodes alone, then with the draft
(adaptive k, then each fixed k of --draft-sweep), greedy, n tokens.  Runs are
interleaved so a noisy machine slows all of them alike; speedups are medians of
per-pair ratios (speculative t/s over the target-alone t/s of the same prompt
and repetition), and every speculative output is checked token for token
against the target alone.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

from ..engine import Engine
from ..generate import Generation
from ..sampling import SamplingParams
from ..speculative import DEFAULT_DRAFT_QUANT, DEFAULT_DRAFT_VOCAB, Drafter

DEFAULT_PROMPTS = ("def quicksort(arr):", "class LRUCache:", "def binary_search(arr, target):")


def _run(target, ids, n, drafter=None):
    """Decode greedily; also time the decode (after the first token, which comes
    from the prompt's logits) in process CPU seconds, which a crowded machine
    distorts less than wall time."""
    marks = []

    def on_step(g):
        if not marks:
            marks.append(time.process_time())
    gen = Generation(target, ids, SamplingParams(temperature=0.0), max_tokens=n, drafter=drafter,
                     on_step=on_step).run()
    cpu = time.process_time() - marks[0] if marks else 0.0
    gen.cpu_tokens_per_s = (len(gen.ids) - 1) / cpu if cpu > 0 else 0.0
    target.release(gen.seq)
    if drafter is not None:
        drafter.release()
    return gen


def _step_costs(runs: list[tuple[dict, float]], k: int) -> dict:
    """Medians over runs of a fixed-k config's step costs, in one-token target steps:
    a draft step, the round's first (catch-up) draft step and the (k+1)-row verify.
    With the acceptance they give the speedup: a round emits up to k + 1 tokens for
    catch_up + (k - 1) * draft + verify target steps.  runs: (the run's step_ms, the
    ms a token of the target alone on the same prompt and repetition), the latter
    measured next to the run (the controller's own plain-step time is refreshed only
    now and then, and this machine's speed drifts)."""
    def ms(c, name):
        return c.get("verify", {}).get(str(k)) if name == "verify" else c.get(name)
    out = {}
    for name in ("draft", "catch_up", "verify"):
        v = [ms(c, name) / t for c, t in runs if t and ms(c, name)]
        if v:
            out[name] = round(statistics.median(v), 3)
    return out


def run_spec_bench(args) -> int:
    say = (lambda m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    target = Engine(args.model, device=args.device, n_ctx=args.ctx_size, threads=args.threads, announce=say,
                    cpu_moe=getattr(args, "n_cpu_moe", 0))
    vocab = DEFAULT_DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    dq = DEFAULT_DRAFT_QUANT if args.draft_quant is None else args.draft_quant
    drafter = Drafter.load(args.draft_model, target, k=args.draft_n, adaptive=True, draft_vocab=vocab, draft_quant=dq,
                           announce=say)
    sweep = [int(k) for k in (args.draft_sweep or "").split(",") if k.strip()]
    prompts = args.spec_prompt or list(DEFAULT_PROMPTS)
    n = args.n_gen
    configs = [("target", None), (f"draft adaptive k<={args.draft_n}", 0)] + [(f"draft k={k}", k) for k in sweep]

    say(f"warming up {target.loaded.path.name} and {drafter.draft.loaded.path.name}")
    # compile and first-touch every path the runs take: one-row and few-row steps,
    # and a >= 32-token prefill on both models (a draft catching up after a
    # fallback takes that path too)
    warm_ids = target.tokenizer.encode(prompts[0])
    long_ids = (target.tokenizer.encode("\n".join(prompts)) * 8)[:40]
    _run(target, long_ids, 4)
    _run(target, long_ids, 6, drafter)
    _run(target, warm_ids, 8, drafter)

    runs = []
    for rep in range(args.repetitions):
        for prompt in prompts:
            ids = target.tokenizer.encode(prompt)
            base = None
            for name, k in configs:
                if k is None:
                    d = None
                else:
                    d = drafter
                    d.k, d.adaptive = (k, False) if k else (args.draft_n, True)
                gen = _run(target, ids, n, d)
                if base is None:
                    base = gen
                row = {"config": name, "k": k, "prompt": prompt, "rep": rep,
                       "tokens": len(gen.ids), "tokens_per_s": gen.stats.tokens_per_s,
                       "ratio": gen.stats.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else 0.0,
                       "cpu_tokens_per_s": gen.cpu_tokens_per_s,
                       "cpu_ratio": gen.cpu_tokens_per_s / base.cpu_tokens_per_s if base.cpu_tokens_per_s else 0.0,
                       "identical": gen.ids == base.ids, "speculative": gen.stats.speculative,
                       "target_ms_per_token": 1e3 / base.stats.tokens_per_s if base.stats.tokens_per_s else 0.0}
                runs.append(row)
                sp = gen.stats.speculative
                say(f"  rep {rep} {prompt!r:34} {name:22} {row['tokens_per_s']:6.2f} t/s x{row['ratio']:.2f}"
                    f"  cpu {row['cpu_tokens_per_s']:6.2f} t/s x{row['cpu_ratio']:.2f}"
                    + (f"  accept {sp['acceptance_rate']:.0%}  {sp['tokens_per_target_forward']:.2f} tok/fwd"
                       f"  k {sp['k_rounds']}" if sp else "")
                    + ("" if row["identical"] else "  OUTPUT DIFFERS"))

    summary = []
    for name, k in configs:
        rows = [r for r in runs if r["config"] == name]
        sps = [r["speculative"] for r in rows if r["speculative"]]
        drafted = sum(s["drafted"] for s in sps)
        entry = {"config": name, "k": k,
                 "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows),
                 "speedup_median": statistics.median(r["ratio"] for r in rows),
                 "speedup_range": [min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)],
                 "cpu_tokens_per_s_median": statistics.median(r["cpu_tokens_per_s"] for r in rows),
                 "cpu_speedup_median": statistics.median(r["cpu_ratio"] for r in rows),
                 "identical_outputs": sum(r["identical"] for r in rows), "runs": len(rows)}
        if sps:
            entry["acceptance_rate"] = sum(s["accepted"] for s in sps) / drafted if drafted else 0.0
            fw = sum(s["verify_forwards"] + s["plain_forwards"] for s in sps)
            entry["tokens_per_target_forward"] = sum(s["accepted"] + s["verify_forwards"] + s["plain_forwards"]
                                                     for s in sps) / fw if fw else 0.0
        if k and sps:
            entry["step_costs"] = _step_costs([(r["speculative"].get("step_ms") or {}, r["target_ms_per_token"])
                                               for r in rows if r["speculative"]], k)
        summary.append(entry)
    fixed = [e for e in summary if e["k"]]
    best = max(fixed, key=lambda e: e["speedup_median"]) if fixed else None
    report = {"target": str(target.loaded.path.name), "draft": str(drafter.draft.loaded.path.name),
              "draft_vocab": vocab, "draft_quant": dq, "n_gen": n, "repetitions": args.repetitions, "prompts": prompts,
              "threads": getattr(target.backend, "threads", None), "summary": summary,
              "best_k": best["k"] if best else None, "runs": runs}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"\n{report['target']} drafted by {report['draft']} (draft vocab {vocab or 'all'}, "
          f"draft matrices {dq or 'none'}), greedy, "
          f"{n} tokens, {len(prompts)} prompts x {args.repetitions} reps, {report['threads']} threads")
    print(f"{'config':28} {'t/s':>8} {'speedup':>8} {'range':>11} {'cpu t/s':>8} {'speedup':>8} {'accept':>7} "
          f"{'tok/fwd':>8} {'identical':>10}   (medians; speedups are per-pair ratios)")
    for e in summary:
        acc = f"{e['acceptance_rate']:.0%}" if "acceptance_rate" in e else "-"
        tpf = f"{e['tokens_per_target_forward']:.2f}" if "tokens_per_target_forward" in e else "-"
        lo, hi = e["speedup_range"]
        print(f"{e['config']:28} {e['tokens_per_s_median']:8.2f} {e['speedup_median']:7.2f}x {lo:5.2f}-{hi:.2f} "
              f"{e['cpu_tokens_per_s_median']:8.2f} {e['cpu_speedup_median']:7.2f}x {acc:>7} "
              f"{tpf:>8} {e['identical_outputs']:>4}/{e['runs']}")
    for e in fixed:
        c = e.get("step_costs")
        if c:
            print(f"k={e['k']}: a draft step {c.get('draft', float('nan')):.2f}, the round's first "
                  f"{c.get('catch_up', float('nan')):.2f}, the {e['k'] + 1}-row verify "
                  f"{c.get('verify', float('nan')):.2f} one-token target steps (medians)")
    if best:
        print(f"best fixed k: {best['k']} ({best['speedup_median']:.2f}x)")
    return 0
