"""warm_up reaches every kernel path a chat can take, so no Numba compilation or
cache load (both hold the GIL and freeze the app's event loop) happens inside an
answer."""
from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys
from numba.core.dispatcher import Dispatcher
from runtime.engine import Engine
from runtime.warmup import warm_up

def specializations():
    # every Numba kernel of ours, with how many type signatures it holds (compiled
    # in this process or loaded from the disk cache)
    return {f"{m.__name__}.{k}": len(v.overloads) for m in list(sys.modules.values())
            if m and m.__name__.split(".")[0] in ("quant", "runtime", "models")
            for k, v in vars(m).items() if isinstance(v, Dispatcher)}

engine = Engine(sys.argv[1], n_ctx=512)
warm_up(engine, force=True)
st = engine.stats()
before = specializations()

seq = engine.new_sequence()
for n in (29, 3, 1, 1, 16, 100, 1):   # a short chat prompt, a follow-up, decode, a long prompt
    engine.step([seq], [[(13 * (len(seq) + i)) % 1000 + 5 for i in range(n)]])
after = specializations()
late = sorted(k for k, n in after.items() if n > before.get(k, 0))
print(json.dumps({"kernels": sum(after.values()), "late": late, "cached": st["blocks_cached"], "used": st["blocks_used"]}))
"""


def test_no_compilation_after_warm_up(model_path):
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_path("smollm2-135m"))],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["kernels"] > 10            # the probe sees the kernels at all
    assert res["late"] == [], f"compiled or loaded after warm-up: {res['late']}"
    # the throwaway tokens left nothing behind in the cache
    assert res["cached"] == 0 and res["used"] == 0


def test_marker_per_weight_types(model_path, tmp_path, monkeypatch):
    """A model whose weight types were never warmed (e.g. a Q5_0 draft after a
    Q4_K_M target) gets a warm-up of its own; the same model does not twice."""
    from runtime.engine import Engine
    from runtime import warmup
    monkeypatch.setattr(warmup.platformdirs, "user_cache_dir", lambda *a, **k: str(tmp_path))
    a = Engine(str(model_path("smollm2-135m")), n_ctx=64)      # Q4_1
    b = Engine(str(model_path("gemma3-270m")), n_ctx=64)       # Q4_K / Q6_K / Q8_0 ...
    assert warmup._marker(a) != warmup._marker(b)
    assert warmup.first_run(a) and warmup.first_run(b)
    assert warmup.warm_up(a) > 0
    assert not warmup.first_run(a) and warmup.first_run(b)
    assert warmup.warm_up(a) == 0.0                            # done once


def test_cleared_kernel_cache_warms_up_again(model_path, tmp_path, monkeypatch):
    """A marker whose kernel cache was deleted since does not skip the warm-up:
    otherwise everything would compile inside the first answer."""
    from runtime.engine import Engine
    from runtime import warmup
    path = str(model_path("smollm2-135m"))      # before the cache dir is redirected: the model is not a marker
    monkeypatch.setattr(warmup.platformdirs, "user_cache_dir", lambda *a, **k: str(tmp_path / "markers"))
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    e = Engine(path, n_ctx=64)
    m = warmup._marker(e)
    m.parent.mkdir(parents=True)
    m.touch()
    assert warmup.first_run(e)                     # a marker, but no compiled kernels there
    (cache / "some" / "dir").mkdir(parents=True)
    (cache / "some" / "dir" / "k.nbi").touch()
    assert not warmup.first_run(e)


def test_second_checkout_warms_up_on_its_own(model_path, tmp_path, monkeypatch):
    """Two checkouts of the same sources share a kernel folder (it is named by the sources'
    hash) but none of its kernels (Numba files them by source path): the second must not
    take the first one's marker, or its first answer compiles everything (0.7 t/s seen)."""
    from runtime.engine import Engine
    from runtime import warmup
    import quant.kernel_cache as kc
    monkeypatch.setattr(warmup.platformdirs, "user_cache_dir", lambda *a, **k: str(tmp_path))
    e = Engine(str(model_path("smollm2-135m")), n_ctx=64)
    here = warmup._marker(e)
    monkeypatch.setattr(kc, "HOME", tmp_path / "another" / "checkout")
    assert warmup._marker(e) != here
