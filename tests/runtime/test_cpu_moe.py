"""--cpu-moe / --n-cpu-moe N (llama.cpp's names): what can be checked without a GPU.
The placement rule (which tensors stay in system memory), the memory each device needs
(`info`, check_fits' estimate), the flags on every command that loads a model, the
refusals, and the host side of the op (the CPU backend's experts from given router
logits: test_moe_fused.py).  The op itself, GPU router and CPU experts together, is
tests/gpu/test_cpu_moe_gpu.py."""
from __future__ import annotations

import json

import pytest

from runtime.backend.cuda_memory import CPU_MOE_ALL, estimate_bytes, experts_on_host, on_gpu, tensor_device_bytes
from runtime.cli import build_parser, main
from runtime.loader import load_model

N_LAYERS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    """A random-weight Qwen3-MoE of 3 layers (8 experts, 2 a token) and a dense Qwen3, both
    with SmolLM2's tokenizer so every command runs on them."""
    from lab.synth import write_random_gguf
    d = tmp_path_factory.mktemp("cpumoe")
    tok = model_path("smollm2-135m")
    shape = dict(n_layers=N_LAYERS, d_model=256, n_heads=4, n_kv_heads=2, vocab=49152, tied=True,
                 rope_theta=1e6, tokenizer_from=tok)
    moe = write_random_gguf(d / "moe.gguf", "qwen3moe", d_ff=0, n_experts=8, n_experts_used=2, d_ff_expert=256,
                            **shape)
    dense = write_random_gguf(d / "dense.gguf", "qwen3", d_ff=512, **shape)
    return moe, dense


def _expert_bytes(lm, layers):
    return sum(t.nbytes for n, t in lm.tensors.items()
               if n.endswith("_exps.weight") and int(n.split(".")[1]) in layers)


def test_placement_rule_is_llamacpps():
    # llama.cpp's LLM_FFN_EXPS_REGEX: \.ffn_(up|down|gate|gate_up)_(ch|)exps
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight",
                 "blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_down_chexps.weight", "blk.0.ffn_gate_exps.bias"):
        assert experts_on_host(name, CPU_MOE_ALL) and experts_on_host(name, 1), name
        assert not experts_on_host(name, 0) and not experts_on_host(name, None)
    # the router, shared parts and dense FFNs stay where the layer is
    for name in ("blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate.weight", "blk.0.attn_q.weight",
                 "blk.0.ffn_norm.weight", "token_embd.weight", "output.weight"):
        assert not experts_on_host(name, CPU_MOE_ALL), name
    # --n-cpu-moe N: the first N layers
    assert experts_on_host("blk.1.ffn_up_exps.weight", 2) and not experts_on_host("blk.2.ffn_up_exps.weight", 2)
    assert experts_on_host("blk.47.ffn_up_exps.weight", CPU_MOE_ALL)
    # with --gpu-layers too: layers past N on the CPU whole, the embedding on the host
    assert on_gpu("blk.0.attn_q.weight", 4, gpu_layers=2, cpu_moe=1)
    assert not on_gpu("blk.0.ffn_up_exps.weight", 4, gpu_layers=2, cpu_moe=1)
    assert on_gpu("blk.1.ffn_up_exps.weight", 4, gpu_layers=2, cpu_moe=1)
    assert not on_gpu("blk.2.attn_q.weight", 4, gpu_layers=2, cpu_moe=1)
    assert not on_gpu("token_embd.weight", 4, gpu_layers=4) and on_gpu("output.weight", 4, gpu_layers=4)
    assert on_gpu("token_embd.weight", 4) and on_gpu("output.weight", 4, gpu_layers=None, cpu_moe=CPU_MOE_ALL)


def test_memory_estimate_puts_the_experts_on_the_host(tiny):
    lm = load_model(tiny[0])
    cfg = lm.config
    every = estimate_bytes(cfg, lm.tensors, 512)
    all_host = estimate_bytes(cfg, lm.tensors, 512, cpu_moe=CPU_MOE_ALL)
    first = estimate_bytes(cfg, lm.tensors, 512, cpu_moe=1)
    experts = _expert_bytes(lm, range(N_LAYERS))
    assert experts > 0
    assert every["host_weights"] == 0
    assert every["weights"] == sum(tensor_device_bytes(t) for t in lm.tensors.values())
    # GPU bytes without the experts, host bytes with them (as stored: memory-mapped)
    assert all_host["weights"] == every["weights"] - experts and all_host["host_weights"] == experts
    assert first["host_weights"] == _expert_bytes(lm, [0]) and first["weights"] == every["weights"] - _expert_bytes(lm, [0])
    # the KV cache stays on the GPU; the experts' gathered rows leave its work buffers
    assert all_host["kv_cache"] == every["kv_cache"] and all_host["work"] < every["work"] == first["work"]
    assert all_host["total"] == all_host["weights"] + all_host["kv_cache"] + all_host["work"]
    # --n-cpu-moe N past the layers: every layer's
    assert estimate_bytes(cfg, lm.tensors, 512, cpu_moe=99) == all_host
    # with --gpu-layers 2 as well: layer 2 and the embedding on the CPU whole, layer 0's experts
    split = estimate_bytes(cfg, lm.tensors, 512, gpu_layers=2, cpu_moe=1)
    on_host = [n for n in lm.tensors if not on_gpu(n, N_LAYERS, 2, 1)]
    assert "token_embd.weight" in on_host and "blk.0.ffn_gate_exps.weight" in on_host
    assert "blk.1.ffn_gate_exps.weight" not in on_host and "blk.2.attn_q.weight" in on_host
    assert split["host_weights"] == sum(lm.tensors[n].nbytes for n in on_host)


def test_info_shows_each_devices_memory(tiny, capsys):
    lm = load_model(tiny[0])
    experts = _expert_bytes(lm, range(N_LAYERS))

    def info(*flags):
        assert main(["info", str(tiny[0]), "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["gpu_memory_estimate"]

    plain, all_host, two = info(), info("--cpu-moe"), info("--n-cpu-moe", "2")
    assert "cpu_moe_layers" not in plain and plain["host_weights"] == 0
    assert all_host["cpu_moe_layers"] == N_LAYERS and all_host["host_weights"] == experts
    assert all_host["weights"] == plain["weights"] - experts
    assert two["cpu_moe_layers"] == 2 and two["host_weights"] == _expert_bytes(lm, [0, 1])
    assert info("-cmoe") == all_host and info("-ncmoe", "2") == two      # llama.cpp's short names
    # a dense model: nothing to keep on the host, and it says so
    assert main(["info", str(tiny[1]), "--json", "--cpu-moe"]) == 0
    out = capsys.readouterr()
    est = json.loads(out.out)["gpu_memory_estimate"]
    assert est["host_weights"] == 0 and "cpu_moe_layers" not in est
    assert "no experts" in out.err and "no effect" in out.err


@pytest.mark.parametrize("cmd", ["generate", "chat", "bench", "perplexity", "serve"])
def test_every_command_that_loads_a_model_takes_the_flags(cmd):
    p = build_parser()
    extra = {"generate": ["-p", "x"], "perplexity": ["-f", "x"]}.get(cmd, [])
    assert p.parse_args([cmd, *extra]).n_cpu_moe == 0
    assert p.parse_args([cmd, *extra, "--cpu-moe"]).n_cpu_moe == CPU_MOE_ALL
    assert p.parse_args([cmd, *extra, "-cmoe"]).n_cpu_moe == CPU_MOE_ALL
    assert p.parse_args([cmd, *extra, "--n-cpu-moe", "5"]).n_cpu_moe == 5
    assert p.parse_args([cmd, *extra, "-ncmoe", "0"]).n_cpu_moe == 0
    for bad in (["--n-cpu-moe", "-1"], ["--cpu-moe", "--n-cpu-moe", "2"]):
        with pytest.raises(SystemExit):
            p.parse_args([cmd, *extra, *bad])


def test_device_cpu_refuses(tiny, capsys):
    """On --device cpu every expert already runs on the CPU: the flag is a mistake, said so."""
    assert main(["generate", "-m", str(tiny[0]), "-p", "hi", "-n", "1", "--device", "cpu", "--cpu-moe"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--cpu-moe" in err and "--device cuda or auto" in err and "\n" not in err
    # the server says so before it starts
    assert main(["serve", "-m", str(tiny[0]), "--n-cpu-moe", "2", "--port", "0"]) == 1
    assert "--device cuda or auto" in capsys.readouterr().err


def test_device_auto_without_a_gpu_runs_on_the_cpu_and_says_so(tiny):
    from runtime.backend import DeviceUnavailable
    from runtime.backend.cuda import probe
    try:
        probe()
        pytest.skip("a GPU is here: tests/gpu/test_cpu_moe_gpu.py")
    except DeviceUnavailable:
        pass
    from runtime.engine import Engine
    said = []
    eng = Engine(str(tiny[0]), device="auto", n_ctx=128, cpu_moe=CPU_MOE_ALL, announce=said.append)
    assert eng.backend.name == "cpu"
    assert any("--cpu-moe" in s for s in said)
    seq = eng.new_sequence()
    assert eng.prefill(seq, [1, 2, 3]).shape == (eng.config.vocab_size,)
    said.clear()
    Engine(str(tiny[1]), device="auto", n_ctx=128, cpu_moe=2, announce=said.append)
    assert any("no experts" in s for s in said)


def test_host_experts_keep_the_tensors_as_the_cpu_backend_does(tiny):
    """The CUDA backend's host half (cuda_host_moe.HostExperts) without its GPU: which
    tensors it takes, and that they stay the file's blocks in system memory, in the CPU
    backend's expert lists (the lists its moe op recognizes as its own)."""
    from types import SimpleNamespace

    from runtime.backend.cuda_host_moe import HostExperts
    lm = load_model(tiny[0])
    h = HostExperts(None, 2)
    taken = [n for n in lm.tensors if h.holds(n)]
    assert sorted(taken) == sorted(n for n in lm.tensors if n.endswith("_exps.weight") and n[4] in "01")
    ups = h.upload(lm.tensors["blk.0.ffn_up_exps.weight"])
    assert h.owns((ups,)) and len(ups) == 8 and ups[0].qtype == lm.tensors["blk.0.ffn_up_exps.weight"].qtype
    assert bytes(ups.whole.data) == bytes(lm.tensors["blk.0.ffn_up_exps.weight"].data)
    assert h.weight_bytes == lm.tensors["blk.0.ffn_up_exps.weight"].nbytes and h.layers == {0}
    assert not h.owns(([SimpleNamespace()],))        # device experts are the GPU backend's
    assert h.describe(lm.config) == f"the experts of layers 0-1 on the CPU ({h.cpu.threads} threads)"
    assert HostExperts(None, CPU_MOE_ALL).describe(lm.config).startswith("the experts of every layer")
