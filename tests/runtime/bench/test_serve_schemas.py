"""`bench-serve --schemas`: structured output through any OpenAI-compatible URL, here our own
server on loopback with SmolLM2 (a few schemas; the same URL twice stands in for two servers)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from runtime.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from test_server import _start, _stop  # noqa: E402


def test_bench_serve_schemas(model_path, capsys):
    proc, base = _start(["-m", str(model_path("smollm2-135m")), "-c", "2048", "-np", "1", "-t", "2"])
    try:
        assert main(["bench-serve", base, base + "/v1", "--schemas", "--only", "person,tags,enum_status",
                     "--labels", "a,b", "-n", "64", "--json"]) == 0
    finally:
        _stop(proc)
    out = json.loads(capsys.readouterr().out)
    assert out["schemas"] == 3 and out["labels"] == ["a", "b"]
    reqs = out["requests"]
    assert len(reqs) == 2 * 3 * 2                          # servers x schemas x (constrained, plain)
    assert [r["server"] for r in reqs[:4]] == ["a", "b", "a", "b"]      # they take turns request by request
    assert [(r["schema"], r["mode"]) for r in reqs[:4:2]] == [("person", "constrained"), ("person", "plain")]
    for r in reqs:
        assert r["status"] == 200 and r["tokens"] > 0 and r["ttft_s"] > 0
    for r in reqs:
        if r["mode"] == "constrained":
            assert r["valid"], r
            assert r["finish"] == "stop"
    by = {(s["server"], s["mode"]): s for s in out["summary"]}
    assert set(by) == {("a", "constrained"), ("a", "plain"), ("b", "constrained"), ("b", "plain")}
    for s in by.values():
        assert s["requests"] == 3 and s["decode_tok_s_p50"] > 0
    assert by["a", "constrained"]["valid_pct"] == 100.0
    assert by["b", "constrained"]["first_to_this_ratio"] > 0
