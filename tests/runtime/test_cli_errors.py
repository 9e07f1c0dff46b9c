"""Errors a user can act on: one line on stderr, a non-zero exit, no traceback."""
from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from runtime.gguf_file import GGUFFile


def _run(*args):
    return subprocess.run([sys.executable, "-m", "runtime", *args], capture_output=True, text=True, timeout=120)


def _assert_clean_error(res, *words):
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for w in words:
        assert w in lines[0], lines[0]


def _patched_copy(src, dst, edit):
    data = bytearray(src.read_bytes())
    edit(data)
    dst.write_bytes(bytes(data))
    return dst


def test_missing_file(tmp_path):
    _assert_clean_error(_run("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"), "not found")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am a text file pretending to be a model\n" * 10)
    _assert_clean_error(_run("generate", "-m", str(p), "-p", "hi"), "not a GGUF")


def test_truncated(tmp_path, model_path):
    src = model_path("smollm2-135m")
    p = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        p.write_bytes(f.read(40_000_000))
    _assert_clean_error(_run("generate", "-m", str(p), "-p", "hi"), "truncated")


def test_unsupported_architecture(tmp_path, model_path):
    src = model_path("smollm2-135m")

    def edit(data):
        i = data.find(b"general.architecture")
        j = data.find(b"llama", i)
        data[j:j + 5] = b"mamba"
    p = _patched_copy(src, tmp_path / "arch.gguf", edit)
    _assert_clean_error(_run("generate", "-m", str(p), "-p", "hi"), "architecture", "mamba")


def test_unsupported_quant_type(tmp_path, model_path):
    src = model_path("smollm2-135m")
    g = GGUFFile(src)
    name = b"blk.0.attn_norm.weight"
    del g

    def edit(data):
        # the tensor-info record: name, n_dims (u32), dims (u64 each), type (u32): F32 -> I32,
        # which has the same 4-byte size, so the file stays consistent
        i = data.find(struct.pack("<Q", len(name)) + name) + 8 + len(name)
        ndims = struct.unpack_from("<I", data, i)[0]
        t = i + 4 + 8 * ndims
        assert struct.unpack_from("<I", data, t)[0] == 0
        struct.pack_into("<I", data, t, 26)
    p = _patched_copy(src, tmp_path / "qtype.gguf", edit)
    _assert_clean_error(_run("generate", "-m", str(p), "-p", "hi"), "I32", "blk.0.attn_norm.weight")


def test_unknown_catalog_name():
    _assert_clean_error(_run("info", "no-such-model"), "not found")


@pytest.mark.parametrize("cmd", [["info"], ["tokenize", "Hello"]])
def test_default_model_commands_work(cmd):
    res = _run(*cmd)
    assert res.returncode == 0, res.stderr


def test_info_kv_bytes_follow_the_cache_type(model_path, capsys):
    """info's KV bytes a token and GPU estimate are for the cache type asked (k16v8: 49/64 of f16)."""
    import json
    from runtime.cli import main
    got = {}
    for ct in ("f16", "k16v8", "q8_0"):
        assert main(["info", str(model_path("smollm2-135m")), "--cache-type", ct, "--json"]) == 0
        got[ct] = json.loads(capsys.readouterr().out)
    assert got["k16v8"]["kv_bytes_per_token"] * 64 == got["f16"]["kv_bytes_per_token"] * 49
    assert got["q8_0"]["kv_bytes_per_token"] * 64 == got["f16"]["kv_bytes_per_token"] * 34
    assert got["q8_0"]["gpu_memory_estimate"]["kv_cache"] < got["f16"]["gpu_memory_estimate"]["kv_cache"]
