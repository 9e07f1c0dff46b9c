"""`python -m runtime bench`: llama-bench-style speed figures.

pp<N>: prompt processing, N random tokens in one batched forward on a fresh
sequence.  tg<N>: N single-token decode steps after a 1-token prompt (or after
`depth` tokens already in the cache).  Each test runs once untimed (kernel
compilation, page faults), then -r timed repetitions; t/s is the mean ± sd.
With --peer PYTHON, llama.cpp (llama-cpp-python in that interpreter's venv)
runs the same tests in the same invocation, so the ratio is measured side by side.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _random_tokens(engine, n: int, rng) -> list[int]:
    # avoid special/control ids at the low and high ends of the vocabulary
    return rng.integers(100, engine.config.vocab_size - 1000, size=n).tolist()


def time_pp(engine, n: int, rng) -> float:
    seq = engine.new_sequence()
    toks = _random_tokens(engine, n, rng)
    try:
        t = time.perf_counter()
        engine.step([seq], [toks])
        return n / (time.perf_counter() - t)
    finally:
        engine.release(seq)


def time_tg(engine, n: int, rng, depth: int = 0) -> float:
    seq = engine.new_sequence()
    try:
        prompt = _random_tokens(engine, max(depth, 1), rng)
        for i in range(0, len(prompt), 512):
            logits = engine.step([seq], [prompt[i:i + 512]])
        nxt = int(np.argmax(logits[0]))
        t = time.perf_counter()
        for _ in range(n):
            nxt = int(np.argmax(engine.step([seq], [[nxt]])[0]))
        return n / (time.perf_counter() - t)
    finally:
        engine.release(seq)


def measure(fn, reps: int) -> tuple[float, float]:
    fn()                                    # warm-up: compile, fault pages in
    runs = [fn() for _ in range(reps)]
    return statistics.mean(runs), (statistics.stdev(runs) if len(runs) > 1 else 0.0)


def run_bench(args) -> int:
    from .engine import Engine
    engine = Engine(args.model, device=args.device, n_ctx=max(args.ctx_size, args.n_prompt + args.n_gen + 16, 4096),
                    gpu_layers=getattr(args, "gpu_layers", None),
                    threads=args.threads, announce=lambda m: print(m, file=sys.stderr))
    lm = engine.loaded
    rng = np.random.default_rng(0)
    model_desc = {"model": lm.path.name, "size_bytes": lm.weight_bytes, "params": lm.n_params,
                  "backend": engine.backend.name, "device": engine.backend.device_name,
                  "gpu_memory": getattr(engine.backend, "memory_report", dict)(),
                  "threads": getattr(engine.backend, "threads", None)}
    rows = []
    if args.n_prompt:
        m, sd = measure(lambda: time_pp(engine, args.n_prompt, rng), args.repetitions)
        rows.append({**model_desc, "test": f"pp{args.n_prompt}", "t_s": m, "sd": sd, "depth": 0})
    if args.n_gen:
        m, sd = measure(lambda: time_tg(engine, args.n_gen, rng), args.repetitions)
        rows.append({**model_desc, "test": f"tg{args.n_gen}", "t_s": m, "sd": sd, "depth": 0})
        # bytes read per decoded token: all weights except the embedding table
        # (only one row of it is read) unless it doubles as the output layer
        per_tok = lm.weight_bytes
        if not lm.config.tied_output:
            per_tok -= lm.tensors["token_embd.weight"].nbytes
        rows[-1]["weight_bytes_per_token"] = per_tok
        rows[-1]["weight_GB_per_s"] = per_tok * m / 1e9
    if args.peer:
        rows += _peer_rows(args, lm.path)
    if args.json:
        print(json.dumps(rows))
    else:
        _print_table(rows)
    return 0


def _peer_rows(args, path: Path) -> list[dict]:
    script = Path(__file__).with_name("bench_peer.py")
    cmd = [args.peer, str(script), "-m", str(path), "-p", str(args.n_prompt), "-n", str(args.n_gen),
           "-r", str(args.repetitions), "-t", str(args.threads or 2), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"peer benchmark failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return []
    return json.loads(out.stdout)


def _print_table(rows: list[dict]) -> None:
    head = f"| {'model':<40} | {'size':>9} | {'params':>8} | {'backend':<28} | {'threads':>7} | {'test':>8} | {'t/s':>16} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        size = f"{r.get('size_bytes', 0) / 2**20:.1f} MiB" if r.get("size_bytes") else ""
        params = f"{r.get('params', 0) / 1e6:.0f} M" if r.get("params") else ""
        print(f"| {str(r.get('model', ''))[:40]:<40} | {size:>9} | {params:>8} | {str(r.get('backend', ''))[:28]:<28} | "
              f"{str(r.get('threads', '')):>7} | {r['test']:>8} | {r['t_s']:>8.2f} ± {r['sd']:<5.2f} |")
