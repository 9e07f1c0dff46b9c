"""The scheduler, in process with a real model: a request gets the same greedy tokens alone
and beside others, under preemption and with prefixes shared; cancelled requests give
their KV blocks back."""
from __future__ import annotations

import pytest

from runtime.engine import Engine
from runtime.generate import Generation
from runtime.sampling import SamplingParams
from runtime.scheduler import QueueFull, Request, Scheduler
from runtime.text_stream import TextStream

GREEDY = SamplingParams(temperature=0)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "List three colors: " * 40, "Water boils at", "The quick brown fox", "In 1905, Albert Einstein",
           "SELECT name FROM", "My favourite fruit is", "import numpy as np\n" * 3, "Dear Sir or Madam,",
           "The mitochondria is", "Q: What is 2+2?\nA:", "Roses are red,", "<html><body>", "Chapter 1\n\n"]


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine(str(model_path("smollm2-135m")), n_ctx=512, cache_blocks=512)


@pytest.fixture(scope="module")
def solo(engine):
    """Each prompt's greedy tokens alone, through Generation (no scheduler), prefix cache cold."""
    out = []
    for p in PROMPTS:
        g = Generation(engine, engine.tokenizer.encode(p), GREEDY, max_tokens=12).run()
        out.append(g.ids)
        engine.release(g.seq, keep_cached=False)
    return out


def _run(engine, prompts, **kw):
    sch = Scheduler(engine, **kw)
    reqs = [sch.submit(Request(engine.tokenizer.encode(p), GREEDY, max_tokens=12)) for p in prompts]
    sch.run_until_idle()
    return sch, reqs


def test_sixteen_at_once_equal_each_alone(engine, solo):
    sch, reqs = _run(engine, PROMPTS, max_running=16, prefix_cache=False)
    assert [r.output for r in reqs] == solo
    assert all(r.finish_reason in ("length", "stop") for r in reqs)
    # batched: far fewer forwards than tokens
    assert sch.stats.forwards < sch.stats.generated_tokens / 4
    assert engine.stats()["blocks_used"] == 0


LONG = ["The history of bread begins " * 9, "def parse(line):\n    return line.split(',')\n" * 4,
        "Rivers of Europe: the Danube, the Rhine, the Loire, " * 5, "Once upon a time " * 12,
        "SELECT name, age FROM people WHERE age > 30 ORDER BY name;\n" * 3]


def test_prompts_sharing_a_forward_equal_each_alone(engine):
    """Prompt chunks of 32+ tokens of different requests share forwards (Engine.merge_rows):
    each request's greedy tokens are still its own."""
    if engine.merge_rows is None:
        pytest.skip("prompts share forwards only through the bf16 prompt kernel (AVX512_BF16), not on this CPU")
    ids = [engine.tokenizer.encode(p) for p in LONG]
    assert all(len(x) >= 32 for x in ids)
    alone = []
    for x in ids:
        g = Generation(engine, x, GREEDY, max_tokens=12).run()
        alone.append(g.ids)
        engine.release(g.seq, keep_cached=False)
    shared = []
    step = engine.step

    def spy(seqs, toks, **kw):
        if len(seqs) > 1 and min(len(t) for t in toks) >= 32:
            shared.append(len(seqs))
        return step(seqs, toks, **kw)
    engine.step = spy
    try:
        sch = Scheduler(engine, max_running=8, prefix_cache=False)
        reqs = [sch.submit(Request(x, GREEDY, max_tokens=12)) for x in ids]
        sch.run_until_idle()
    finally:
        del engine.step
    assert engine.merge_rows == 32 and shared and max(shared) >= 3
    assert [r.output for r in reqs] == alone


def test_preemption_recomputes_and_keeps_the_tokens(model_path):
    # 12 blocks of 16 tokens: 6 answers of 40 tokens outgrow the pool while they decode, so
    # the latest admitted are preempted (blocks freed) and recomputed later
    eng = Engine(str(model_path("smollm2-135m")), n_ctx=512, cache_blocks=12)
    prompts = PROMPTS[4:10]
    alone = []
    for p in prompts:
        g = Generation(eng, eng.tokenizer.encode(p), GREEDY, max_tokens=40).run()
        alone.append(g.ids)
        eng.release(g.seq, keep_cached=False)
    sch = Scheduler(eng, max_running=6)
    reqs = [sch.submit(Request(eng.tokenizer.encode(p), GREEDY, max_tokens=40)) for p in prompts]
    sch.run_until_idle()
    assert [r.output for r in reqs] == alone
    assert sch.stats.preemptions > 0
    assert eng.stats()["blocks_used"] == 0


def test_shared_prefix_is_computed_once(model_path):
    system = "You are a helpful assistant who answers in one short sentence. " * 8
    prompts = [system + q for q in ("Why is the sky blue?", "Name a prime.", "Say hi.", "Count to three.")]
    path = str(model_path("smollm2-135m"))
    # alone, one after the other: the first computes the system prompt, the others reuse it
    eng = Engine(path, n_ctx=512, cache_blocks=256)
    alone = [Generation(eng, eng.tokenizer.encode(p), GREEDY, max_tokens=12).run().ids for p in prompts]
    eng = Engine(path, n_ctx=512, cache_blocks=256)
    n_prefix = len(eng.tokenizer.encode(system))
    sch, reqs = _run(eng, prompts, max_running=8)
    # all at once: the others wait for the first's shared blocks instead of computing them
    assert sum(r.stats.cached_tokens for r in reqs[1:]) >= 3 * (n_prefix // 16 - 1) * 16
    assert sch.stats.prompt_tokens < sum(len(eng.tokenizer.encode(p)) for p in prompts) - 2 * n_prefix
    assert [r.output for r in reqs] == alone


def test_cancel_returns_blocks_and_queue_is_bounded(engine):
    sch = Scheduler(engine, max_running=2, max_waiting=3)
    reqs = [sch.submit(Request(engine.tokenizer.encode(p), GREEDY, max_tokens=200)) for p in PROMPTS[:3]]
    with pytest.raises(QueueFull):
        for p in PROMPTS[3:6]:
            sch.submit(Request(engine.tokenizer.encode(p), GREEDY, max_tokens=4))
    for _ in range(4):
        sch.step()
    assert engine.stats()["blocks_used"] > 0
    for r in reqs:
        r.cancel()
    sch.run_until_idle()
    assert [r.finish_reason for r in reqs[:3]] == ["cancelled"] * 3
    assert engine.stats()["blocks_used"] == 0


def test_stop_strings_and_events(engine):
    events = []
    sch = Scheduler(engine)
    r = sch.submit(Request(engine.tokenizer.encode("1, 2, 3, 4,"), GREEDY, max_tokens=40, stop=[" 8"],
                           on_event=events.append, logprobs=2))
    sch.run_until_idle()
    text = "".join(e.text for e in events)
    assert r.finish_reason == "stop" and events[-1].finish == "stop"
    assert " 8" not in text and text.startswith(" 5, 6, 7,")
    lp = [e.logprob for e in events if e.logprob]
    assert lp and all(x["logprob"] <= 0 and len(x["top"]) == 2 for x in lp)
    assert all(x["top"][0][1] >= x["logprob"] - 1e-6 for x in lp)     # greedy picks the most likely


def test_text_stream_holds_back_a_possible_stop(engine):
    tok = engine.tokenizer
    ts = TextStream(tok, stop=["END"])
    out = "".join(ts.feed(t) for t in tok.encode("hello EN", add_bos=False))
    assert out == "hello " and not ts.stopped       # "EN" might begin "END"
    out += "".join(ts.feed(t) for t in tok.encode("D more", add_bos=False)) + ts.finish()
    assert out == "hello " and ts.stopped


def test_a_request_alone_decodes_speculatively_with_its_own_tokens(engine, solo):
    from runtime.speculative import Drafter
    draft = Engine(engine.loaded, n_ctx=512)          # SmolLM2 drafting for itself: every draft accepted
    sch = Scheduler(engine, drafter=Drafter(draft, engine, k=4, adaptive=False))
    reqs = []
    for p in PROMPTS[:3]:           # one at a time: a request alone speculates
        reqs.append(sch.submit(Request(engine.tokenizer.encode(p), GREEDY, max_tokens=12)))
        sch.run_until_idle()
    assert [r.output for r in reqs] == solo[:3]
    st = sch.drafter.stats
    assert st.verify_forwards > 0 and st.accepted > 0
    assert sch.stats.forwards < sum(len(r.output) for r in reqs)
    assert engine.stats()["blocks_used"] == 0
