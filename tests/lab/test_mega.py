"""The decode megakernel (tests/lab/mega.cu) against the eager kernels it
replaces: the same logits bit for bit, on random models of the llama and qwen2
layouts (biases, tied output) in each quantization mix, at contexts of one to
several KV blocks and context splits; Q8_0 on sm_90+ through its bulk-copy ring."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SHAPES = {
    "llama": dict(arch="llama", n_layers=2, d_model=512, d_ff=1536, n_heads=8, n_kv_heads=2, vocab=1000,
                  tied=False, rope_theta=1e4),
    "qwen2": dict(arch="qwen2", n_layers=2, d_model=256, d_ff=768, n_heads=4, n_kv_heads=1, vocab=700,
                  tied=True, rope_theta=1e6),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from lab.synth import load_weights_only, write_random_gguf
    d = tmp_path_factory.mktemp("mega")
    out = {}
    for shape, spec in SHAPES.items():
        for mix in ("Q4_K_M", "Q4_0", "Q8_0"):
            p = write_random_gguf(d / f"{shape}-{mix}.gguf", mix=mix, seed=1, **spec)
            out[(shape, mix)] = load_weights_only(p)
    return out


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mega_equals_eager_kernels(models, shape, mix, monkeypatch):
    import quant.cuda as qc
    import lab.mega as cm
    from runtime.engine import Engine
    monkeypatch.setattr(cm, "ENABLED", True)        # opt-in (LLAMBA_CUDA_MEGA=1)
    monkeypatch.setattr(qc, "INT8_KERNEL", "mvs")   # the megakernel's sums are mvs's
    lm = models[(shape, mix)]
    mega, ref = Engine(lm, device="cuda", n_ctx=512), Engine(lm, device="cuda", n_ctx=512)
    ref.backend.use_mega = False
    rng = np.random.default_rng(7)
    for plen, n in ((1, 3), (37, 6), (150, 20)):     # 1 and 2 blocks of the graph's table; splits of 1-5 keys
        prompt = [int(t) for t in rng.integers(1, lm.config.vocab_size, plen)]
        a, b = mega.new_sequence(), ref.new_sequence()
        la, lb = mega.prefill(a, prompt), ref.prefill(b, prompt)
        assert np.array_equal(la, lb)
        for i in range(n):
            t = int(np.argmax(la))
            la, lb = mega.step([a], [[t]])[0], ref.step([b], [[t]])[0]
            assert np.all(np.isfinite(la))
            assert np.array_equal(la, lb), (plen, i, float(np.abs(la - lb).max()))
        mega.release(a)
        ref.release(b)
    assert cm.mega_reason(mega.backend, mega.model) is None, cm.mega_reason(mega.backend, mega.model)
    assert mega.backend.graph_replays > 0 and ref.backend.graph_replays > 0
    m = mega.backend._megas[id(mega.model)][1]
    assert m.runs > 0 and not m.failed()
    # Q8_0 weights on sm_90+ stream through the bulk-copy ring (in the chunk order mvs keeps for Q8_0)
    assert m.bulk == (mix == "Q8_0" and mega.backend.device_info["cc"] >= 90)
    assert ref.backend._megas.get(id(ref.model)) is None
