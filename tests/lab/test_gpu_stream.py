"""The streaming probe (tests/lab/gpu_stream.py) reads exactly a decode step's weight
bytes: its ops, summed, equal the matrices of a random-weight model of the same shape and
mix as the loader sees them (the probe itself needs a GPU: tests/gpu does not run it)."""
from __future__ import annotations

import pytest

from lab import synth as cuda_synth
from lab.gpu_stream import step_ops

TINY = dict(arch="llama", n_layers=8, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, vocab=512,
            rope_theta=1e4)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0"])
def test_step_ops_are_the_models_matrices(tmp_path, monkeypatch, mix, tied):
    shape = dict(TINY, tied=tied)
    monkeypatch.setitem(cuda_synth.SHAPES, "TINY", shape)
    path = cuda_synth.write_random_gguf(tmp_path / "t.gguf", mix=mix, **shape)
    lm = cuda_synth.load_weights_only(path)
    per_token = {n: t.nbytes for n, t in lm.tensors.items() if len(t.shape) == 2}
    if not tied:
        del per_token["token_embd.weight"]      # looked up, not read whole
    ops = step_ops("TINY", mix, ctx=64, attention=False)
    assert [name for name, _, _ in ops[:4]] == ["qkv", "o", "gate/up", "down"]
    assert len(ops) == 4 * TINY["n_layers"] + 1
    assert sum(b for _, b, _ in ops) == sum(per_token.values())
    # Q4_K_M's mix shows in the ops: layer 0's down is Q6_K, layer 1's Q4_K (Q6_K's rows are bigger)
    downs = [b for name, b, _ in ops if name == "down"]
    assert (downs[0] > downs[1]) == (mix == "Q4_K_M")
    with_attention = step_ops("TINY", mix, ctx=64)
    kv = TINY["n_kv_heads"] * TINY["d_model"] // TINY["n_heads"]
    assert [b for name, b, _ in with_attention if name == "attention"] == [2 * 2 * 64 * kv] * TINY["n_layers"]


def test_dataflow_waits_only_where_an_op_needs_all_of_its_input(monkeypatch):
    from lab.gpu_stream import deps
    monkeypatch.setitem(cuda_synth.SHAPES, "TINY", dict(TINY, tied=False))
    ops = step_ops("TINY", "Q8_0", ctx=64)
    names = [name for name, _, _ in ops]
    assert names[:7] == ["qkv", "attention", "merge", "o", "gate/up", "down", "qkv"]
    barrier, segments = (list(deps(ops, k)) for k in ("barrier", "segments"))
    assert barrier == [0] + [1] * (len(ops) - 1)
    # two all-to-all waits a layer (q/k/v after the residual, gate/up after o), and the output
    assert segments[:7] == [0, 0, 0, 0, 1, 0, 1] and segments[-1] == 1
    assert sum(segments) == 2 * TINY["n_layers"]


def test_timeline_table_sums_each_op_over_the_layers():
    from lab.gpu_stream import timeline_table
    ops = [("qkv", 1000, 0), ("o", 500, 0), ("qkv", 1000, 0), ("o", 500, 0)]
    # (median start, median finish, last finish), ns; 1 GB/s makes 1000 bytes 1 us
    tl = [(0, 1000, 1200), (1300, 2000, 2100), (2600, 3600, 3700), (3800, 4000, 4500)]
    lines = timeline_table(ops, tl, 1e9).splitlines()
    assert lines[2] == "| qkv | 0.5 | 2.0 | 0.3 | 2.0 |"          # gaps 0 + 0.5 (2600 - 2100)
    assert lines[3] == "| o | 0.2 | 0.9 | 0.6 | 1.0 |"
    assert lines[-1] == "(step: 4.5 us)"
