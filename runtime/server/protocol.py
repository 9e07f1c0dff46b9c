"""The request bodies the server accepts, as pydantic models with hard ranges.

Every field is typed strictly (a string is not a number), NaN and infinities are refused,
and a field we do not know is refused with a 400 that names it: a client that asks for
something we would not do hears so, instead of getting an answer that silently ignored it.
"""
from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

MAX_N = 16                  # choices a request
MAX_STOP = 8                # stop strings a request
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 4096
MAX_TOKEN_ID = 1 << 31

Text = Annotated[str, StringConstraints(max_length=1 << 24)]
StopWord = Annotated[str, StringConstraints(min_length=1, max_length=512)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """Fields shared by chat and text completions."""
    model: str | None = Field(None, max_length=512)
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)
    stop: Union[StopWord, list[StopWord], None] = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)      # an end-user id: only logged by OpenAI too

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class JSONSchemaSpec(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = Field(None, max_length=4096)
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class Constrained(Strict):
    """Output constraints: OpenAI's response_format, and llama.cpp-style extensions."""
    response_format: ResponseFormat | None = None
    grammar: Text | None = None          # a Lark grammar (llguidance dialect) or a GBNF grammar
    regex: Annotated[str, StringConstraints(max_length=1 << 16)] | None = None


class FunctionDef(Strict):
    name: str = Field(max_length=64)
    description: str | None = Field(None, max_length=1 << 16)
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Strict):
    name: str = Field(max_length=64)


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ToolCallFunction(Strict):
    name: str = Field(max_length=256)
    arguments: Text


class ToolCall(Strict):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[TextPart], None] = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, max_length=256)
    reasoning_content: Text | None = None        # an earlier answer's reasoning, as we sent it

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(Sampling, Constrained):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(None, ge=1, le=1 << 20)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # llama-server's extensions: where the reasoning goes ("none": left in content), and
    # variables for the chat template (Qwen3's enable_thinking, gpt-oss's reasoning_effort)
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None
    chat_template_kwargs: dict | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        if v is None:
            return v
        if len(v) > 32:
            raise ValueError("at most 32 chat_template_kwargs")
        for k in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", k):
                raise ValueError(f"chat_template_kwargs key {k[:80]!r} is not a name")
            if k in RESERVED_TEMPLATE_NAMES:
                raise ValueError(f"chat_template_kwargs cannot set {k!r}: the server sets it")
        return v


# what the server itself hands a chat template
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                     "raise_exception", "strftime_now", "tojson", "arch", "template",
                                     "tokenizer"})


class CompletionRequest(Sampling, Constrained):
    prompt: Union[Text, list[Text], list[Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)]]] = Field(...)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False             # echoing the prompt back is not supported
    best_of: Literal[1] | None = None        # only one candidate a choice

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and len(v) > MAX_N and isinstance(v[0], str):
            raise ValueError(f"at most {MAX_N} prompts a request")
        return v


class TokenizeRequest(Strict):
    content: Text
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    tokens: list[Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)]] = Field(max_length=1 << 20)
