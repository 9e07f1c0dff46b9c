"""The real server on loopback with a real model, talked to by the official `openai` package
(sync, async, streaming) and by raw HTTP for what a well-behaved client never sends."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import re
import time

import httpx
import openai
import pytest

from lab.serve_soak import start_server, stop_server

KEY = "test-key-123"
CHAT = [{"role": "user", "content": "Name three fruits."}]


def _start(args, timeout=240):
    """Start `python -m runtime serve ARGS --port 0`; return (process, base URL) once it serves
    (lab/serve_soak.py's, which keeps draining the server's stderr)."""
    return start_server(args, timeout=timeout)


_stop = stop_server


@pytest.fixture(scope="module")
def server(model_path):
    path = model_path("smollm2-135m")
    proc, base = _start(["-m", str(path), "-c", "1024", "-np", "4", "--queue", "6", "--metrics", "--api-key", KEY])
    yield base
    _stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _kv_used(base) -> float:
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(re.search(r'llamba_kv_blocks\{state="used"\} (\S+)', text).group(1))


def test_health_models_tokenize(server, client):
    assert httpx.get(server + "/health").json() == {"status": "ok"}     # open without a key
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.startswith("SmolLM2")
    auth = {"Authorization": f"Bearer {KEY}"}
    ids = httpx.post(server + "/tokenize", json={"content": "Hello world"}, headers=auth).json()["tokens"]
    assert ids and httpx.post(server + "/detokenize", json={"tokens": ids}, headers=auth).json()["content"] == "Hello world"


def test_chat_whole_and_streamed_agree(client):
    whole = client.chat.completions.create(model="x", messages=CHAT, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    u = whole.usage
    assert u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    stream = client.chat.completions.create(model="x", messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == text and finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == u.completion_tokens and usage.prompt_tokens == u.prompt_tokens


def test_completions_stop_seed_n_logprobs(client):
    r = client.completions.create(model="x", prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 9"])
    assert r.choices[0].finish_reason == "stop" and " 9" not in r.choices[0].text
    assert r.choices[0].text.startswith(" 5, 6, 7, 8,")
    a = client.completions.create(model="x", prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42)
    b = client.completions.create(model="x", prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42)
    assert a.choices[0].text == b.choices[0].text
    many = client.chat.completions.create(model="x", messages=CHAT, max_tokens=8, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage.completion_tokens == sum(1 for _ in many.choices) * 8 or many.usage.completion_tokens <= 24
    lp = client.chat.completions.create(model="x", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=3)
    items = lp.choices[0].logprobs.content
    assert len(items) == lp.usage.completion_tokens
    assert all(len(x.top_logprobs) == 3 and x.logprob <= 0 and x.top_logprobs[0].logprob >= x.logprob - 1e-6
               for x in items)


def test_clients_at_once_get_their_solo_answers(server, client):
    prompts = [f"Write a short line about the number {i}." for i in range(8)]

    def ask(p):
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": p}], max_tokens=16,
                                           temperature=0)
        return r.choices[0].message.content
    # (a prompt's K/V are rounded differently in a long chunk and in a short tail after a
    # prefix-cache hit, so "alone" means alone with the same cache: warm it once first)
    [ask(p) for p in prompts]
    solo = [ask(p) for p in prompts]
    with cf.ThreadPoolExecutor(8) as ex:
        together = list(ex.map(ask, prompts))
    assert together == solo

    async def ask_async():
        ac = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
        out = await asyncio.gather(*[ac.chat.completions.create(
            model="x", messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0) for p in prompts[:4]])
        await ac.close()
        return [r.choices[0].message.content for r in out]
    assert asyncio.run(ask_async()) == solo[:4]


def test_disconnect_mid_stream_frees_the_blocks(server):
    body = {"messages": CHAT, "max_tokens": 400, "temperature": 0.7, "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 4:
                assert _kv_used(server) > 0
                break           # closing the stream drops the connection mid-answer
    deadline = time.monotonic() + 20
    while _kv_used(server) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _kv_used(server) == 0


BAD = [
    ({"messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": CHAT, "temperature": -1}, "temperature"),
    ({"messages": CHAT, "max_tokens": -5}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 10 ** 12}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 5000}, "max_tokens"),           # more than the context
    ({"messages": CHAT, "top_p": 7}, "top_p"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "n": 10 ** 6}, "n"),
    ({"messages": CHAT, "seed": 2 ** 80}, "seed"),
    ({"messages": CHAT, "logit_bias": {"1": 5}}, "logit_bias"),       # not implemented: named, not ignored
    ({"messages": CHAT, "stop": ["a"] * 100}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": "hello"}, "messages"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_fields_get_400_naming_them(server, body, param):
    r = httpx.post(server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_and_hostile_requests(server, client):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = server + "/v1/chat/completions"
    for raw in (b"{not json", b"[1, 2]", b"", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
                b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}'):
        r = httpx.post(url, content=raw, headers=auth)
        assert r.status_code == 400 and "error" in r.json(), (raw, r.text)
    big = httpx.post(url, content=b" " * (100 << 20), headers=auth, timeout=60)      # a 100 MB body
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"

    def chunks():
        for _ in range(20):
            yield b" " * (1 << 20)
    assert httpx.post(url, content=chunks(), headers=auth, timeout=60).status_code == 413   # no Content-Length
    long_prompt = "word " * 3000
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt=long_prompt, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and "context" in e.value.message
    assert httpx.post(server + "/detokenize", json={"tokens": [10 ** 9]}, headers=auth).status_code == 400
    assert httpx.get(server + "/v1/models", headers={**auth, "Host": "evil.example"}).status_code == 403
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server + "/v1/models").status_code == 401
    assert httpx.get(server + "/nowhere", headers=auth).json()["error"]["type"] == "not_found_error"
    # still serving
    ok = client.chat.completions.create(model="x", messages=CHAT, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content


def test_full_queue_answers_503_with_retry_after(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0}

    async def flood():
        async with httpx.AsyncClient(headers=auth, timeout=300) as c:
            return await asyncio.gather(*[c.post(server + "/v1/completions", json=body) for _ in range(16)])
    answers = asyncio.run(flood())
    codes = [r.status_code for r in answers]
    assert 503 in codes and 200 in codes, codes          # 4 running + 6 waiting: the rest are told to retry
    assert set(codes) <= {200, 503}
    busy = next(r for r in answers if r.status_code == 503)
    assert busy.headers["retry-after"] and busy.json()["error"]["code"] == "server_busy"
    assert _kv_used(server) == 0
