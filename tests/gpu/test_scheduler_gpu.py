"""The scheduler on the GPU: sequences decoded together (forwards of up to exact_rows rows,
several sequences a step) give each request the greedy tokens it gets alone."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_env import model_files

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", model_files(), ids=lambda p: p.stem)
def test_batched_requests_equal_solo_on_gpu(path):
    from lab.synth import load_weights_only
    from runtime.engine import Engine
    from runtime.generate import Generation
    from runtime.sampling import SamplingParams
    from runtime.scheduler import Request, Scheduler
    eng = Engine(load_weights_only(path), device="cuda", n_ctx=512, cache_blocks=512)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, eng.config.vocab_size, n)] for n in (3, 9, 17, 40, 5, 120, 2, 30,
                                                                                     11, 64, 7, 25)]
    greedy = SamplingParams(temperature=0)
    solo = []
    for p in prompts:
        g = Generation(eng, p, greedy, max_tokens=16).run()
        solo.append(g.ids)
        eng.release(g.seq, keep_cached=False)
    sch = Scheduler(eng, max_running=12, prefix_cache=False)
    reqs = [sch.submit(Request(p, greedy, max_tokens=16)) for p in prompts]
    sch.run_until_idle()
    assert [r.output for r in reqs] == solo
    assert sch.stats.forwards < sum(len(r.output) for r in reqs)
    assert eng.stats()["blocks_used"] == 0
