"""`python -m quant`: checkpoint -> GGUF.  The file must load back to exactly what
quantizing on load gives, carry llama.cpp's metadata, and never be left half
written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ckpt_helpers import PROMPT, engine_logits
from quant.convert import convert
from runtime.gguf_file import GGUFFile
from runtime.loader import load_model

PEER_PYTHON = Path(os.environ.get("LLAMBA_PEER_PYTHON", "/work/peer-venv/bin/python"))


@pytest.fixture(scope="module")
def smollm_q4km(smollm_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "smollm2-q4_k_m.gguf"
    stats = convert(smollm_ckpt, out, "q4_k_m", progress=False)
    return out, stats


def test_gguf_round_trips_to_quantize_on_load(smollm_ckpt, smollm_q4km):
    path, stats = smollm_q4km
    assert stats["bytes"] == path.stat().st_size and stats["mb_per_s"] > 0
    on_load = load_model(smollm_ckpt, quant="int4")
    from_file = load_model(path)
    assert from_file.config.arch == on_load.config.arch == "llama"
    assert set(from_file.tensors) == set(on_load.tensors)
    for name, t in on_load.tensors.items():
        u = from_file.tensors[name]
        assert (u.qtype, u.shape) == (t.qtype, t.shape), name
        assert np.array_equal(u.data, t.data), name
    ids = on_load.tokenizer.encode(PROMPT)
    assert from_file.tokenizer.encode(PROMPT) == ids
    assert np.array_equal(engine_logits(from_file, ids), engine_logits(on_load, ids))


def test_gguf_metadata_is_what_llama_cpp_reads(smollm_ckpt, smollm_q4km):
    md = GGUFFile(smollm_q4km[0]).metadata
    assert md["general.architecture"] == "llama"
    assert md["general.file_type"] == 15                       # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert md["llama.block_count"] == 30 and md["llama.attention.head_count_kv"] == 3
    assert md["llama.rope.dimension_count"] == 64 and md["llama.rope.freq_base"] == 100000.0
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt-2"
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and len(md["tokenizer.ggml.merges"]) > 40000
    assert md["tokenizer.chat_template"] == (smollm_ckpt / "chat_template.jinja").read_text()
    assert md["tokenizer.ggml.eos_token_id"] == 2


def test_interrupted_conversion_leaves_no_file(smollm_ckpt, tmp_path, monkeypatch):
    from runtime.safetensors_loader import Checkpoint
    real = Checkpoint.tensor
    calls = []

    def interrupted(self, name, qtype):
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(self, name, qtype)

    monkeypatch.setattr(Checkpoint, "tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(smollm_ckpt, tmp_path / "out.gguf", "q8_0", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_cli_reports_a_bad_source(tmp_path):
    r = subprocess.run([sys.executable, "-m", "quant", str(tmp_path), "-o", str(tmp_path / "x.gguf")],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 1 and "no config.json" in r.stderr
    assert not (tmp_path / "x.gguf").exists()


_PEER_SCRIPT = """
import sys, llama_cpp
m = llama_cpp.Llama(sys.argv[1], n_ctx=128, verbose=False)
out = m("The capital of France is", max_tokens=6, temperature=0)
print(repr(out["choices"][0]["text"]), m.metadata.get("tokenizer.chat_template") is not None)
"""


def _peer(path) -> subprocess.CompletedProcess:
    return subprocess.run([str(PEER_PYTHON), "-c", _PEER_SCRIPT, str(path)], capture_output=True, text=True,
                          timeout=300)


def test_llama_cpp_loads_and_generates(smollm_q4km, model_path):
    if not PEER_PYTHON.exists():
        pytest.skip(f"no llama-cpp-python peer at {PEER_PYTHON}")
    probe = _peer(model_path("smollm2-135m"))
    if probe.returncode != 0:
        pytest.skip(f"the llama-cpp-python peer cannot run even the catalog GGUF here (exit {probe.returncode})")
    r = _peer(smollm_q4km[0])
    assert r.returncode == 0, r.stderr
    text, has_template = r.stdout.strip().rsplit(" ", 1)
    assert len(text) > 3 and has_template == "True"
