"""A short soak of the real server on loopback (lab.serve_soak's rounds, bounded for CI): 8
streaming clients for a few seconds, half of their answers dropped mid-stream by closing the
connection, twice.  No 5xx; the server sees every close (499); idle, no KV block is in use and the
cached ones stay within --cache-ram; the server's RSS less its KV blocks ever used (4 KB pages:
no transparent huge pages in the server) stays near the first round's.
The full goal (32 clients, 60 s, a fifth dropped): `PYTHONPATH=tests python -m lab.serve_soak`."""
from __future__ import annotations

import sys

import pytest

from lab.serve_soak import soak_round, start_server, stop_server, verdict

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the server's RSS is read from /proc")


def test_soak_with_clients_that_go_away(model_path):
    # --cache-ram 4 MiB: 11 SmolLM2 blocks may stay cached, so the bound is reached and checked
    proc, base = start_server(["-m", str(model_path("smollm2-135m")), "-np", "8", "-c", "1024", "-t", "2",
                               "--metrics", "--cache-ram", "4"], thp=False)
    try:
        rounds = [soak_round(base, proc.pid, clients=8, duration=3, abort_fraction=0.5, max_tokens=24, every=0.5,
                             seed=k, requests=2) for k in range(2)]
    finally:
        stop_server(proc)
    got = {name: (ok, detail) for name, ok, detail in verdict(rounds, rss_slack=32)}
    print(*(f"{k}: {ok} {d}" for k, (ok, d) in got.items()), sep="\n")
    for name in ("no 5xx", "aborts are real", "blocks back", "memory flat"):
        assert got[name][0], f"{name}: {got[name][1]}"
    assert rounds[-1]["after"]["cached_limit"] == 11
    assert all(r["client"]["completed"] > 0 for r in rounds)
