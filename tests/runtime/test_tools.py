"""Tool calls (runtime/tools.py): parsing each model family's format, whole and streamed; rendering tools
into chat templates; constraints for tool_choice required / named / auto on Qwen2.5-Coder-0.5B."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from runtime.constrain import ConstraintError
from runtime.generate import Generation
from runtime.sampling import SamplingParams
from runtime.tools import (ToolCallParser, detect_format, encode_with_tools, normalize_tools, parse_tool_calls,
                           prepare_messages, tool_constraint, tool_grammar)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]),
    ("llama3", '{"name": "add", "parameters": {"a": 1, "b": {"nested": [1, 2]}}}', "",
     [("add", {"a": 1, "b": {"nested": [1, 2]}})]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}', "", [("add", {"a": 3, "b": 4})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]', "",
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    ("generic", 'Sure:\n```json\n{"name": "add", "arguments": {"a": 5, "b": 6}}\n```', "Sure:",
     [("add", {"a": 5, "b": 6})]),
    ("generic", '{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}', "",
     [("add", {"a": 1, "b": 1})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>', "",
     [("add", {"a": 1, "b": 2})]),
    ("hermes", "No tool needed: 2 < 3 and {braces} stay text.", "No tool needed: 2 < 3 and {braces} stay text.", []),
    ("generic", '{"answer": 42}', '{"answer": 42}', []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parse_tool_calls(fmt, text, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)
    assert all(c.to_openai()["type"] == "function" for c in got)


@pytest.mark.parametrize("fmt,text,content,calls", [c for c in CASES if "```" not in c[1]])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streaming_deltas_match_the_whole(fmt, text, content, calls, chunk):
    p = ToolCallParser(fmt)
    events = []
    for i in range(0, len(text), chunk):
        events += p.feed(text[i:i + chunk])
    events += p.finish()
    streamed_content = "".join(e.get("content", "") for e in events)
    names, args, ids = {}, {}, {}
    for e in events:
        for d in e.get("tool_calls", []):
            i = d["index"]
            f = d["function"]
            if "name" in f:
                assert i not in names            # a call is announced once, with its id, before its arguments
                names[i], ids[i] = f["name"], d["id"]
            assert i in names
            args[i] = args.get(i, "") + f.get("arguments", "")
    assert streamed_content.strip() == content
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == calls
    assert [c.arguments for c in p.calls] == [args[i] for i in sorted(args)]
    assert [c.id for c in p.calls] == [ids[i] for i in sorted(ids)]


def test_stream_holds_back_a_partial_opener():
    p = ToolCallParser("hermes")
    assert p.feed("Hello <tool") == [{"content": "Hello "}]
    assert p.feed("_call>\n{\"name\": \"add\", ") [0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    out = p.feed('"arguments": {"a": 1')
    assert out == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1'}}]}]


def test_normalize_tools_errors():
    assert normalize_tools([{"name": "f"}])[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    for bad, msg in [([{"type": "code"}], "type"), ([{"function": {}}], "name"),
                     ([{"function": {"name": "a b"}}], "letters"), ([ADD, ADD], "twice"),
                     ([{"function": {"name": "f", "parameters": 3}}], "parameters")]:
        with pytest.raises(ValueError, match=msg):
            normalize_tools(bad)


def test_detect_format():
    assert detect_format("...<tool_call>...") == "hermes"
    assert detect_format("...[TOOL_CALLS]...") == "mistral"
    assert detect_format("<|start_header_id|>...<|python_tag|>") == "llama3"
    assert detect_format(None) == "generic"


# ---- with the real models ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(model_path):
    from runtime.engine import Engine
    return Engine(str(model_path("qwen2.5-coder-0.5b")), n_ctx=2048, threads=1)


def test_render_native_and_fallback(qwen, model_path):
    tok = qwen.tokenizer
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    text = tok.decode(encode_with_tools(tok, None, msgs, TOOLS))
    assert "<tools>" in text and '"name": "get_weather"' in text
    # arguments given as a JSON string reach the template as an object (not encoded twice)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text
    # SmolLM2's template knows no tools: a Hermes system prompt, calls and results as text
    from runtime.loader import load_model
    smol = load_model(model_path("smollm2-135m"))
    m, extra = prepare_messages(msgs, TOOLS, smol.chat_template)
    assert extra == {} and m[0]["role"] == "system" and "<tools>" in m[0]["content"]
    assert "<tool_call>" in m[2]["content"] and m[3]["role"] == "user"
    text = smol.tokenizer.decode(encode_with_tools(smol.tokenizer, smol.chat_template, msgs, TOOLS))
    assert "get_weather" in text and "<tool_response>" in text


def _ask(qwen, question, choice, max_tokens=60, params=SamplingParams(temperature=0.0), parallel=True):
    fmt = detect_format(qwen.loaded.chat_template)
    ids = encode_with_tools(qwen.tokenizer, None, [{"role": "user", "content": question}], TOOLS)
    c = tool_constraint(TOOLS, choice, qwen, fmt, parallel=parallel)
    gen = Generation(qwen, ids, params, max_tokens=max_tokens, constraint=c)
    try:
        gen.run()
    finally:
        qwen.release(gen.seq)
    return gen, parse_tool_calls(gen.text, fmt)


@pytest.mark.parametrize("seed", [None, 7])
def test_required_gives_valid_calls(qwen, seed):
    params = SamplingParams(temperature=0.0) if seed is None else SamplingParams(temperature=0.9, seed=seed)
    gen, (content, calls) = _ask(qwen, "Tell me a joke about cats.", "required", params=params,
                                 parallel=seed is not None)
    assert gen.text.startswith("<tool_call>\n") and content == ""
    assert calls
    if seed is None:        # one call, then the grammar is complete
        assert len(calls) == 1 and gen.stats.stop_reason == "stop" and gen.text.endswith("</tool_call>")
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMA[c.name])


def test_named_function(qwen):
    gen, (content, calls) = _ask(qwen, "What is the weather in Rome?", {"type": "function",
                                                                          "function": {"name": "add"}},
                                 parallel=False)
    assert [c.name for c in calls][:1] == ["add"]
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA["add"])
    with pytest.raises(ValueError, match="nope"):
        tool_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}}, qwen, "hermes")


def test_auto_is_lazy(qwen):
    c = tool_constraint(TOOLS, "auto", qwen, "hermes")
    tok = qwen.tokenizer

    def run(text):
        m = c.matcher()
        return all(m.consume(t) for t in tok.encode(text, add_bos=False)), m
    ok, m = run('Sure, adding. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> Done')
    assert ok and m.is_accepting()
    assert run("Just text, no call at all {\"x\": 1}.")[0]
    assert not run("Calling <tool_call>\nhello")[0]                               # the call is constrained
    assert not run('<tool_call>\n{"name": "sub", "arguments": {}}')[0]           # only declared functions
    assert not run('<tool_call>\n{"name": "add", "arguments": {"a": "x"')[0]     # arguments follow the schema
    gen, (content, calls) = _ask(qwen, "Use the add tool to add 2 and 40.", "auto")
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMA[call.name])
    assert tool_constraint(TOOLS, "none", qwen, "hermes") is None


@pytest.mark.parametrize("fmt", ["llama3", "mistral", "generic"])
def test_other_format_grammars_compile_and_constrain(qwen, fmt):
    for choice in ("auto", "required"):
        c = tool_constraint(TOOLS, choice, qwen, fmt)
        row = np.zeros(c.n_words, np.uint32)
        assert c.matcher().fill_mask(row)
    text = {"llama3": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
            "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
            "generic": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'}[fmt]
    m = tool_constraint(TOOLS, "required", qwen, fmt).matcher()
    assert all(m.consume(t) for t in qwen.tokenizer.encode(text, add_bos=False)) and m.is_accepting()
    assert parse_tool_calls(text, fmt)[1][0].name == "add"


def test_bad_tool_choice(qwen):
    with pytest.raises(ValueError, match="tool_choice"):
        tool_grammar(TOOLS, "sometimes", qwen, "hermes")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    with pytest.raises(ConstraintError, match="objekt"):
        tool_constraint(bad, "required", qwen, "hermes")


def test_only_declared_functions_are_calls():
    text = '{"name": "Cat Joke", "arguments": {"cat": "Meow"}}'
    assert parse_tool_calls(text, "generic")[1][0].name == "Cat Joke"
    assert parse_tool_calls(text, "generic", TOOLS) == (text, [])
    fenced = 'Here:\n```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```'
    assert parse_tool_calls(fenced, "hermes", TOOLS)[1][0].name == "add"
    p = ToolCallParser("generic", names=["add"])
    events = p.feed(text) + p.finish()
    assert "".join(e.get("content", "") for e in events) == text and not p.calls
