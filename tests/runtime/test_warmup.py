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
