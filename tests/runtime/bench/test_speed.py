"""`python -m runtime bench`: llama-bench-style rows, and the side-by-side
ratio against a peer (llama.cpp) measured in interleaved repetitions."""
from __future__ import annotations

import json
import stat
import sys

from runtime.cli import main


def _bench(capsys, *args):
    assert main(["bench", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_rows(model_path, capsys):
    rows = _bench(capsys, "-m", str(model_path("smollm2-135m")), "-p", "32", "-n", "8", "-r", "2", "-t", "2")
    by = {r["test"]: r for r in rows}
    assert set(by) == {"pp32", "tg8"}
    for r in rows:
        assert r["t_s"] > 0 and r["sd"] >= 0 and r["backend"] == "cpu" and r["threads"] == 2
    # a decode step reads every weight: bytes per token are the model's (tied output)
    assert by["tg8"]["weight_bytes_per_token"] == by["tg8"]["size_bytes"]
    assert by["tg8"]["weight_GB_per_s"] > 0


def test_bench_peer_interleaved(model_path, tmp_path, capsys):
    """The peer runs once per repetition (its own process each time) and the
    reported ratio is the median of the per-repetition ratios.  The stand-in peer
    (the real one needs a llama-cpp-python venv) logs each call and reports a
    fixed speed."""
    log = tmp_path / "calls"
    peer = tmp_path / "peer-python"
    peer.write_text(f"""#!{sys.executable}
import json, sys
a = sys.argv
open({str(log)!r}, "a").write(" ".join(a[2:]) + "\\n")
p, n = a[a.index("-p") + 1], a[a.index("-n") + 1]
print(json.dumps([{{"test": "pp" + p, "t_s": 1.0, "sd": 0.0, "backend": "peer"}},
                  {{"test": "tg" + n, "t_s": 2.0, "sd": 0.0, "backend": "peer"}}]))
""")
    peer.chmod(peer.stat().st_mode | stat.S_IEXEC)
    rows = _bench(capsys, "-m", str(model_path("smollm2-135m")), "-p", "32", "-n", "8", "-r", "3", "-t", "2",
                  "--peer", str(peer))
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and all("-r 1" in c for c in calls)
    ours = {r["test"]: r for r in rows if r["backend"] == "cpu"}
    theirs = {r["test"]: r for r in rows if r["backend"] == "peer"}
    assert set(ours) == set(theirs) == {"pp32", "tg8"}
    for name, speed in (("pp32", 1.0), ("tg8", 2.0)):
        assert theirs[name]["runs"] == [speed] * 3
        assert len(ours[name]["runs"]) == 3
        ratios = sorted(r / speed for r in ours[name]["runs"])
        assert abs(theirs[name]["ratio_ours_to_peer_median"] - ratios[1]) < 1e-9


def test_warm_up_runs_until_no_run_pays_a_one_time_cost():
    """A CUDA prompt chunk's first run is eager, its second captures a graph: both count as
    setup events, so the timed runs start at the third (and a plain step warms up once)."""
    from runtime.bench.speed import timed_runs

    class Eng:
        setup_events = 0

    eng, calls = Eng(), []

    def run():                      # the first two runs pay a one-time cost, as a prompt chunk does
        calls.append(len(calls))
        if len(calls) <= 2:
            eng.setup_events += 1
        return float(len(calls))

    assert timed_runs(run, 2, eng) == [4.0, 5.0]
    calls.clear()
    assert timed_runs(lambda: float(calls.append(0) or len(calls)), 2, Eng()) == [2.0, 3.0]
    calls.clear()
    assert timed_runs(lambda: float(calls.append(0) or len(calls)), 2) == [2.0, 3.0]
