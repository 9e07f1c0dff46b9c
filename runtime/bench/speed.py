"""`python -m runtime bench`: llama-bench-style speed figures.

pp<N>: prompt processing, N random tokens in one batched forward on a fresh
sequence.  tg<N>: N single-token decode steps after a 1-token prompt (or after
`depth` tokens already in the cache).  Each test runs once untimed (kernel
compilation, page faults), then -r timed repetitions; t/s is the mean ± sd.
With --peer PYTHON, llama.cpp (llama-cpp-python in that interpreter's venv)
runs the same tests in the same invocation, so the ratio is measured side by
side: each repetition runs ours, then llama.cpp's, and the ratio reported is the
median of the per-repetition ratios.

KV-cache tests: --ctx-depths D1,D2,..: tg at each context depth (D tokens already
in the cache before the timed run; the context is filled once per depth and
rolled back to D after each repetition); --plot FILE.png draws t/s against
depth.  --prefix-reuse N: time to first token of a new turn after an N-token
history, cold (nothing cached) against reused (the history's blocks cached).
--cache-type q8_0 runs everything on a q8_0 KV cache.  --json rows carry the
KV accounting (engine.stats()) of the moment the test's sequence was largest.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..generate import greedy_next


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
    """n greedy decode steps, each as Generation's token loop takes it (greedy_next)."""
    seq = engine.new_sequence()
    try:
        prompt = _random_tokens(engine, max(depth, 1), rng)
        for i in range(0, len(prompt), 512):
            logits = engine.step([seq], [prompt[i:i + 512]])
        nxt = int(np.argmax(logits[0]))
        t = time.perf_counter()
        for _ in range(n):
            nxt = greedy_next(engine, seq, nxt)
        return n / (time.perf_counter() - t)
    finally:
        engine.release(seq)


def time_tg_at_depth(engine, n: int, depth: int, reps: int, rng) -> tuple[list[float], dict]:
    """tg n at a fixed context depth: fill `depth` tokens once, then per repetition
    decode n tokens and roll the cache back to depth (first repetition untimed)."""
    seq = engine.new_sequence()
    try:
        prompt = _random_tokens(engine, max(depth, 1), rng)
        for i in range(0, len(prompt), 512):
            logits = engine.step([seq], [prompt[i:i + 512]])
        first = int(np.argmax(logits[0]))
        runs, stats = [], {}
        for r in range(reps + 1):
            nxt = first
            t = time.perf_counter()
            for _ in range(n):
                nxt = greedy_next(engine, seq, nxt)
            dt = time.perf_counter() - t
            if r:
                runs.append(n / dt)
            stats = engine.stats()
            engine.cache.truncate(seq, len(prompt))
        return runs, stats
    finally:
        engine.release(seq)


def time_prefix_reuse(engine, n_history: int, n_turn: int, reps: int, rng) -> dict:
    """Time to first token of an n_turn-token new turn after an n_history-token
    history: cold (fresh tokens, nothing cached) vs reused (history blocks cached
    by the previous turn's sequence).  Medians over reps, after one warm-up."""
    def ttft(tokens):
        seq = engine.new_sequence()
        try:
            t = time.perf_counter()
            logits = engine.prefill(seq, tokens)
            int(np.argmax(logits))
            return (time.perf_counter() - t) * 1e3, seq.reused_tokens
        finally:
            engine.release(seq)
    cold, warm, reused = [], [], 0
    for r in range(reps + 1):
        history = _random_tokens(engine, n_history, rng)       # new ids: nothing of it is cached
        turn = _random_tokens(engine, n_turn, rng)
        c, _ = ttft(history + turn)                           # cold; leaves the history's blocks cached
        w, reused = ttft(history + _random_tokens(engine, n_turn, rng))   # the next turn
        if r:
            cold.append(c); warm.append(w)
    c, w = statistics.median(cold), statistics.median(warm)
    return {"test": f"prefix-reuse{n_history}", "history_tokens": n_history, "new_tokens": n_turn,
            "reused_tokens": reused, "ttft_cold_ms": c, "ttft_reused_ms": w, "speedup": c / w,
            "ttft_cold_ms_runs": cold, "ttft_reused_ms_runs": warm}


def plot_depths(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series = {}
    for r in rows:
        if r["test"].startswith("tg") and "depth" in r:
            series.setdefault(f"{r.get('model', '')} ({r.get('backend', '')})", []).append(r)
    for name, rs in series.items():
        rs.sort(key=lambda r: r["depth"])
        ax.errorbar([r["depth"] for r in rs], [r["t_s"] for r in rs], yerr=[r["sd"] for r in rs],
                    marker="o", capsize=3, label=name)
    ax.set_xlabel("context depth (tokens in the KV cache)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("tg vs context depth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def weight_bytes_per_token(lm) -> int:
    """Weight bytes a decoded token reads: all but the embedding table (one row of it is
    read) unless it doubles as the output layer; of a mixture of experts' expert tensors
    (ffn_*_exps) the chosen share, n_experts_used of n_experts."""
    cfg = lm.config
    total = 0
    for name, t in lm.tensors.items():
        if name == "token_embd.weight" and not cfg.tied_output:
            continue
        if cfg.n_experts and name.endswith("_exps.weight"):
            total += t.nbytes * cfg.n_experts_used // cfg.n_experts
        else:
            total += t.nbytes
    return int(total)


def mean_sd(runs) -> tuple[float, float]:
    return statistics.mean(runs), (statistics.stdev(runs) if len(runs) > 1 else 0.0)


def warm_up(fn, engine=None, most: int = 4) -> None:
    """Run fn untimed: it compiles, faults pages in; and again while a run still pays an
    engine's one-time cost (setup_events: a CUDA graph captured; a prompt chunk of a new
    length run eagerly before its graphs are captured), so timed runs are steady."""
    for _ in range(most):
        before = getattr(engine, "setup_events", 0)
        fn()
        if getattr(engine, "setup_events", 0) == before:
            break


def timed_runs(fn, reps: int, engine=None) -> list[float]:
    warm_up(fn, engine)
    return [fn() for _ in range(reps)]


def measure(fn, reps: int, engine=None) -> tuple[float, float]:
    return mean_sd(timed_runs(fn, reps, engine))


def run_bench(args) -> int:
    from ..engine import Engine
    depths = [int(d) for d in str(getattr(args, "ctx_depths", None) or "").split(",") if d.strip()]
    reuse_n = getattr(args, "prefix_reuse", 0) or 0
    n_ctx = max(args.ctx_size, args.n_prompt + args.n_gen + 16, 4096, max(depths or [0]) + args.n_gen + 1,
                reuse_n + 64)
    engine = Engine(args.model, device=args.device, n_ctx=n_ctx, threads=args.threads,
                    gpu_layers=getattr(args, "gpu_layers", None), cpu_moe=getattr(args, "n_cpu_moe", 0),
                    cache_type=getattr(args, "cache_type", "f16") or "f16",
                    announce=lambda m: print(m, file=sys.stderr))
    lm = engine.loaded
    rng = np.random.default_rng(0)
    model_desc = {"model": lm.path.name, "size_bytes": lm.weight_bytes, "params": lm.n_params,
                  "backend": engine.backend.name, "device": engine.backend.device_name,
                  "gpu_memory": getattr(engine.backend, "memory_report", dict)(),
                  "threads": getattr(engine.backend, "threads", None), "cache_type": engine.cache_type}
    rows = []
    tests = []
    if args.n_prompt:
        tests.append((f"pp{args.n_prompt}", lambda: time_pp(engine, args.n_prompt, rng)))
    if args.n_gen:
        tests.append((f"tg{args.n_gen}", lambda: time_tg(engine, args.n_gen, rng)))
    if args.peer:
        # llama.cpp's repetitions interleaved with ours: a shared machine that
        # changes speed between the two halves of a run biases their ratio
        runs, peer_rows = _interleaved_with_peer(args, lm.path, tests, engine)
    else:
        runs = {name: timed_runs(fn, args.repetitions, engine) for name, fn in tests}
        peer_rows = []
    per_tok = weight_bytes_per_token(lm)
    for name, _ in tests:
        m, sd = mean_sd(runs[name])
        rows.append({**model_desc, "test": name, "t_s": m, "sd": sd, "depth": 0, "runs": runs[name]})
        if name.startswith("tg"):
            rows[-1]["weight_bytes_per_token"] = per_tok
            rows[-1]["weight_GB_per_s"] = per_tok * m / 1e9
    for d in depths:
        eff = min(d, engine.n_ctx - args.n_gen - 1)
        if eff != d:
            print(f"depth {d} + {args.n_gen} exceeds the model's context {engine.n_ctx}: measuring at {eff}",
                  file=sys.stderr)
        drun, kv = time_tg_at_depth(engine, args.n_gen, eff, args.repetitions, rng)
        # a memory-bound decode reads the weights plus the context's K/V per token
        kv_tok = engine.stats()["bytes_per_token"]
        m, sd = mean_sd(drun)
        rows.append({**model_desc, "test": f"tg{args.n_gen}@d{d}", "depth": eff, "depth_requested": d,
                     "t_s": m, "sd": sd, "t_s_median": statistics.median(drun), "kv_cache": kv,
                     "weight_bytes_per_token": per_tok, "kv_bytes_per_context_token": kv_tok,
                     "bytes_per_token": per_tok + eff * kv_tok})
    base = next((r for r in rows if r["test"].startswith("tg") and "@d" in r["test"] and r["depth"] == 0), None)
    for r in rows:
        if base is not None and "bytes_per_token" in r:
            # t/s relative to depth 0, and the same ratio if decode were bound by bytes read
            r["ratio_to_depth0"] = r["t_s"] / base["t_s"]
            r["bytes_bound_ratio"] = base["bytes_per_token"] / r["bytes_per_token"]
    if reuse_n:
        rows.append({**model_desc, **time_prefix_reuse(engine, reuse_n, 32, args.repetitions, rng)})
    rows += peer_rows
    kv_final = engine.stats()
    for r in rows:
        r.setdefault("kv_cache", kv_final)
    if getattr(args, "plot", None):
        plot_depths(rows, args.plot)
    if args.json:
        print(json.dumps(rows))
    else:
        _print_table(rows)
    return 0


def _interleaved_with_peer(args, path: Path, tests, engine=None):
    """Each repetition runs our tests once, then llama.cpp's (a fresh peer process
    with -r 1, after its own untimed run).  Returns our runs {test: [t/s, ...]}
    and the peer's rows (mean, sd and runs over the repetitions, and the median of
    the per-repetition ratios ours / llama.cpp)."""
    for _, fn in tests:
        warm_up(fn, engine)
    runs = {name: [] for name, _ in tests}
    peer: dict[str, list[dict]] = {}
    for _ in range(args.repetitions):
        for name, fn in tests:
            runs[name].append(fn())
        for r in _peer_rows(args, path, reps=1):
            peer.setdefault(r["test"], []).append(r)
    rows = []
    for name, prs in peer.items():
        v = [r["t_s"] for r in prs]
        m, sd = mean_sd(v)
        r = dict(prs[-1], t_s=m, sd=sd, runs=v)
        ratios = [a / b for a, b in zip(runs.get(name, []), v) if b > 0]
        if ratios and len(ratios) == len(v):
            r["ratio_ours_to_peer_median"] = statistics.median(ratios)
        rows.append(r)
    return runs, rows


def _peer_rows(args, path: Path, reps: int | None = None) -> list[dict]:
    script = Path(__file__).with_name("peer.py")
    cmd = [args.peer, str(script), "-m", str(path), "-p", str(args.n_prompt), "-n", str(args.n_gen),
           "-r", str(reps or args.repetitions), "-t", str(args.threads or 2), "--json"]
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
        if "ttft_cold_ms" in r:
            print(f"| {r['test']}: time to first token of a {r['new_tokens']}-token turn: cold "
                  f"{r['ttft_cold_ms']:.1f} ms, reused ({r['reused_tokens']} tokens cached) "
                  f"{r['ttft_reused_ms']:.1f} ms, {r['speedup']:.1f}x")
            continue
        size = f"{r.get('size_bytes', 0) / 2**20:.1f} MiB" if r.get("size_bytes") else ""
        params = f"{r.get('params', 0) / 1e6:.0f} M" if r.get("params") else ""
        print(f"| {str(r.get('model', ''))[:40]:<40} | {size:>9} | {params:>8} | {str(r.get('backend', ''))[:28]:<28} | "
              f"{str(r.get('threads', '')):>7} | {r['test']:>8} | {r['t_s']:>8.2f} ± {r['sd']:<5.2f} |")
    for r in rows:
        if "ratio_ours_to_peer_median" in r:
            print(f"| {r['test']}: Llamba / llama.cpp = {r['ratio_ours_to_peer_median']:.2f}x "
                  f"(median of {len(r['runs'])} interleaved repetitions)")
    for r in rows:
        if "ratio_to_depth0" in r:
            print(f"| {r['test']}: {r['ratio_to_depth0']:.2f}x of depth 0 (bytes-read bound "
                  f"{r['bytes_bound_ratio']:.2f}x: weights {r['weight_bytes_per_token'] / 1e6:.0f} MB + "
                  f"{r['depth']} x {r['kv_bytes_per_context_token'] / 1024:.1f} KiB K/V per token)")
