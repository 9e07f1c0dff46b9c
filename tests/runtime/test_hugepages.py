"""Weights copied into huge-page memory are byte for byte the file's, and the
model computes the same logits from them as from the file mapping."""
import numpy as np
import pytest

from runtime.backend import hugepages
from runtime.backend.hugepages import HUGE, HugePageArena


def test_arena_copies_exactly_and_aligned():
    rng = np.random.default_rng(0)
    arena = HugePageArena()
    arena.budget = 1 << 30
    srcs = [rng.integers(0, 256, size=s, dtype=np.uint8) for s in [(300, 144), (7, 210), (5000, 864)]]
    outs = [arena.place(a) for a in srcs]
    for a, b in zip(srcs, outs):
        assert b is not None and b.shape == a.shape and np.array_equal(a, b)
        assert b.ctypes.data % 64 == 0 and not np.shares_memory(a, b)
    assert outs[0].ctypes.data % HUGE == 0          # the mapping's usable range starts 2 MiB-aligned
    assert arena.copied == sum(a.nbytes for a in srcs)


def test_arena_respects_budget():
    arena = HugePageArena()
    arena.budget = 1000
    assert arena.place(np.zeros(600, np.uint8)) is not None
    assert arena.place(np.zeros(600, np.uint8)) is None      # over budget: the caller keeps the mapping
    assert arena.copied == 600


@pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages here")
def test_untied_embedding_stays_mapped(model_path):
    """A model with its own output layer reads one embedding row a token: not copied."""
    from runtime.engine import Engine
    e = Engine(str(model_path("qwen2.5-coder-0.5b")), threads=2, n_ctx=64)
    assert "output.weight" in e.loaded.tensors
    assert np.shares_memory(e.model.tok_embd.data, e.loaded.tensors["token_embd.weight"].data)
    assert not np.shares_memory(e.model.output.data, e.loaded.tensors["output.weight"].data)


def test_switch_off(monkeypatch):
    monkeypatch.setenv("LLAMBA_HUGEPAGES", "0")
    assert not hugepages.available()


@pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages here")
def test_model_on_hugepages_same_logits(model_path, monkeypatch):
    from runtime.engine import Engine
    ids = list(range(200, 240))
    logits = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("LLAMBA_HUGEPAGES", flag)
        e = Engine(str(model_path("smollm2-135m")), threads=2, n_ctx=256)
        s = e.new_sequence()
        logits[flag] = e.step([s], [ids])[0]
        w = e.model.layers[0]["ffn_up"]
        assert (e.backend.hugepages is not None) == (flag == "1")
        if flag == "1":
            assert e.backend.hugepages.copied > 0
            assert not np.shares_memory(w.data, e.loaded.tensors[w.name].data)
            # SmolLM2's embedding table is its output layer too: streamed, so copied
            assert "output.weight" not in e.loaded.tensors
            assert not np.shares_memory(e.model.tok_embd.data, e.loaded.tensors["token_embd.weight"].data)
    np.testing.assert_array_equal(logits["0"], logits["1"])
