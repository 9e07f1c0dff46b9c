"""What a constraint costs: `python -m runtime.bench.constrain [-m MODEL] [--schemas FILE] [-r N]`.

Decode: one JSON answer is generated greedily under a schema; then the same tokens are fed again, step by step,
in interleaved runs: plain (the step's logits, then the sampler) and constrained (the step's logits, the
matcher's mask, apply_mask, the sampler, consume).  The engine's work is the same token for token, so the
difference is the constraint's.  Reported: the median step of each kind over all runs, and the median of the
constraint's own work (mask + apply + consume) a step.  Batch 1, CPU backend.

Compile: each schema of the file compiled from scratch (grammar + llguidance matcher) and its first mask.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_SCHEMAS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "constrain" / "schemas.json"


def _ms(x: float) -> float:
    return round(1e3 * x, 3)


def compile_times(eng, schemas: list[dict]) -> list[dict]:
    import llguidance as llg
    from runtime.constrain import JSON_OPTIONS, ll_tokenizer, mask_words
    ll = ll_tokenizer(eng)
    row = np.zeros(mask_words(ll.vocab_size), np.uint32)
    out = []
    for d in schemas:
        t0 = time.perf_counter()
        g = llg.LLMatcher.grammar_from_json_schema(d["schema"], overrides=JSON_OPTIONS)
        m = llg.LLMatcher(ll, g, log_level=0)
        t1 = time.perf_counter()
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        t2 = time.perf_counter()
        out.append({"schema": d["name"], "compile_ms": _ms(t1 - t0), "first_mask_ms": _ms(t2 - t1),
                    "error": m.get_error() if m.is_error() else ""})
    return out


def decode_costs(eng, schema: dict, prompt: str, n_tokens: int, runs: int) -> dict:
    from runtime.chat_template import encode_chat
    from runtime.constrain import Constraint, apply_mask
    from runtime.generate import Generation
    from runtime.sampling import Sampler, SamplingParams
    c = Constraint.json_schema(schema, eng)
    ids = encode_chat(eng.tokenizer, None, [{"role": "user", "content": f"Reply with JSON only: {prompt}."}],
                      arch=eng.config.arch)
    greedy = SamplingParams(temperature=0.0)
    gen = Generation(eng, ids, greedy, max_tokens=n_tokens, constraint=c).run()
    toks = gen.ids
    sampler = Sampler(greedy)
    plain, constrained, own = [], [], []
    row = np.zeros((1, c.n_words), np.uint32)
    for r in range(2 * runs):
        with_mask = r % 2 == 1             # interleaved: plain, constrained, plain, ...
        seq = eng.new_sequence()
        eng.prefill(seq, ids)
        m = c.matcher()
        prev = toks[0]
        if with_mask:
            m.consume(prev)
        for t in toks[1:]:
            t0 = time.perf_counter()
            logits = eng.step([seq], [[prev]])[0]
            if with_mask:
                t1 = time.perf_counter()
                m.fill_mask(row[0])
                apply_mask(logits, row[0])
                t2 = time.perf_counter()
            got = sampler.sample(logits)
            if with_mask:
                t3 = time.perf_counter()
                m.consume(t)
                t4 = time.perf_counter()
                own.append((t2 - t1) + (t4 - t3))
            dt = time.perf_counter() - t0
            (constrained if with_mask else plain).append(dt)
            assert not with_mask or got == t, "the replay diverged"
            prev = t
        eng.release(seq)
    p, q = statistics.median(plain), statistics.median(constrained)
    return {"tokens": len(toks), "text": gen.text, "runs_each": runs,
            "plain_step_ms": _ms(p), "constrained_step_ms": _ms(q), "overhead_pct": round(100 * (q / p - 1), 2),
            "constraint_work_ms": _ms(statistics.median(own)),
            "constraint_work_p90_ms": _ms(float(np.percentile(own, 90)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.bench.constrain", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--schemas", default=str(DEFAULT_SCHEMAS))
    ap.add_argument("--decode-schema", default="customer", help="the schema (by name) the decode test uses")
    ap.add_argument("-n", "--n-tokens", type=int, default=64)
    ap.add_argument("-r", "--runs", type=int, default=5, help="runs of each kind, interleaved")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from runtime.engine import Engine
    schemas = json.loads(Path(args.schemas).read_text(encoding="utf-8"))
    eng = Engine(args.model, device="cpu", n_ctx=1024, threads=args.threads)
    d = next(s for s in schemas if s["name"] == args.decode_schema)
    dec = decode_costs(eng, d["schema"], d["prompt"], args.n_tokens, args.runs)
    comp = compile_times(eng, schemas)
    res = {"model": str(eng.loaded.path.name), "decode": dec, "compile": comp}
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"model {res['model']}, CPU, batch 1, schema {args.decode_schema!r}, {dec['tokens']} tokens, "
          f"{dec['runs_each']} interleaved runs of each")
    print(f"  plain step        {dec['plain_step_ms']:8.2f} ms (median)")
    print(f"  constrained step  {dec['constrained_step_ms']:8.2f} ms (median)  {dec['overhead_pct']:+.1f}%")
    print(f"  constraint's own work a step: median {dec['constraint_work_ms']:.3f} ms, "
          f"p90 {dec['constraint_work_p90_ms']:.3f} ms (mask + apply_mask + consume)")
    print("schema compile (grammar + matcher) and first mask, ms:")
    for c in comp:
        print(f"  {c['schema']:<22} {c['compile_ms']:8.2f} {c['first_mask_ms']:8.3f} {c['error']}")
    tot = [c["compile_ms"] for c in comp]
    print(f"  median {statistics.median(tot):.2f} ms, max {max(tot):.2f} ms over {len(tot)} schemas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
