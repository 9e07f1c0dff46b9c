"""What a constraint costs: `python -m runtime.bench.constrain [-m MODEL] [--schemas FILE] [-r N]`.

Decode: one JSON answer is generated greedily under a schema; then the same tokens are fed again, step by step,
in interleaved runs: plain (the step's argmax, as unconstrained greedy decoding runs) and constrained (the
matcher's mask computed while the forward runs, the argmax among the allowed tokens taken where the logits
are, then consume: as Generation runs it).  The engine's work is the same token for token, so the difference
is the constraint's.  Reported: the median step of each kind over all runs, the mask's own time and consume's.
Batch 1, `--device cpu` (default) or `cuda`.

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
    from runtime.constrain import Constraint
    from runtime.generate import Generation, _masked_greedy_next, greedy_next
    from runtime.sampling import SamplingParams
    c = Constraint.json_schema(schema, eng)
    ids = encode_chat(eng.tokenizer, None, [{"role": "user", "content": f"Reply with JSON only: {prompt}."}],
                      arch=eng.config.arch)
    gen = Generation(eng, ids, SamplingParams(temperature=0.0), max_tokens=n_tokens, constraint=c).run()
    toks = gen.ids
    plain, constrained, masks, consumes = [], [], [], []
    for r in range(2 * runs):
        with_mask = r % 2 == 1             # interleaved: plain, constrained, plain, ...
        seq = eng.new_sequence()
        eng.prefill(seq, ids)
        m = c.matcher()
        fill = m.fill_mask

        def timed_fill(row):               # the mask's own time (it overlaps the forward)
            t = time.perf_counter()
            ok = fill(row)
            masks.append(time.perf_counter() - t)
            return ok
        m.fill_mask = timed_fill
        prev = toks[0]
        if with_mask:
            m.consume(prev)
        for t in toks[1:]:
            t0 = time.perf_counter()
            if with_mask:                  # what Generation does: the argmax among allowed tokens
                got = _masked_greedy_next(eng, seq, prev, m)
                t1 = time.perf_counter()
                m.consume(t)
                consumes.append(time.perf_counter() - t1)
            else:
                got = greedy_next(eng, seq, prev)
            (constrained if with_mask else plain).append(time.perf_counter() - t0)
            assert got == t or not with_mask, "the replay diverged"   # (plain steps feed the same tokens)
            prev = t
        eng.release(seq)
    p, q = statistics.median(plain), statistics.median(constrained)
    return {"tokens": len(toks), "text": gen.text, "runs_each": runs,
            "plain_step_ms": _ms(p), "constrained_step_ms": _ms(q), "overhead_pct": round(100 * (q / p - 1), 2),
            "mask_ms": _ms(statistics.median(masks)), "mask_p90_ms": _ms(float(np.percentile(masks, 90))),
            "consume_ms": _ms(statistics.median(consumes))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.bench.constrain", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--schemas", default=str(DEFAULT_SCHEMAS))
    ap.add_argument("--decode-schema", default="customer", help="the schema (by name) the decode test uses")
    ap.add_argument("-n", "--n-tokens", type=int, default=64)
    ap.add_argument("-r", "--runs", type=int, default=5, help="runs of each kind, interleaved")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from runtime.engine import Engine
    schemas = json.loads(Path(args.schemas).read_text(encoding="utf-8"))
    eng = Engine(args.model, device=args.device, n_ctx=1024, threads=args.threads)
    d = next(s for s in schemas if s["name"] == args.decode_schema)
    dec = decode_costs(eng, d["schema"], d["prompt"], args.n_tokens, args.runs)
    comp = compile_times(eng, schemas)
    res = {"model": str(eng.loaded.path.name), "decode": dec, "compile": comp}
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"model {res['model']}, {args.device}, batch 1, schema {args.decode_schema!r}, {dec['tokens']} tokens, "
          f"{dec['runs_each']} interleaved runs of each")
    print(f"  plain step        {dec['plain_step_ms']:8.2f} ms (median)")
    print(f"  constrained step  {dec['constrained_step_ms']:8.2f} ms (median)  {dec['overhead_pct']:+.1f}%")
    print(f"  the mask (computed while the forward runs): median {dec['mask_ms']:.3f} ms, p90 "
          f"{dec['mask_p90_ms']:.3f} ms; consume {dec['consume_ms']:.3f} ms")
    print("schema compile (grammar + matcher) and first mask, ms:")
    for c in comp:
        print(f"  {c['schema']:<22} {c['compile_ms']:8.2f} {c['first_mask_ms']:8.3f} {c['error']}")
    tot = [c["compile_ms"] for c in comp]
    print(f"  median {statistics.median(tot):.2f} ms, max {max(tot):.2f} ms over {len(tot)} schemas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
