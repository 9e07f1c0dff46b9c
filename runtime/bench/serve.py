"""`python -m runtime bench-serve URL`: load any OpenAI-compatible server (ours, llama-server,
vLLM...) with C concurrent streaming clients and report what its users feel.

Each client sends text completions (`/v1/completions`, streamed) one after another, over a
fixed, seeded set of prompts of mixed lengths, for --requests each or --duration seconds.
Reported per concurrency: time to first token and inter-token latency (p50, p99), aggregate
output tokens/s, requests/s, and how many answers failed.  Tokens are the server's usage count
(stream_options.include_usage), else the streamed token chunks; a token's chunk is one that carries
text, or an empty text that is not the closing chunk (llama-server streams a token it does not
show, a random model's control token, as ""; counting only text counted such answers as 0 tokens).

--shared-prefix N puts the same N-token-ish text before every prompt (a system prompt that
clients share: the prefix cache's case; --prefix-seed picks another prefix, or the same one
behind other questions).  --abort-fraction F drops that fraction of the answers mid-stream: the
client closes its socket after a random number of tokens (a client that goes away).  Every
answer is counted by outcome: its HTTP status, "aborted", an error event inside a 200 stream
(counted as 500) or the transport error's name; `server_errors` counts the 5xx among them.

--schemas [FILE] measures structured output instead (default FILE: the 30+ schemas of
tests/fixtures/constrain/schemas.json), one request at a time: for each schema a streamed chat
completion with `response_format: json_schema` (strict) and the same request unconstrained,
greedy, -n tokens at most.  Recorded: the answer parses and validates (`jsonschema`, formats
checked; where the answer holds a markdown code block, that is what is checked), completion
tokens (usage), time to first token, decode tokens/s = (chunks - 1) / (last chunk - first).
Several URLs are run in turn, --rounds times (never two servers at once), after one
untimed request each; they take turns request by request.  Reported per URL and mode: validity
rate, median decode tokens/s, and the median over requests of the first URL's speed / this one's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time

WORDS = ("the of and to in is was for on that with as by at from his her an which or be are this had not but "
         "were they it have one all their there been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now "
         "such like our over man me even most made after also did many before must through back years where "
         "much your way well down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take three").split()
TOPICS = ("a lighthouse keeper", "the history of bread", "a robot learning to paint", "the rivers of Europe",
          "a chess tournament", "how volcanoes form", "a letter to a future city", "the life of bees",
          "a journey across a desert", "the first computer", "a storm at sea", "a small mountain village")


def prompts(n: int, seed: int, shared_prefix: int = 0, prefix_seed: int | None = None) -> list[str]:
    """n prompts of mixed lengths (about 20, 150 and 600 words, in a 4:2:1 mix), seeded; behind a
    shared prefix, short ones (a system prompt, then a user's question).  The prefix is drawn
    from `prefix_seed` (default: `seed`), the questions from `seed`."""
    rng = random.Random(seed)
    prefix = ""
    if shared_prefix:
        srng = random.Random((seed if prefix_seed is None else prefix_seed) + 1)
        # (each of WORDS, after a space, is one token in SmolLM2's and Qwen2.5's vocabularies: N words
        # make a prefix of ~N tokens; until session 31 it took 0.75 N words, ~0.75 N tokens)
        prefix = "System: " + " ".join(srng.choice(WORDS) for _ in range(shared_prefix)) + "\n\n"
    out = []
    for i in range(n):
        words = 20 if shared_prefix else rng.choice((20, 20, 20, 20, 150, 150, 600))
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(f"{prefix}{body}\n\nNow write a long, detailed story about {rng.choice(TOPICS)}.\n\n")
    return out


def _sse_event(line: str) -> dict | None:
    """The JSON event of a server-sent `data:` line (None for other lines and `[DONE]`)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


async def _one(client, url, headers, prompt, args, rng, out):
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.model:
        body["model"] = args.model
    t0 = time.perf_counter()
    stamps, usage = [], {}
    abort_after = rng.randint(1, max(1, args.max_tokens // 2)) if rng.random() < args.abort_fraction else None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                out.append({"status": r.status_code})
                return
            async for line in r.aiter_lines():
                ev = _sse_event(line)
                if ev is None:
                    continue
                if "error" in ev:
                    out.append({"status": 500})
                    return
                usage = ev.get("usage") or usage
                # a token's chunk: text, or none yet but not the closing one (a token whose text
                # is held back or not shown, as llama-server streams a control token: "")
                if any(c.get("text") or ("text" in c and c.get("finish_reason") is None)
                       for c in ev.get("choices", [])):
                    stamps.append(time.perf_counter())
                    if abort_after is not None and len(stamps) >= abort_after:
                        out.append({"status": "aborted", "tokens": len(stamps), "t0": t0, "stamps": stamps})
                        return          # leaving the block closes the connection mid-answer
    except Exception as e:          # a refused or dropped connection is a failed answer
        out.append({"status": type(e).__name__})
        return
    out.append({"status": 200, "tokens": usage.get("completion_tokens", len(stamps)), "t0": t0, "stamps": stamps})


async def _run_level(url, headers, c, args, texts):
    import httpx
    results = []
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    deadline = time.perf_counter() + args.duration if args.duration else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        async def worker(w):
            rng = random.Random(args.seed * 1000 + w)
            i = w
            for k in range(10 ** 9):
                if deadline is None and k >= args.requests:
                    break
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                await _one(client, url, headers, texts[i % len(texts)], args, rng, results)
                i += c
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(w) for w in range(c)])
        wall = time.perf_counter() - t0
    return results, wall


def _pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summarize(results, wall, c) -> dict:
    ok = [r for r in results if r["status"] == 200]
    streamed = [r for r in results if r["status"] in (200, "aborted") and r.get("stamps")]
    ttft = [r["stamps"][0] - r["t0"] for r in streamed]
    itl = [b - a for r in streamed for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(r.get("tokens", 0) for r in results)
    codes = {}
    for r in results:
        codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
    server_errors = sum(1 for r in results if isinstance(r["status"], int) and r["status"] >= 500)
    return {"concurrency": c, "requests": len(results), "completed": len(ok), "statuses": codes,
            "server_errors": server_errors, "aborted": codes.get("aborted", 0),
            "wall_s": round(wall, 2), "output_tokens": tokens,
            "output_tok_s": round(tokens / wall, 2), "requests_s": round(len(ok) / wall, 3),
            "ttft_p50_ms": round(1e3 * _pct(ttft, 50), 1), "ttft_p99_ms": round(1e3 * _pct(ttft, 99), 1),
            "itl_p50_ms": round(1e3 * _pct(itl, 50), 1), "itl_p99_ms": round(1e3 * _pct(itl, 99), 1),
            "itl_mean_ms": round(1e3 * statistics.fmean(itl), 1) if itl else float("nan")}


def run(args) -> int:
    urls = [u.rstrip("/").removesuffix("/v1") for u in args.url]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.schemas:
        return run_schemas(args, urls, headers)
    if len(urls) > 1:
        print("bench-serve: one URL at a time, unless --schemas", file=sys.stderr)
        return 2
    url = urls[0]
    args.max_tokens = args.max_tokens or 128
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    rows = []
    for c in levels:
        n = max(c * (args.requests or 1), 8)
        texts = prompts(n, args.seed, args.shared_prefix, args.prefix_seed)
        results, wall = asyncio.run(_run_level(url, headers, c, args, texts))
        row = summarize(results, wall, c)
        rows.append(row)
        if not args.json:
            print(f"C={c:3d}  {row['output_tok_s']:8.1f} tok/s  {row['requests_s']:6.2f} req/s  "
                  f"TTFT p50 {row['ttft_p50_ms']:8.1f} p99 {row['ttft_p99_ms']:8.1f} ms  "
                  f"ITL p50 {row['itl_p50_ms']:6.1f} p99 {row['itl_p99_ms']:7.1f} ms  "
                  f"{row['completed']}/{row['requests']} ok, 5xx {row['server_errors']} {row['statuses']}", flush=True)
    if args.json:
        print(json.dumps({"url": url, "rows": rows}))
    return 0


SCHEMA_PROMPT = "Reply with JSON only: {what}, as one object valid under this JSON schema:\n{schema}"


def _chat(client, url, headers, body) -> dict:
    """One streamed chat completion: its text, the content chunks' times, usage and finish reason."""
    t0 = time.perf_counter()
    stamps, text, usage, finish = [], [], {}, None
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "error": r.read().decode(errors="replace")[:300]}
            for line in r.iter_lines():
                ev = _sse_event(line)
                if ev is None:
                    continue
                if "error" in ev:
                    return {"status": 500, "error": str(ev["error"])[:300]}
                usage = ev.get("usage") or usage
                for c in ev.get("choices", []):
                    if (c.get("delta") or {}).get("content"):
                        stamps.append(time.perf_counter())
                        text.append(c["delta"]["content"])
                    finish = c.get("finish_reason") or finish
    except Exception as e:          # a refused or dropped connection is a failed answer
        return {"status": type(e).__name__, "error": str(e)[:300]}
    n = len(stamps)
    return {"status": 200, "text": "".join(text), "finish": finish, "chunks": n,
            "tokens": usage.get("completion_tokens", n), "ttft_s": stamps[0] - t0 if n else None,
            "wall_s": time.perf_counter() - t0,
            "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]) if n > 2 and stamps[-1] > stamps[0] else None}


def _check(text: str, schema: dict) -> tuple[bool, bool, str]:
    """(parses, validates, why not); where the answer holds a markdown code block, its content is checked."""
    import jsonschema
    m = re.search(r"```(?:json)?[ \t]*\n(.*?)\n?```", text, re.S)
    text = m.group(1) if m else text
    try:
        value = json.loads(text)
    except ValueError as e:
        return False, False, f"parse: {e}"
    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    except jsonschema.ValidationError as e:
        return True, False, f"schema: {e.message[:200]}"
    return True, True, ""


def _schema_request(d: dict, mode: str, args) -> dict:
    content = SCHEMA_PROMPT.format(what=d["prompt"], schema=json.dumps(d["schema"]))
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens or 256,
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if mode == "constrained":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": d["name"], "schema": d["schema"], "strict": True}}
    if args.model:
        body["model"] = args.model
    return body


def run_schemas(args, urls, headers) -> int:
    import httpx

    from .constrain import DEFAULT_SCHEMAS
    schemas = json.loads(open(args.schemas if args.schemas != "-" else DEFAULT_SCHEMAS, encoding="utf-8").read())
    if args.only:
        schemas = [d for d in schemas if d["name"] in args.only.split(",")]
    labels = args.labels.split(",") if args.labels else urls
    modes = ("constrained",) if args.constrained_only else ("constrained", "plain")
    rows = []
    # a connection a request: llama-server drops a keep-alive connection idle for 5 s, which a turn
    # of the other server can outlast (a request sent as it closes is lost)
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        for url in urls:                                   # one untimed request each: first-call costs
            _chat(client, url, headers, _schema_request(schemas[0], "constrained", args))
        for rnd in range(args.rounds):
            for d in schemas:
                for mode in modes:
                    # the servers take turns request by request (first one, then the other first), so
                    # that a busy spell on a shared machine falls on both
                    for url, label in (zip(urls, labels) if rnd % 2 == 0 else zip(urls[::-1], labels[::-1])):
                        r = _chat(client, url, headers, _schema_request(d, mode, args))
                        if r["status"] == 200:
                            r["parses"], r["valid"], r["why"] = _check(r["text"], d["schema"])
                        else:
                            r["parses"], r["valid"], r["why"] = False, False, f"HTTP {r['status']}: {r['error']}"
                        r.update(server=label, round=rnd, schema=d["name"], mode=mode)
                        rows.append(r)
                        if args.verbose:
                            print(f"  {label} r{rnd} {mode:<11} {d['name']:<22} {r.get('tokens', 0):4} tok "
                                  f"{r.get('decode_tok_s') or 0:7.1f} tok/s {'ok' if r['valid'] else r['why']}",
                                  file=sys.stderr, flush=True)
    summary = []
    for label in labels:
        for mode in modes:
            rs = [r for r in rows if r["server"] == label and r["mode"] == mode]
            tps = [r["decode_tok_s"] for r in rs if r.get("decode_tok_s")]
            per_round = [statistics.median(x) for x in
                         ([r["decode_tok_s"] for r in rs if r["round"] == k and r.get("decode_tok_s")]
                          for k in range(args.rounds)) if x]
            summary.append({"server": label, "mode": mode, "requests": len(rs),
                            "valid": sum(r["valid"] for r in rs), "parses": sum(r["parses"] for r in rs),
                            "valid_pct": round(100 * sum(r["valid"] for r in rs) / max(1, len(rs)), 1),
                            "decode_tok_s_p50": round(statistics.median(tps), 2) if tps else None,
                            "decode_tok_s_rounds": [round(x, 2) for x in per_round],
                            "ttft_p50_ms": round(1e3 * statistics.median([r["ttft_s"] for r in rs if r.get("ttft_s")]
                                                                          or [float("nan")]), 1),
                            "tokens_p50": statistics.median([r.get("tokens", 0) for r in rs]) if rs else 0,
                            "failures": sorted({f"{r['schema']}: {r['why']}" for r in rs if not r["valid"]})})
    speed = {(r["server"], r["round"], r["schema"], r["mode"]): r.get("decode_tok_s") for r in rows}
    for s in summary:                   # the first server's speed over this one's, paired request by request
        pairs = [speed[(labels[0],) + k[1:]] / v for k, v in speed.items()
                 if k[0] == s["server"] and k[3] == s["mode"] and v and speed.get((labels[0],) + k[1:])]
        if pairs:
            s["first_to_this_ratio"] = round(statistics.median(pairs), 3)
    if args.json:
        print(json.dumps({"urls": urls, "labels": labels, "schemas": len(schemas), "rounds": args.rounds,
                          "max_tokens": args.max_tokens or 256, "summary": summary, "requests": rows}))
        return 0
    print(f"{len(schemas)} schemas, {args.rounds} round(s), max_tokens {args.max_tokens or 256}, "
          f"temperature {args.temperature}")
    for s in summary:
        print(f"{s['server']:<24} {s['mode']:<11} valid {s['valid']:3}/{s['requests']:<3} ({s['valid_pct']:5.1f}%)  "
              f"parse {s['parses']:3}  decode {s['decode_tok_s_p50'] or 0:7.2f} tok/s (rounds "
              f"{s['decode_tok_s_rounds']})  TTFT p50 {s['ttft_p50_ms']:7.1f} ms  tokens p50 {s['tokens_p50']}"
              + (f"  {labels[0]}/this {s['first_to_this_ratio']:.3f} (paired median)" if s["server"] != labels[0]
                 and "first_to_this_ratio" in s else ""))
        for f in s["failures"][:args.show_failures]:
            print(f"    {f}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="+", help="the server's base URL, e.g. http://127.0.0.1:8080 (--schemas: several)")
    p.add_argument("-C", "--concurrency", default="1,4,8,16,32", help="client counts to run, one after another")
    p.add_argument("--requests", type=int, default=4, help="requests a client sends (default 4)")
    p.add_argument("--duration", type=float, default=0, help="send for this many seconds instead of --requests")
    p.add_argument("-n", "--max-tokens", type=int, default=None, help="default 128; --schemas 256")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N", help="a shared ~N-token prefix on every prompt")
    p.add_argument("--prefix-seed", type=int, default=None, help="seed of the shared prefix (default: --seed)")
    p.add_argument("--abort-fraction", type=float, default=0.0,
                   help="close the connection mid-answer in this fraction of requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", action="store_true")
    g = p.add_argument_group("structured output (--schemas)")
    g.add_argument("--schemas", nargs="?", const="-", default=None, metavar="FILE",
                   help="JSON schemas to ask for, [{name, prompt, schema}] (default: the test fixture's)")
    g.add_argument("--only", default=None, metavar="NAMES", help="only these schemas (comma-separated names)")
    g.add_argument("--rounds", type=int, default=1, help="rounds over all URLs, interleaved")
    g.add_argument("--labels", default=None, help="a name for each URL, comma-separated")
    g.add_argument("--constrained-only", action="store_true", help="skip the unconstrained reference requests")
    g.add_argument("--show-failures", type=int, default=5, metavar="N", help="failed answers listed per row")
    g.add_argument("-v", "--verbose", action="store_true", help="one line per request on stderr")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m runtime.bench.serve", description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
