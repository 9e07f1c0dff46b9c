"""The HTTP routes: OpenAI's chat and text completions (streamed as server-sent events or
whole), models, tokenize/detokenize, health and metrics.  A thin shell: a request becomes
scheduler Requests (runtime/scheduler.py), whose events come back through an asyncio queue;
the engine runs in the scheduler's thread, never in the event loop."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response, StreamingResponse

from .. import reasoning
from ..sampling import SamplingParams
from ..scheduler import QueueFull, Request
from . import errors
from .answer import AnswerStream, template_reasons, whole_message
from .errors import APIError
from .guard import BodyTooLarge, Guard
from .protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

RETRY_AFTER = "2"
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}   # their metric labels


def create_app(host, *, api_key=None, allowed_hosts=None, cors_origins=(), metrics=None,
               max_body=8 << 20) -> FastAPI:
    app = FastAPI(title="Llamba", docs_url=None, redoc_url=None)
    app.state.host, app.state.metrics = host, metrics

    def count(http, status: int) -> None:
        """An answer of a completion endpoint that did not stream to its end, by status."""
        if metrics is not None and http.url.path in ENDPOINTS:
            metrics.requests.labels(ENDPOINTS[http.url.path], str(status)).inc()

    @app.exception_handler(APIError)
    async def _api_error(http, e: APIError):
        count(http, e.status)
        return errors.response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(http, e: RequestValidationError):
        count(http, 400)
        err = (e.errors() or [{}])[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        kind = err.get("type", "")
        if kind == "json_invalid":
            return errors.response(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}".strip(),
                                   None, "invalid_json")
        if kind == "extra_forbidden":
            return errors.response(400, f"unsupported field '{param}': Llamba does not implement it", param,
                                   "unsupported_field")
        if not loc:
            return errors.response(400, "the body must be a JSON object", None, "invalid_body")
        return errors.response(400, f"invalid '{param}': {err.get('msg', 'invalid value')}", param, "invalid_value")

    @app.exception_handler(HTTPException)
    async def _http(_, e: HTTPException):
        if isinstance(e.__cause__, BodyTooLarge):      # FastAPI wraps what the body's reading raised
            return errors.response(413, f"request body exceeds the limit of {max_body} bytes", None, "body_too_large")
        return errors.response(e.status_code, str(e.detail), None, None)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_, e):
        return errors.response(413, f"request body exceeds the limit of {max_body} bytes", None, "body_too_large")

    @app.exception_handler(Exception)
    async def _crash(http, e: Exception):
        count(http, 500)
        return errors.response(500, f"internal error: {type(e).__name__}", None, "internal_error")

    @app.get("/health")
    async def health():
        if not host.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if host.error:
            return JSONResponse({"status": "error", "error": host.error}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        h = _ready(host)
        c = h.engine.config
        return {"object": "list", "data": [{"id": h.model_id, "object": "model", "created": int(h.started),
                                            "owned_by": "llamba",
                                            "meta": {"architecture": c.arch, "n_ctx": h.engine.n_ctx,
                                                     "n_vocab": c.vocab_size, "parameters": h.engine.loaded.n_params}}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        tok = _ready(host).engine.tokenizer
        ids = await run_in_threadpool(tok.encode, body.content, body.add_special)
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": tok.token_bytes(i).decode("utf-8", "replace")} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        tok = _ready(host).engine.tokenizer
        bad = next((t for t in body.tokens if t >= tok.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of the vocabulary (0..{tok.vocab_size - 1})", "tokens")
        return {"content": await run_in_threadpool(tok.decode, body.tokens)}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise APIError(404, "metrics are off (start the server with --metrics)")
        from .metrics import CONTENT_TYPE
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        h = _ready(host)
        eng = h.engine
        from ..chat_template import ChatTemplateError, encode_chat
        from ..tools import detect_format, encode_with_tools
        msgs = [_message(m) for m in body.messages]
        tok, template = eng.tokenizer, eng.loaded.chat_template
        choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
        tools = ([t.model_dump(exclude_none=True) for t in body.tools]
                 if body.tools and choice != "none" else None)
        own = template or getattr(tok, "chat_template", None)
        fmt = detect_format(own) if tools else None
        extra = body.chat_template_kwargs or {}
        try:
            ids = await run_in_threadpool(lambda: encode_with_tools(tok, template, msgs, tools, arch=eng.config.arch,
                                                                    **extra)
                                          if tools else encode_chat(tok, template, msgs, arch=eng.config.arch,
                                                                    **extra))
        except ChatTemplateError as e:
            raise APIError(400, f"the chat template failed on these messages: {e}", "messages",
                           "chat_template_error")
        except ValueError as e:
            raise APIError(400, str(e), "tools")
        constraint = await run_in_threadpool(_constraint, body, tok, tools, choice, fmt)
        # reasoning apart from the answer where the template's model writes it (answer.py)
        split = (body.reasoning_format or h.cfg.reasoning_format) != "none" and template_reasons(own)
        answer = {"split": split, "opened": split and reasoning.prompt_opens_reasoning(tok, ids),
                  "tool_fmt": None if fmt == "harmony" and split else fmt}
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _complete(h, http, body, [ids], max_tokens, chat=True,
                               logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                               constraint=constraint, answer=answer, tools=tools)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        h = _ready(host)
        tok = h.engine.tokenizer
        p = body.prompt
        if isinstance(p, str):
            prompts = [await run_in_threadpool(tok.encode, p)]
        elif isinstance(p[0], str):
            prompts = [await run_in_threadpool(tok.encode, x) for x in p]
        else:
            bad = next((t for t in p if t >= tok.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is out of the vocabulary (0..{tok.vocab_size - 1})", "prompt")
            prompts = [list(p)]
        constraint = await run_in_threadpool(_constraint, body, tok, None, None, None)
        return await _complete(h, http, body, prompts, body.max_tokens or 16, chat=False, logprobs=body.logprobs,
                               constraint=constraint)

    async def _complete(h, http, body, prompts, max_tokens, chat: bool, logprobs, constraint=None, answer=None,
                        tools=None):
        eng, sch = h.engine, h.scheduler
        n_ctx = eng.n_ctx
        for ids in prompts:
            if not ids:
                raise APIError(400, "the prompt is empty", "prompt")
            if len(ids) >= n_ctx:
                raise APIError(400, f"the prompt is {len(ids)} tokens, this server's context is {n_ctx} tokens: "
                                    f"shorten it", "messages" if chat else "prompt", "context_length_exceeded")
        if max_tokens is not None and max_tokens > n_ctx:
            raise APIError(400, f"max_tokens {max_tokens} exceeds this server's context of {n_ctx} tokens",
                           "max_tokens", "invalid_value")
        started = time.monotonic()
        params = _params(body)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        reqs = []
        stop = body.stop_list()
        for pi, ids in enumerate(prompts):
            for c in range(body.n):
                index = pi * body.n + c
                seed = None if params.seed is None else (params.seed + index) % (1 << 64)
                p = SamplingParams(**{**params.__dict__, "seed": seed})
                reqs.append(Request(ids, p, max_tokens=max_tokens or (n_ctx - len(ids)), stop=stop, logprobs=logprobs,
                                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                    matcher=constraint.matcher() if constraint is not None else None,
                                    on_event=_bridge(loop, queue, index)))
        try:
            for r in reqs:
                sch.submit(r)
        except QueueFull as e:
            for r in reqs:
                r.cancel()
            sch.wake()
            raise APIError(503, f"the server is busy ({e}); retry shortly", None, "server_busy",
                           {"Retry-After": RETRY_AFTER})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        shape = _Shape(rid, created, h.model_id, chat, eng.tokenizer, answer, tools)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(shape, reqs, queue, sch, started, include_usage, metrics, len(prompts)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(shape, reqs, queue, sch, http, started, metrics, len(prompts))

    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    # the guard wraps everything, CORS included: its checks come first
    app.add_middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts, max_body=max_body)
    return app


def _ready(host):
    if not host.ready.is_set():
        raise APIError(503, "the model is still loading", None, "model_loading", {"Retry-After": RETRY_AFTER})
    if host.error:
        raise APIError(503, f"the model failed to load: {host.error}", None, "model_error")
    return host


def _constraint(body, tok, tools, choice, fmt):
    """The one constraint a request asks for (response_format, grammar, regex or tools), compiled;
    a 400 naming the field where it does not compile."""
    from ..constrain import Constraint, ConstraintError
    from ..tools import tool_constraint
    rf = body.response_format
    # harmony's "auto" is no constraint (tools.py): a grammar may shape such an answer
    tools_constrain = bool(tools) and not (fmt == "harmony" and choice in ("auto", None))
    asked = [k for k, v in (("response_format", rf is not None and rf.type != "text"), ("grammar", body.grammar),
                            ("regex", body.regex), ("tools", tools_constrain)) if v]
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)} cannot both constrain one answer: use one", asked[1])
    if not asked:
        return None
    try:
        if asked[0] == "response_format":
            if rf.type == "json_object":
                return Constraint.json_object(tok)
            if rf.json_schema is None:
                raise APIError(400, "response_format of type json_schema needs a json_schema",
                               "response_format.json_schema")
            return Constraint.json_schema(rf.json_schema.schema_, tok, lenient=not rf.json_schema.strict)
        if asked[0] == "grammar":
            return Constraint.grammar(body.grammar, tok)
        if asked[0] == "regex":
            return Constraint.regex(body.regex, tok)
        return tool_constraint(tools, choice or "auto", tok, fmt, parallel=body.parallel_tool_calls)
    except (ConstraintError, ValueError) as e:
        param = {"response_format": "response_format.json_schema"}.get(asked[0], asked[0])
        raise APIError(400, f"{asked[0]} does not compile: {e}", param, "invalid_constraint")


def _message(m) -> dict:
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.role == "assistant":
        if m.reasoning_content:       # as a template reads an earlier turn's reasoning (Qwen3, gpt-oss)
            out["reasoning_content"] = out["thinking"] = m.reasoning_content
        elif reasoning.detect(out["content"]):     # sent back raw (reasoning_format "none"): apart again
            out.update(reasoning.for_template(out["content"]))
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": t.id, "type": t.type,
                              "function": {"name": t.function.name, "arguments": t.function.arguments}}
                             for t in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _params(body) -> SamplingParams:
    d = SamplingParams()
    return SamplingParams(
        temperature=d.temperature if body.temperature is None else body.temperature,
        top_k=d.top_k if body.top_k is None else body.top_k,
        top_p=d.top_p if body.top_p is None else body.top_p,
        min_p=d.min_p if body.min_p is None else body.min_p,
        seed=None if body.seed is None else body.seed % (1 << 64))


def _bridge(loop, queue, index):
    """The scheduler thread's events, handed to the event loop."""
    def put(ev):
        loop.call_soon_threadsafe(queue.put_nowait, (index, ev))
    return put


class _Shape:
    """OpenAI's response objects for one request."""

    def __init__(self, rid, created, model, chat, tok, answer=None, tools=None):
        self.rid, self.created, self.model, self.chat, self.tok = rid, created, model, chat, tok
        # chat: how the text becomes a message (answer.py): {"split": reasoning apart, "opened": the
        # prompt opened <think>, "tool_fmt": tools were offered, calls parsed out in this format}
        self.answer = answer or {"split": False, "opened": False, "tool_fmt": None}
        self.tools = tools              # (a call of a function not offered stays text)

    def stream(self) -> AnswerStream:
        names = [t["function"]["name"] for t in self.tools or []]
        return AnswerStream(**self.answer, names=names)

    def _piece(self, t: int) -> str:
        return self.tok.token_bytes(t).decode("utf-8", "replace")

    def logprobs(self, items: list[dict]):
        if self.chat:
            return {"content": [{"token": self._piece(x["token"]), "logprob": x["logprob"],
                                 "bytes": list(self.tok.token_bytes(x["token"])),
                                 "top_logprobs": [{"token": self._piece(t), "logprob": lp,
                                                   "bytes": list(self.tok.token_bytes(t))} for t, lp in x["top"]]}
                                for x in items]}
        return {"tokens": [self._piece(x["token"]) for x in items], "token_logprobs": [x["logprob"] for x in items],
                "top_logprobs": [{self._piece(t): lp for t, lp in x["top"]} for x in items]}

    def chunk(self, index, text=None, finish=None, role=False, logprobs=None, delta=None, stop_reason=None) -> str:
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if stop_reason:
            choice["stop_reason"] = stop_reason
        if not self.chat:
            obj = {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [choice]}
        return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"

    def usage_chunk(self, usage) -> str:
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [], "usage": usage}
        return "data: " + json.dumps(obj) + "\n\n"

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The assistant message of an answer: reasoning apart, tool calls parsed out (answer.py)."""
        msg, calls = whole_message(text, **self.answer, tools=self.tools)
        return msg, "tool_calls" if calls else finish

    def whole(self, texts, finishes, logprobs, usage, stop_reasons) -> dict:
        if self.chat:
            choices = []
            for i, (t, f, lp) in enumerate(zip(texts, finishes, logprobs)):
                msg, f = self.message(t, f)
                choices.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": f})
            obj = "chat.completion"
        else:
            choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                       for i, (t, f, lp) in enumerate(zip(texts, finishes, logprobs))]
            obj = "text_completion"
        for c, why in zip(choices, stop_reasons):
            if why:
                c["stop_reason"] = why
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage}


def _usage(reqs, n_prompts) -> dict:
    per_prompt = len(reqs) // max(1, n_prompts)
    prompt = sum(r.stats.prompt_tokens for r in reqs[::per_prompt])
    cached = sum(r.stats.cached_tokens for r in reqs[::per_prompt])
    done = sum(r.stats.completion_tokens for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Timer:
    """Time to first token and inter-token latency, into the metrics' histograms."""

    def __init__(self, metrics, started, n):
        self.m, self.started, self.last = metrics, started, [None] * n

    def token(self, index):
        if self.m is None:
            return
        now = time.monotonic()
        if self.last[index] is None:
            self.m.ttft.observe(now - self.started)
        else:
            self.m.itl.observe(now - self.last[index])
        self.last[index] = now


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


async def _whole(shape, reqs, queue, sch, http, started, metrics, n_prompts):
    n = len(reqs)
    texts, finishes, lps, why = [""] * n, [None] * n, [[] for _ in range(n)], [None] * n
    timer = _Timer(metrics, started, n)
    left = n
    try:
        while left:
            try:
                index, ev = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    if metrics:
                        metrics.requests.labels("chat" if shape.chat else "completions", "499").inc()
                    return Response(status_code=499)
                continue
            texts[index] += ev.text
            if ev.token is not None:
                timer.token(index)
            if ev.logprob is not None:
                lps[index].append(ev.logprob)
            if ev.finish is not None:
                if ev.finish == "error":
                    raise APIError(500, f"generation failed: {ev.error}", None, "generation_error")
                finishes[index] = _finish_reason(ev.finish)
                why[index] = ev.stop_reason
                left -= 1
    finally:
        for r in reqs:
            if r.finish_reason is None:
                r.cancel()
        sch.wake()
    if metrics:
        metrics.requests.labels("chat" if shape.chat else "completions", "200").inc()
    with_lp = reqs[0].logprobs is not None
    return shape.whole(texts, finishes, [shape.logprobs(x) if with_lp else None for x in lps],
                       _usage(reqs, n_prompts), why)


async def _sse(shape, reqs, queue, sch, started, include_usage, metrics, n_prompts):
    n = len(reqs)
    timer = _Timer(metrics, started, n)
    left = n
    streams = [shape.stream() for _ in range(n)] if shape.chat else None
    outcome = "499"         # (nginx's "client closed request") until the answer is whole
    try:
        if shape.chat:
            for i in range(n):
                yield shape.chunk(i, role=True)
        while left:
            index, ev = await queue.get()
            if ev.token is not None:
                timer.token(index)
            lp = shape.logprobs([ev.logprob]) if ev.logprob is not None else None
            if streams is not None:
                deltas = streams[index].feed(ev.text or "", final=ev.finish is not None)
                for k, d in enumerate(deltas):
                    yield shape.chunk(index, delta=d, logprobs=lp if k == 0 else None)
                if lp and not deltas:
                    yield shape.chunk(index, delta={}, logprobs=lp)
            elif ev.text or lp:
                yield shape.chunk(index, text=ev.text, logprobs=lp)
            if ev.finish is not None:
                left -= 1
                if ev.finish == "error":
                    outcome = "500"
                    yield "data: " + json.dumps(errors.body(500, f"generation failed: {ev.error}", None,
                                                            "generation_error")) + "\n\n"
                    return
                finish = _finish_reason(ev.finish)
                if streams is not None and streams[index].calls:
                    finish = "tool_calls"
                yield shape.chunk(index, finish=finish, stop_reason=ev.stop_reason)
        if include_usage:
            yield shape.usage_chunk(_usage(reqs, n_prompts))
        outcome = "200"
        yield "data: [DONE]\n\n"
    finally:        # the client went away (the response task is cancelled) or we are done
        if metrics:
            metrics.requests.labels("chat" if shape.chat else "completions", outcome).inc()
        for r in reqs:
            if r.finish_reason is None:
                r.cancel()
        sch.wake()
