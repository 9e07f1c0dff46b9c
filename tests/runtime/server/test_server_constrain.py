"""Structured output through the real server and the official `openai` package, with
Qwen2.5-Coder-0.5B: response_format (json_object, json_schema), the grammar and regex
extensions, and tool calls, whole and streamed, through a full round."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from test_server import _start, _stop

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                       "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(model_path):
    proc, base = _start(["-m", str(model_path("qwen2.5-coder-0.5b")), "-c", "2048", "-np", "4"])
    yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    _stop(proc)


def _ask(client, content, **kw):
    return client.chat.completions.create(model="x", messages=[{"role": "user", "content": content}],
                                          max_tokens=kw.pop("max_tokens", 96), **kw)


def test_json_schema_and_json_object(client):
    for temp in (0, 0.9):
        r = _ask(client, "Invent a person.", temperature=temp, seed=3,
                 response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                         "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        assert r.choices[0].finish_reason == "stop"
    r = _ask(client, "Give me any JSON object about cats.", temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_and_grammar_extensions(client):
    r = _ask(client, "What is today's date?", temperature=0.7, seed=1, extra_body={"regex": r"\d{4}-\d{2}-\d{2}"})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].message.content)
    gbnf = 'root ::= "yes" | "no"'
    r = _ask(client, "Is water wet?", temperature=0, extra_body={"grammar": gbnf})
    assert r.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, "x", extra_body={"grammar": "root ::= ( unclosed"})
    assert e.value.body["param"] == "grammar" and "compile" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, "x", extra_body={"regex": "a", "grammar": 'root ::= "a"'})
    assert e.value.body["param"] == "regex"


def test_tool_call_round_whole_and_streamed(client):
    messages = [{"role": "user", "content": "What's the weather in Paris in celsius?"}]
    r = client.chat.completions.create(model="x", messages=messages, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=96)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # streamed: the same call, assembled from OpenAI-style deltas
    stream = client.chat.completions.create(model="x", messages=messages, tools=[WEATHER], tool_choice="required",
                                            temperature=0, max_tokens=96, stream=True)
    name, args, finish = None, "", None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert (name, json.loads(args), finish) == ("get_weather", json.loads(call.function.arguments), "tool_calls")
    # the round: the call and its result go back; the model answers in words
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = client.chat.completions.create(model="x", messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=48)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert "21" in final.choices[0].message.content


def test_named_tool_choice_and_unknown_name(client):
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       tools=[other, WEATHER], temperature=0, max_tokens=96,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
