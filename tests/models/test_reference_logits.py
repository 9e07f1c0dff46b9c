"""Our logits against an independent implementation: HF transformers reading the
same GGUF file (it dequantizes the weights and runs its own PyTorch model code).

Bounds: over a 256-token text, top-1 agreement >= 98% and mean KL(ref || ours)
<= 0.01 nats; greedy continuations equal for 32 tokens, except where the
reference's own top two logits at the first divergence are within
NEAR_TIE (0.5 logits, a probability ratio under 1.65): there either answer is
right.  Decode quantizes activations to 8-bit blocks for integer dot products,
as llama.cpp does, which moves logits by a few tenths at most; 0.5 covers that.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from runtime.engine import Engine  # noqa: E402

NEAR_TIE = 0.5
TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels and flipping switches; each new problem meant rebuilding the machine. "
    "Stored programs changed that: instructions became data, and a single device could run "
    "anything that could be written down. Assemblers gave names to numbers, compilers turned "
    "formulas into instructions, and operating systems hid the hardware behind files and "
    "processes. Each layer let people think about bigger problems while trusting the layer "
    "below. Today a few lines of Python can train a neural network on a graphics card built "
    "for video games, and that network can write poems, translate contracts, and explain its "
    "own code. Yet the old questions remain: how fast is it, how much memory does it need, and "
    "can we trust the answer? Engineers still measure bandwidth in bytes per second and count "
    "the cycles in an inner loop. A language model that runs on a laptop must read every weight "
    "once for each token it writes, so its speed is bounded by memory, not arithmetic. "
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "Numbers like 3.14159, 2,718 and 1e-9 appear in prose too, as do names such as Zürich, "
    "São Paulo and 東京. The quick brown fox jumps over the lazy dog while the five boxing "
    "wizards jump quickly, and the story of computing goes on, one abstraction at a time, "
    "toward machines that are easier to use and harder to understand completely."
)
MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


def _log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module", params=MODELS)
def pair(request, model_path):
    path = model_path(request.param)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=torch.float32)
    ref.eval()
    eng = Engine(str(path), n_ctx=1024)
    yield request.param, tok, ref, eng
    del ref


def test_logits_match_reference(pair):
    name, tok, ref, eng = pair
    ids = tok(TEXT)["input_ids"][:256]
    assert len(ids) == 256, f"text too short for {name}: {len(ids)} tokens"
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    seq = eng.new_sequence()
    got = eng.step([seq], [ids], all_logits=True)
    eng.release(seq)
    a, b = _log_softmax(want), _log_softmax(got)
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    kl = float((np.exp(a) * (a - b)).sum(-1).mean())
    print(f"{name}: top-1 agreement {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= 0.98
    assert kl <= 0.01


def test_greedy_continuation_matches_reference(pair):
    name, tok, ref, eng = pair
    prompt = tok("The three most important inventions of the twentieth century are")["input_ids"]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    want = out[0, len(prompt):].tolist()
    seq = eng.new_sequence()
    logits = eng.prefill(seq, prompt)
    got = []
    for _ in range(len(want)):
        nxt = int(np.argmax(logits))
        got.append(nxt)
        logits = eng.step([seq], [[nxt]])[0]
    eng.release(seq)
    if got == want:
        return
    i = next(k for k in range(len(want)) if got[k] != want[k])
    with torch.no_grad():
        l = ref(torch.tensor([prompt + want[:i]])).logits[0, -1].numpy()
    top2 = np.sort(l)[-2:]
    margin = float(top2[1] - top2[0])
    assert margin < NEAR_TIE, (f"{name}: greedy diverges at token {i} ({got[i]} vs {want[i]}) "
                               f"with a reference margin of {margin:.3f} logits")
