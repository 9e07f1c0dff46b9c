"""Chat templates: messages -> prompt text -> token ids.

A model file carries its chat template as Jinja source (`tokenizer.chat_template`).  We render it the way
Hugging Face transformers does (`apply_chat_template`: trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `tojson`, `strftime_now`), in jinja2's immutable sandbox, because the template comes
from a downloaded file and is untrusted.  On top of the sandbox (which stops attribute tricks such as
`''.__class__`), every render runs under a budget: loop iterations, calls and wall time are counted, and
operations that could blow up memory (`'x' * n`, `a ~ a` doubling, `**`, huge widths, `replace`
amplification) are checked before they run.  Anything the sandbox refuses becomes a `ChatTemplateError`
(a `ValueError`) with a message; a template never runs code.

Files without a template get a built-in one for their architecture (Gemma's turn format for the gemma
family, ChatML otherwise).

`encode_chat` turns messages into ids the way llama.cpp's server does: a template that writes the BOS
text itself (`{{ bos_token }}...`) does not get a second BOS from the tokenizer.
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Mapping
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat", "encode_chat", "builtin_template", "prompt_needs_bos", "ChatTemplateError",
           "GEMMA_TEMPLATE", "CHATML_TEMPLATE"]


class ChatTemplateError(ValueError):
    """The chat template could not be rendered: a syntax error, an exception the template raised on purpose
    (e.g. roles that do not alternate), or something the sandbox refused."""


# Limits for one render.  Generous for real conversations (thousands of messages, megabytes of text: far
# more than any context window), small
# enough that a hostile template fails in well under a second or two.
MAX_STEPS = 2_000_000         # loop iterations + calls + checked operations
MAX_SECONDS = 10.0            # wall time
MAX_STRING = 8_000_000        # characters in any string (or items in any list) an operation produces
MAX_OUTPUT = 16_000_000       # characters of rendered output
MAX_INT_ARG = 10_000_000      # largest integer passed to a call or filter (widths, counts, ranges)
MAX_RANGE = 100_000           # items in one range()

# ---------------------------------------------------------------------------------------------------------------
# Built-in templates

GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
"""Gemma's own template (Gemma 3): turns are `<start_of_turn>user|model ... <end_of_turn>`; a system
prompt is folded into the first user turn; the text starts with the BOS token."""

CHATML_TEMPLATE = """{%- for message in messages -%}
    {{- '<|im_start|>' + message['role'] + '\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- for item in message['content'] if item['type'] == 'text' -%}{{- item['text'] -}}{%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""
"""Generic ChatML (`<|im_start|>role\\n...<|im_end|>\\n`), for files that carry no template."""


def builtin_template(arch: str | None) -> str:
    """The template used when a model file has none: Gemma's format for the gemma family, else ChatML."""
    if arch and arch.lower().startswith("gemma"):
        return GEMMA_TEMPLATE
    return CHATML_TEMPLATE


# ---------------------------------------------------------------------------------------------------------------
# The sandbox


class _Budget:
    __slots__ = ("steps", "deadline", "output")

    def __init__(self):
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS
        self.output = 0


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("llamba_chat_budget", default=None)


def _tick(n: int = 1) -> None:
    b = _BUDGET.get()
    if b is None:
        return
    b.steps += n
    if b.steps > MAX_STEPS:
        raise SecurityError(f"chat template exceeded its budget of {MAX_STEPS} steps (runaway loop?)")
    if (b.steps & 1023) == 0 and time.monotonic() > b.deadline:
        raise SecurityError(f"chat template ran longer than {MAX_SECONDS:g} s")


def _size(x) -> int | None:
    if isinstance(x, (str, bytes, list, tuple)):
        return len(x)
    return None


def _check_size(n: int, what: str) -> None:
    if n > MAX_STRING:
        raise SecurityError(f"chat template tried to build a {what} of {n} items (limit {MAX_STRING})")


def _check_int(v, what: str) -> None:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_ARG:
        raise SecurityError(f"chat template passed {v} to {what} (limit {MAX_INT_ARG})")


_BIG_WIDTH = re.compile(r"\d{8,}")


def _check_format_string(fmt, what: str) -> None:
    if isinstance(fmt, str) and ("%" in fmt or "{" in fmt):
        for m in _BIG_WIDTH.finditer(fmt):
            if int(m.group()) > MAX_INT_ARG:
                raise SecurityError(f"chat template used a format width of {m.group()} in {what}")


def _check_replace(s, old, new, count=-1) -> None:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return
    if len(new) <= len(old):
        return
    hits = (len(s) + 1) if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    _check_size(len(s) + hits * (len(new) - len(old)), "string (replace)")


def _checked_concat(items) -> str:
    parts = [str(x) for x in items]
    _check_size(sum(len(p) for p in parts), "string (~)")
    _tick()
    return "".join(parts)


def _safe_range(*args):
    for a in args:
        _check_int(a, "range()")
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise SecurityError(f"chat template asked for range() of {len(r)} items (limit {MAX_RANGE})")
    return r


def _loop_budget(iterable):
    """Wraps the iterable of every {% for %}: each iteration costs one step."""
    try:
        n = len(iterable)
    except Exception:
        n = None
    if n is not None and n > MAX_STEPS:
        raise SecurityError(f"chat template loops over {n} items (limit {MAX_STEPS})")
    return _counted(iterable)


def _counted(iterable):
    for item in iterable:
        _tick()
        yield item


class _CodeGen(CodeGenerator):
    def visit_Concat(self, node, frame):   # `a ~ b`: checked, so `{% set s = s ~ s %}` cannot double forever
        self.write("environment.llamba_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    """`dict(...)` for templates, without handing them the `dict` type itself (as transformers does)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attribute names."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat template may not set the attribute {name!r} on a namespace")


class _ChatSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _CodeGen
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "llamba_loop_budget", [], [], None, None, lineno=loop.lineno)
        return tree

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) is not None and isinstance(n, int):
                    _check_size(len(seq) * max(n, 0), "repeated string/list")
            if isinstance(left, int) and isinstance(right, int) and \
                    abs(left).bit_length() + abs(right).bit_length() > 4096:
                raise SecurityError("chat template multiplied integers that are too large")
        elif operator == "**":
            if isinstance(right, (int, float)) and isinstance(left, (int, float)) and abs(right) > 256 \
                    and abs(left) > 1:
                raise SecurityError(f"chat template computed a power with exponent {right}")
        elif operator == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None:
                _check_size(a + b, "string/list (+)")
        elif operator == "%":
            _check_format_string(left, "'%' formatting")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):   # noqa: N805 - jinja's signature
        _tick()
        for v in args:
            _check_int(v, "a call")
        for v in kwargs.values():
            _check_int(v, "a call")
        target = getattr(__obj, "__self__", None)
        if isinstance(target, str) and getattr(__obj, "__name__", "") == "replace" and len(args) >= 2:
            _check_replace(target, *args[:3])
        return super().call(__context, __obj, *args, **kwargs)

    def unsafe_undefined(self, obj, attribute):
        # jinja returns an Undefined that only fails when used (so `{{ x.__class__ }}` prints nothing);
        # refuse at once so the user sees why the template is rejected
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def wrap_str_format(self, value):
        f_self = getattr(value, "__self__", None)
        if isinstance(f_self, str) and getattr(value, "__name__", "") in ("format", "format_map"):
            _check_format_string(f_self, "str.format")
        return super().wrap_str_format(value)

    llamba_concat = staticmethod(_checked_concat)


def _guard_filter(name, fn):
    skip = 2 if getattr(fn, "jinja_pass_arg", None) is not None else 1   # context/eval_ctx, then the value

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        _tick()
        for v in args[skip:]:
            _check_int(v, f"the {name!r} filter")
        for v in kwargs.values():
            _check_int(v, f"the {name!r} filter")
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                                       jinja2.Environment))]
        if name == "format" and values:
            _check_format_string(values[0], "the 'format' filter")
        elif name == "replace" and len(values) >= 3:
            _check_replace(str(values[0]), *[str(v) for v in values[1:3]],
                           *(v for v in values[3:4] if isinstance(v, int)))
        elif name == "indent" and values:
            width = kwargs.get("width", values[1] if len(values) > 1 else 4)
            w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            _check_size(len(str(values[0])) + str(values[0]).count("\n") * w, "string (indent)")
        return fn(*args, **kwargs)
    return guarded


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping, JSON options exposed
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> _ChatSandbox:
    env = _ChatSandbox(trim_blocks=True, lstrip_blocks=True,
                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    for name, fn in list(env.filters.items()):
        env.filters[name] = _guard_filter(name, fn)
    env.filters["llamba_loop_budget"] = _loop_budget
    env.globals.pop("lipsum", None)
    env.globals["range"] = _safe_range
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str):
    try:
        return _environment().from_string(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template rejected by the sandbox: {e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template is nested too deeply") from None


def _plain(value, depth=0):
    """Message data as plain JSON-like values, so the template sees nothing but dicts, lists and scalars."""
    if depth > 64:
        raise ValueError("chat messages are nested too deeply")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if hasattr(value, "model_dump"):            # pydantic models
        return _plain(value.model_dump(), depth + 1)
    return str(value)


# ---------------------------------------------------------------------------------------------------------------
# API


def render_chat(template: str | None, messages: list[dict], *, bos_token: str, eos_token: str,
                add_generation_prompt: bool = True, arch: str | None = None, **extra) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with `template` (Jinja source from the model
    file; None or empty -> the built-in template for `arch`).  `extra` reaches the template as variables
    (tools=..., documents=..., enable_thinking=..., other special tokens ...), as in transformers.

    Raises ChatTemplateError (a ValueError) for syntax errors, template-raised exceptions and anything the
    sandbox refuses.
    """
    if not template:
        template = builtin_template(arch)
    if not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    msgs = _plain(list(messages))
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"each chat message must be a dict with a 'role' string, got {m!r:.80}")
    compiled = _compile(template)
    context = {k: _plain(v) for k, v in extra.items()}
    context.update(messages=msgs, bos_token=bos_token, eos_token=eos_token,
                   add_generation_prompt=bool(add_generation_prompt))
    budget = _Budget()
    token = _BUDGET.set(budget)
    try:
        out = []
        for piece in compiled.generate(**context):
            budget.output += len(piece)
            if budget.output > MAX_OUTPUT:
                raise SecurityError(f"chat template output exceeded {MAX_OUTPUT} characters")
            out.append(piece)
        return "".join(out)
    except SecurityError as e:
        raise ChatTemplateError(f"chat template rejected by the sandbox: {e}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e.message or e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError("chat template ran out of memory") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)


def prompt_needs_bos(tokenizer, text: str) -> bool:
    """Whether encoding `text` should add the tokenizer's BOS: yes if the model wants one and the text does
    not already start with the BOS token's text (llama.cpp avoids a double BOS the same way)."""
    bos = tokenizer.bos_token if tokenizer.bos_id is not None else ""
    return bool(tokenizer.add_bos) and not (bos and text.startswith(bos))


def encode_chat(tokenizer, template: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
                arch: str | None = None, **extra) -> list[int]:
    """Ids of the rendered chat.  template=None uses the tokenizer's own template (from the model file),
    then the built-in one for `arch`.  Special tokens in the rendered text are parsed; BOS is added only
    when the model wants one and the template did not already write it.  No EOS is appended: this is a
    prompt to continue."""
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
    text = render_chat(template, messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                       add_generation_prompt=add_generation_prompt, arch=arch, **extra)
    ids = tokenizer.encode(text, add_bos=False, parse_special=True)
    if prompt_needs_bos(tokenizer, text):
        ids.insert(0, tokenizer.bos_id)
    return ids
