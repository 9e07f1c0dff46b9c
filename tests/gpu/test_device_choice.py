"""--device cuda / auto: a usable GPU or a clear one-line reason; never a silent fallback.
Runs everywhere (no `gpu` marker): on a machine without a GPU it checks the refusal."""
from __future__ import annotations

import pytest

from runtime.backend import DeviceUnavailable, make_backend

from gpu_env import NO_GPU


def test_cuda_refuses_in_one_line_or_gives_the_gpu():
    if NO_GPU:
        with pytest.raises(DeviceUnavailable) as e:
            make_backend("cuda")
        msg = str(e.value)
        assert msg and "\n" not in msg
        assert any(w in msg for w in ("CuPy", "driver", "GPU", "compute capability"))
    else:
        assert make_backend("cuda").name == "cuda"


def test_auto_says_which_device_it_took():
    said = []
    b = make_backend("auto", announce=said.append)
    if NO_GPU:
        assert b.name == "cpu"
        assert said and "CPU" in said[0]
    else:
        assert b.name == "cuda"


def test_memory_estimate_needs_no_gpu():
    from models import ModelConfig
    from runtime.backend.cuda_memory import estimate_bytes, kv_cache_bytes
    cfg = ModelConfig(arch="llama", n_layers=32, d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8,
                      head_dim=128, vocab_size=128256, context_length=8192, rms_eps=1e-5,
                      rope_theta=5e5, rope_neox=False)
    # 4096 tokens of f16 K and V over 32 layers of 8 x 128: 128 KiB a token, two blocks a slot
    assert kv_cache_bytes(cfg, 4096) == 2 * 4096 * 32 * 2 * 8 * 128 * 2

    class T:
        def __init__(self, shape, nbytes):
            self.shape, self.nbytes = shape, nbytes
    est = estimate_bytes(cfg, {"w": T((4096, 4096), 1000), "n": T((4096,), 8192)}, 4096)
    assert est["weights"] == 1000 + 4 * 4096
    assert est["total"] == est["weights"] + est["kv_cache"] + est["work"]
