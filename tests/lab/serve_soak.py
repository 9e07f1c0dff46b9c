"""Soak the real server: C streaming clients for D seconds (bench-serve's load), a fraction of
them closing their connection mid-answer, for a few rounds against one server process; then
the verdict of issue 38's goal: no 5xx, every KV block back, memory flat.

    PYTHONPATH=tests python -m lab.serve_soak -m MODEL [-np 32] [-c 2048] [-t 2] [-C 32]
        [--duration 60] [--abort-fraction 0.2] [-n 128] [--rounds 2] [--every 2] [-- SERVE ARGS]

The server is `python -m runtime serve -m MODEL -np .. -c .. --metrics --port 0` on loopback,
a process of its own.  Before and after each round (once the server is idle) its /metrics give
the KV blocks used, cached and free and the requests by status; every --every seconds the
server process's RSS (/proc) and its blocks in use or cached.

Verdicts:
- **no 5xx**: no answer with a 5xx status (or an error event in its stream), no dropped
  connection, and none counted 5xx by the server;
- **aborts are real**: clients did close mid-answer, and the server counted each as a client
  that went away (status 499 in llamba_requests);
- **blocks back**: idle, no block is in use; the cached ones (kept for prefix reuse) are within
  the server's bound (--cache-ram: llamba_kv_blocks_cached_limit);
- **memory flat**: the server's RSS, idle after each round, less its KV blocks ever used
  (llamba_kv_blocks_touched x llamba_kv_block_bytes: the CPU's pool is mapped lazily, a block
  costs memory from its first use, and the blocks in use at once reach a new peak now and then
  as the prompts' timing varies; they stay within the pool the flags size) grows by at most
  --rss-slack MB after the first round (where the step plans, arenas and code fill).  The rounds
  send the same prompts in the same order; which answers are dropped differs.

The server runs without transparent huge pages (prctl PR_SET_THP_DISABLE) unless --thp: numpy
asks for them on large arrays, so a K or V array of the pool becomes resident 2 MB at a time,
and RSS rises in steps of 2 MB x (K and V arrays: 2 x layers) -- 120 MB on SmolLM2, each 341
blocks -- as the blocks ever used cross each huge page: the blocks' memory cannot be told from
the rest.  With 4 KB pages it follows the blocks.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace


def _no_thp() -> None:
    """In the child before exec: no transparent huge pages for this process (prctl
    PR_SET_THP_DISABLE, kept across exec)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)


def start_server(args: list[str], timeout: float = 600, env=None, thp: bool = True) -> tuple[subprocess.Popen, str]:
    """`python -m runtime serve ARGS --port 0` on loopback; (process, base URL) once it serves.
    thp=False: without transparent huge pages (Linux)."""
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--port", "0", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=None if thp else _no_thp)
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            # keep reading its stderr (a full pipe would block the server)
            threading.Thread(target=lambda: [lines.append(x) for x in proc.stderr], daemon=True).start()
            proc.log = lines
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("the server did not start:\n" + "".join(lines))


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def scrape(base: str) -> dict:
    """The server's /metrics: kv_used/cached/free, cached_limit, block_bytes, running, waiting,
    and requests by status ({"200": n, "499": n, ...}, both endpoints together)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out = {"requests": {}}
    text = httpx.get(base + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "llamba_kv_blocks":
                out["kv_" + s.labels["state"]] = int(s.value)
            elif s.name == "llamba_kv_blocks_cached_limit":
                out["cached_limit"] = int(s.value)
            elif s.name == "llamba_kv_blocks_touched":
                out["kv_touched"] = int(s.value)
            elif s.name == "llamba_kv_block_bytes":
                out["block_bytes"] = s.value
            elif s.name in ("llamba_requests_running", "llamba_requests_waiting"):
                out[s.name.removeprefix("llamba_requests_")] = int(s.value)
            elif s.name == "llamba_requests_total":
                st = s.labels["status"]
                out["requests"][st] = out["requests"].get(st, 0) + int(s.value)
    return out


class Sampler(threading.Thread):
    """The server's RSS and KV blocks ever used, every `every` seconds."""

    def __init__(self, base: str, pid: int, every: float):
        super().__init__(daemon=True)
        self.base, self.pid, self.every = base, pid, every
        self.samples: list[tuple[float, float, int]] = []      # (t, RSS MB, blocks ever used)
        self.halt = threading.Event()

    def run(self):
        t0 = time.monotonic()
        while not self.halt.is_set():
            try:
                m = scrape(self.base)
                self.samples.append((time.monotonic() - t0, rss_mb(self.pid), m["kv_touched"]))
            except Exception:       # a scrape that times out under load: the next one counts
                pass
            self.halt.wait(self.every)


def wait_idle(base: str, timeout: float = 120) -> dict:
    """Metrics once nothing runs or waits (a cancelled request is dropped at the next step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base)
        if (m["running"] == 0 and m["waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def soak_round(base: str, pid: int, clients: int, duration: float, abort_fraction: float, max_tokens: int,
               every: float = 2.0, seed: int = 0, requests: int = 4) -> dict:
    """One round of bench-serve's load (runtime/bench/serve.py) with the server's state around it.
    Every round sends the same prompts (bench-serve's seed 0, in the same order: the same load
    again); `seed` picks which answers are dropped, and when."""
    from runtime.bench.serve import _run_level, prompts, summarize
    args = SimpleNamespace(duration=duration, requests=requests, max_tokens=max_tokens, temperature=0.0,
                           abort_fraction=abort_fraction, seed=seed, timeout=600, model=None)
    texts = prompts(max(clients * requests, 8), 0)
    before = wait_idle(base)
    rss0 = rss_mb(pid)
    sampler = Sampler(base, pid, every)
    sampler.start()
    results, wall = asyncio.run(_run_level(base, {}, clients, args, texts))
    after = wait_idle(base)
    time.sleep(every)
    sampler.halt.set()
    sampler.join()
    row = summarize(results, wall, clients)
    rss = [s[1] for s in sampler.samples] or [rss0]
    served = {k: after["requests"].get(k, 0) - before["requests"].get(k, 0)
              for k in set(after["requests"]) | set(before["requests"])}
    return {"client": row, "before": before, "after": after, "server_statuses": served,
            "rss_start": rss0, "rss_end": rss_mb(pid), "rss_peak": max(rss), "rss_samples": sampler.samples}


def verdict(rounds: list[dict], rss_slack: float = 32.0) -> list[tuple[str, bool, str]]:
    out = []
    bad = {k: v for r in rounds for k, v in r["client"]["statuses"].items() if k not in ("200", "aborted")}
    five = sum(v for r in rounds for k, v in r["server_statuses"].items() if k.startswith("5"))
    out.append(("no 5xx", not bad and five == 0,
                f"client outcomes {_sum_statuses(rounds)}, server 5xx {five}"))
    aborted = sum(r["client"]["aborted"] for r in rounds)
    seen = sum(r["server_statuses"].get("499", 0) for r in rounds)
    out.append(("aborts are real", aborted > 0 and seen == aborted,
                f"clients closed {aborted} answers mid-stream, the server counted {seen} (499)"))
    backs = [r["after"]["kv_used"] == 0 and r["after"]["kv_cached"] <= r["after"]["cached_limit"] for r in rounds]
    last = rounds[-1]["after"]
    out.append(("blocks back", all(backs),
                f"idle after each round: used {[r['after']['kv_used'] for r in rounds]}, cached "
                f"{[r['after']['kv_cached'] for r in rounds]} (bound {last['cached_limit']}, kept for prefix reuse), "
                f"free {[r['after']['kv_free'] for r in rounds]} of "
                f"{last['kv_used'] + last['kv_cached'] + last['kv_free']}"))
    mb = last["block_bytes"] / 2**20
    kv = [r["after"]["kv_touched"] * mb for r in rounds]
    rest = [r["rss_end"] - k for r, k in zip(rounds, kv)]
    total = (last["kv_used"] + last["kv_cached"] + last["kv_free"]) * mb
    detail = (f"RSS idle after each round {[round(r['rss_end']) for r in rounds]} MB (from {rounds[0]['rss_start']:.0f}; "
              f"peaks {[round(r['rss_peak']) for r in rounds]}) = KV blocks ever used {[round(k) for k in kv]} "
              f"(of a {total:.0f} MB pool, mapped as used) + the rest {[round(x) for x in rest]}")
    if len(rounds) < 2:
        out.append(("memory flat", None, detail + "; one round: run --rounds 2 or more to judge"))
    else:
        out.append(("memory flat", max(rest[1:]) <= rest[0] + rss_slack,
                    detail + f" (later rounds within {rss_slack:.0f} MB of the first)"))
    return out


def _sum_statuses(rounds) -> dict:
    tot = {}
    for r in rounds:
        for k, v in r["client"]["statuses"].items():
            tot[k] = tot.get(k, 0) + v
    return tot


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-np", "--parallel", type=int, default=32)
    p.add_argument("-c", "--ctx", type=int, default=2048)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-C", "--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--abort-fraction", type=float, default=0.2)
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--every", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--rss-slack", type=float, default=32.0, metavar="MB")
    p.add_argument("--thp", action="store_true", help="leave transparent huge pages as the system has them")
    p.add_argument("serve_args", nargs="*", help="more `serve` arguments (after --)")
    a = p.parse_args(argv)
    proc, base = start_server(["-m", a.model, "-np", str(a.parallel), "-c", str(a.ctx), "-t", str(a.threads),
                               "--metrics", *a.serve_args], thp=a.thp)
    print(f"server pid {proc.pid} at {base}{'' if a.thp else ' (no transparent huge pages)'}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rounds = []
    try:
        for k in range(a.rounds):
            r = soak_round(base, proc.pid, a.clients, a.duration, a.abort_fraction, a.max_tokens, a.every, seed=k)
            rounds.append(r)
            c = r["client"]
            print(f"round {k + 1}: {c['wall_s']:.0f} s, {c['requests']} answers {c['statuses']}, "
                  f"{c['output_tok_s']:.1f} tok/s, TTFT p50 {c['ttft_p50_ms']:.0f} ms; server {r['server_statuses']}; "
                  f"idle after: KV used {r['after']['kv_used']} cached {r['after']['kv_cached']} "
                  f"free {r['after']['kv_free']}, ever used {r['after']['kv_touched']}; RSS {r['rss_start']:.0f} -> "
                  f"peak {r['rss_peak']:.0f} -> {r['rss_end']:.0f} MB; load average {os.getloadavg()[0]:.1f}",
                  flush=True)
            print("  RSS MB / KV blocks ever used, every %.0f s: %s" % (
                a.every, " ".join(f"{s[1]:.0f}/{s[2]}" for s in r["rss_samples"])), flush=True)
    finally:
        stop_server(proc)
    ok = True
    for name, good, detail in verdict(rounds, a.rss_slack):
        print(f"{name:16} {'PASS' if good else ('n/a' if good is None else 'FAIL')}  {detail}")
        ok &= good is not False
    errors = [line for line in getattr(proc, "log", []) if "Traceback" in line or "ERROR" in line]
    if errors:
        print(f"server log: {len(errors)} error lines, first: {errors[0].strip()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
