"""Prompt chunks of PROMPT_GRAPH_ROWS tokens replayed from CUDA graphs (cuBLAS GEMMs and
the tensor-core prompt attention captured with the rest) give the logits of the same
chunks run eagerly, at every block-table width, and after the fp16 tiles have grown."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_env import model_files

pytestmark = pytest.mark.gpu

MODELS = model_files()


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_prompt_chunks_from_graphs_equal_eager(path):
    import runtime.backend.cuda as CB
    from lab.synth import load_weights_only
    from runtime.engine import Engine
    lm = load_weights_only(path)
    n_ctx = min(2304, lm.config.context_length)
    rows = CB.PROMPT_GRAPH_ROWS
    graphs = Engine(lm, device="cuda", n_ctx=n_ctx)
    eager = Engine(lm, device="cuda", n_ctx=n_ctx)
    eager.backend.use_graphs = False
    rng = np.random.default_rng(7)
    vocab = lm.config.vocab_size
    chunks = n_ctx // rows
    for round_ in range(2):              # round 0: warm-up eager, then captures; round 1: replays
        ids = [int(t) for t in rng.integers(0, vocab, chunks * rows + 37)]
        sg, se = graphs.new_sequence(), eager.new_sequence()
        replays0 = graphs.backend.graph_replays
        for i in range(0, len(ids), rows):
            got = graphs.step([sg], [ids[i:i + rows]])
            ref = eager.step([se], [ids[i:i + rows]])
            rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            assert rel < 1e-5 and int(np.argmax(got)) == int(np.argmax(ref)), (round_, i, rel)
        assert graphs.backend.prompt_graph_error is None
        if round_ == 0:                  # the first chunk ran eagerly, the others were captured
            assert graphs.backend.graph_replays - replays0 == chunks - 1
        else:                            # every full chunk replayed
            assert graphs.backend.graph_replays - replays0 == chunks
        # decode after the graphed prompt: the KV cache the graphs wrote is the eager one's
        tok = int(np.argmax(ref))
        got, ref = graphs.step([sg], [[tok]])[0], eager.step([se], [[tok]])[0]
        assert np.allclose(got, ref, rtol=1e-4, atol=1e-4)
        graphs.release(sg, keep_cached=False)
        eager.release(se, keep_cached=False)
    # the fp16 tiles grow (a step of more rows): the next chunk is captured again, not replayed stale
    ws = graphs.backend.ws
    gen = ws.generation
    ws.get("x16", ws.x16.size + 1)
    assert ws.generation == gen + 1
    ids = [int(t) for t in rng.integers(0, vocab, rows)]
    sg, se = graphs.new_sequence(), eager.new_sequence()
    got, ref = graphs.step([sg], [ids]), eager.step([se], [ids])
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 1e-5
