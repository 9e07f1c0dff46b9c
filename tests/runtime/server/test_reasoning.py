"""A model's reasoning apart from its answer in the server's messages (`reasoning_content`, as
llama-server and vLLM send it), harmony's tool calls, `reasoning_format` and
`chat_template_kwargs`: the pure parts first, then the real server with a tiny gpt-oss whose
answers a grammar dictates (random weights say nothing worth parsing otherwise)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import openai
import pytest

from runtime.server.answer import AnswerStream, whole_message

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "checkpoints"))
from tiny_models import make_harmony  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
THINK = "<think>\nThe user greets me.\n</think>\n\nHello!"
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")


def _streamed(text, **kw):
    """The deltas of `text` fed a character at a time, folded into (reasoning, content, calls)."""
    s = AnswerStream(names=["get_weather"], **kw)
    deltas = [d for ch in text for d in s.feed(ch)] + s.feed("", final=True)
    r = "".join(d.get("reasoning_content", "") for d in deltas)
    c = "".join(d.get("content", "") for d in deltas)
    calls = [(t["function"]["name"], t["function"]["arguments"]) for d in deltas for t in d.get("tool_calls", [])]
    return r, c, calls


def test_think_tags_go_to_reasoning_content_whole_and_streamed():
    msg, calls = whole_message(THINK, split=True)
    assert msg == {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me."}
    assert not calls
    assert _streamed(THINK, split=True) == ("The user greets me.", "Hello!", [])
    # a template that opened <think> in the prompt: the answer starts inside the reasoning
    opened = THINK.removeprefix("<think>")
    assert whole_message(opened, split=True, opened=True)[0] == msg
    assert _streamed(opened, split=True, opened=True) == ("The user greets me.", "Hello!", [])
    # reasoning_format "none": the text as the model wrote it
    assert whole_message(THINK, split=False)[0] == {"role": "assistant", "content": THINK}
    assert _streamed(THINK, split=False) == ("", THINK, [])


def test_harmony_calls_come_out_as_tool_calls():
    msg, calls = whole_message(HARMONY_CALL, split=True, tools=TOOLS)
    assert calls and msg["content"] is None and msg["reasoning_content"] == "Need the weather."
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert _streamed(HARMONY_CALL, split=True) == ("Need the weather.", "", [("get_weather", '{"city": "Paris"}')])
    # a recipient that is not an offered function (gpt-oss's built-in browser) is not a call
    other = HARMONY_CALL.replace("functions.get_weather", "browser.search")
    assert whole_message(other, split=True, tools=TOOLS)[1] is False


def test_a_call_written_inside_the_reasoning_is_not_a_call():
    text = ('<think>I could answer <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call> but will not.</think>Sunny, I think.')
    msg, calls = whole_message(text, split=True, tool_fmt="hermes", tools=TOOLS)
    assert not calls and msg["content"] == "Sunny, I think." and "Oslo" in msg["reasoning_content"]
    assert _streamed(text, split=True, tool_fmt="hermes")[1:] == ("Sunny, I think.", [])
    # ...and one in the answer is
    call = '<think>x</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    msg, calls = whole_message(call, split=True, tool_fmt="hermes", tools=TOOLS)
    assert calls and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_harmony_required_call_grammar_takes_a_call_and_refuses_another_function(tmp_path):
    from runtime.tokenizer import Tokenizer
    from runtime.tools import tool_constraint
    d, hf, ids, _ = make_harmony(tmp_path / "h")
    tok = Tokenizer.from_hf_files(d)
    c = tool_constraint(TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}], "required", tok,
        "harmony")

    def takes(text):
        m = c.matcher()
        return m.consume_tokens(tok.encode(text, add_bos=False, parse_special=True)) and m.is_accepting()

    assert takes(HARMONY_CALL + "<|call|>")
    assert takes(HARMONY_CALL.split("<|start|>assistant")[1] + "<|call|>")               # no reasoning first
    assert not takes(HARMONY_CALL.replace('"city"', '"town"') + "<|call|>")              # arguments off-schema
    named = tool_constraint(TOOLS + [{"type": "function", "function": {"name": "get_time"}}],
                            {"type": "function", "function": {"name": "get_time"}}, tok, "harmony")
    m = named.matcher()
    assert not m.consume_tokens(tok.encode(HARMONY_CALL, add_bos=False, parse_special=True))


# ---- the real server -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """A server of a tiny gpt-oss GGUF with gpt-oss's own chat template (harmony)."""
    from quant.convert import convert
    from test_server import _start, _stop
    d, hf, ids, template = make_harmony(tmp_path_factory.mktemp("gptoss") / "ck")
    if template is None:
        pytest.skip("gpt-oss's chat template (llama.cpp's test set, from PyPI) could not be fetched")
    path = convert(d, d.parent / "g.gguf", "f16", progress=False)["path"]
    proc, base = _start(["-m", str(path), "-c", "512", "-np", "2", "-t", "1"])
    yield base, {t: f"<[{i}]>" for t, i in ids.items()}
    _stop(proc)


def _lark(sp, *parts):
    """A grammar that dictates the answer: literal text and harmony's special tokens."""
    return "%llguidance {}\nstart: " + " ".join(sp.get(p) or json.dumps(p) for p in parts) + "\n"


ANALYSIS = ("<|channel|>", "analysis", "<|message|>", "Think first.", "<|end|>", "<|start|>", "assistant")


def test_server_sends_harmony_reasoning_apart(gptoss):
    base, sp = gptoss
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    grammar = _lark(sp, *ANALYSIS, "<|channel|>", "final", "<|message|>", "Hi there", "<|return|>")
    ask = dict(model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**ask, extra_body={"grammar": grammar})
    m = whole.choices[0].message
    assert m.content == "Hi there" and m.model_extra["reasoning_content"] == "Think first."
    stream = client.chat.completions.create(**ask, stream=True, extra_body={"grammar": grammar})
    reasoning = content = ""
    for ch in stream:
        for c in ch.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("Think first.", "Hi there")
    raw = client.chat.completions.create(**ask, extra_body={"grammar": grammar, "reasoning_format": "none"})
    assert raw.choices[0].message.content.startswith("<|channel|>analysis<|message|>Think first.<|end|>")
    # the reasoning sent back in the next turn renders (gpt-oss's template drops it from the prompt)
    again = client.chat.completions.create(**{**ask, "messages": [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there",
                                               "reasoning_content": "Think first."},
        {"role": "user", "content": "Again"}]}, extra_body={"grammar": grammar})
    assert again.choices[0].message.content == "Hi there"


def test_server_parses_a_harmony_tool_call(gptoss):
    base, sp = gptoss
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    grammar = _lark(sp, *ANALYSIS, "<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json",
                    "<|message|>", '{"city": "Paris"}', "<|call|>")
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=TOOLS, max_tokens=60, temperature=0, extra_body={"grammar": grammar})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert c.message.model_extra["reasoning_content"] == "Think first."


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused(gptoss):
    base, _ = gptoss
    ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    used = {}
    for effort in ("low", "high"):
        r = httpx.post(base + "/v1/chat/completions", timeout=60,
                       json={**ask, "chat_template_kwargs": {"reasoning_effort": effort}})
        assert r.status_code == 200, r.text
        used[effort] = r.json()["usage"]["prompt_tokens"]
    tok = httpx.post(base + "/tokenize", json={"content": "Reasoning: high"}).json()["tokens"]
    low = httpx.post(base + "/tokenize", json={"content": "Reasoning: low"}).json()["tokens"]
    assert used["high"] - used["low"] == len(tok) - len(low)       # only the effort line differs
    for bad in ({"messages": []}, {"bad key": 1}, {"add_generation_prompt": False}):
        r = httpx.post(base + "/v1/chat/completions", json={**ask, "chat_template_kwargs": bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("chat_template_kwargs"), r.text
    r = httpx.post(base + "/v1/chat/completions", json={**ask, "reasoning_format": "sometimes"}, timeout=60)
    assert r.status_code == 400 and "reasoning_format" in r.json()["error"]["param"]
