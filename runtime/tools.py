"""Tool calls (OpenAI-style `tools`), engine side: pure functions, no HTTP.

* `encode_with_tools(tokenizer, template, messages, tools)`: the prompt.  A template that takes `tools`
  (Qwen2.5, Llama 3.1+, Mistral, Hermes) renders them itself; others get a Hermes-style system prompt.
  Assistant messages with `tool_calls` and `tool` results are normalized first (arguments as objects, as
  the templates expect them).
* `detect_format(template)`: how the model writes a call: "hermes" (`<tool_call>{json}</tool_call>`, Qwen2.5),
  "llama3" (`{"name": .., "parameters": ..}`, maybe after `<|python_tag|>`), "mistral" (`[TOOL_CALLS][..]`),
  "harmony" (gpt-oss: a commentary message `to=functions.NAME`, read by runtime/reasoning.py); anything else is "generic" (Hermes tags, as our fallback prompt asks, plus a bare JSON object).
* `parse_tool_calls(text)` -> (content, [ToolCall]); `ToolCallParser` does the same incrementally while
  streaming and yields OpenAI-style deltas (`{"content": ..}` / `{"tool_calls": [{"index", "id",
  "function": {"name", "arguments"}}]}`); arguments stream as their raw JSON text.
* `tool_constraint(tools, tool_choice, tok, fmt)`: "required" or a named function constrain the whole answer
  to calls whose arguments satisfy the function's `parameters` schema; "auto" is a lazy grammar: free text
  until the model opens a call (`<tool_call>`), then the call is constrained; "none" -> None.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .constrain import JSON_OPTIONS, Constraint

__all__ = ["ToolCall", "ToolCallParser", "parse_tool_calls", "normalize_tools", "detect_format",
           "encode_with_tools", "prepare_messages", "tool_constraint", "tool_prompt", "FORMATS"]

FORMATS = ("hermes", "llama3", "mistral", "harmony", "generic")
_OPENERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
_CLOSERS = ("</tool_call>",)


@dataclass
class ToolCall:
    name: str
    arguments: str                    # JSON text of the arguments object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# ---- tools and messages ----------------------------------------------------------------------------------------
def normalize_tools(tools) -> list[dict]:
    """OpenAI `tools` checked and normalized to [{"type": "function", "function": {"name", "description",
    "parameters"}}]; a bare {"name", "parameters"} is accepted too.  ValueError names what is wrong."""
    out = []
    names = set()
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict):
            raise ValueError(f"tools[{i}] must be an object")
        if t.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type must be 'function', got {t.get('type')!r}")
        f = t.get("function", t if "name" in t else None)
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", f["name"]):
            raise ValueError(f"tools[{i}].function.name {f['name']!r}: use letters, digits, _ . - (at most 64)")
        if f["name"] in names:
            raise ValueError(f"tools[{i}]: function {f['name']!r} is declared twice")
        names.add(f["name"])
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        fn = {"name": f["name"], "description": f.get("description") or "", "parameters": params}
        out.append({"type": "function", "function": fn})
    return out


def detect_format(template: str | None) -> str:
    """The tool-call format a chat template teaches its model."""
    t = template or ""
    if "<|channel|>" in t:
        return "harmony"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        return "llama3"
    return "generic"


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


def tool_prompt(tools: list[dict]) -> str:
    """The Hermes-style system prompt for models whose template knows no tools."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def _args_obj(a):
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def prepare_messages(messages: list[dict], tools: list[dict] | None, template: str | None) -> tuple[list, dict]:
    """(messages, extra template variables) for `encode_chat`.  Tool-call arguments become objects; a
    template without tools gets them in its system message and calls/results as plain text."""
    tools = normalize_tools(tools) if tools else []
    native = template_takes_tools(template)
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if calls:
            norm = []
            for c in calls:
                f = c.get("function", c)
                norm.append({"id": c.get("id"), "type": "function",
                             "function": {"name": f.get("name"), "arguments": _args_obj(f.get("arguments", {}))}})
            m["tool_calls"] = norm
            if not native:
                text = "".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                              "arguments": c["function"]["arguments"]},
                                                             ensure_ascii=False) + "\n</tool_call>" for c in norm)
                m = {"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text}
        elif m.get("role") == "tool" and not native:
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    extra = {}
    if tools:
        if native:
            extra["tools"] = tools
        else:
            prompt = tool_prompt(tools)
            if out and out[0].get("role") == "system":
                out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prompt}")
            else:
                out.insert(0, {"role": "system", "content": prompt})
    return out, extra


def encode_with_tools(tokenizer, template: str | None, messages: list[dict], tools: list[dict] | None = None,
                      *, add_generation_prompt: bool = True, arch: str | None = None, **extra) -> list[int]:
    """Prompt ids of a chat with tools (template None: the tokenizer's own)."""
    from .chat_template import encode_chat
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
    msgs, more = prepare_messages(messages, tools, template)
    return encode_chat(tokenizer, template, msgs, add_generation_prompt=add_generation_prompt, arch=arch,
                       **more, **extra)


# ---- the constraint ---------------------------------------------------------------------------------------------
def _call_schema(fn: dict, args_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: fn["parameters"]},
            "required": ["name", args_key], "additionalProperties": False}


def _chosen_functions(tools: list[dict], choice) -> list[dict]:
    """The functions a call may name: all of them, or the one `tool_choice` names."""
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    return fns


def _calls_schema(tools: list[dict], choice, args_key: str) -> dict:
    alts = [_call_schema(f, args_key) for f in _chosen_functions(tools, choice)]
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    return dict(schema, **{"x-guidance": JSON_OPTIONS})


def _special(tok, text: str) -> str | None:
    """`<[id]>` when `text` is one control token of the vocabulary (grammar syntax for a special token)."""
    t = getattr(tok, "tokenizer", tok)
    i = t.token_to_id(text) if hasattr(t, "token_to_id") else None
    return f"<[{i}]>" if i is not None and t.is_control(i) else None


def tool_grammar(tools, tool_choice, tok, fmt: str, parallel: bool = True) -> str | None:
    """The Lark grammar (llguidance dialect) for `tool_choice`; None for "none" or no tools."""
    tools = normalize_tools(tools)
    if not tools or tool_choice == "none":
        return None
    if tool_choice not in ("auto", "required", None) and not isinstance(tool_choice, dict):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}")
    auto = tool_choice in ("auto", None)
    if fmt == "harmony":
        return None if auto else _harmony_grammar(tools, tool_choice, tok)
    key = "parameters" if fmt == "llama3" else "arguments"
    body = "%json " + json.dumps(_calls_schema(tools, tool_choice, key), ensure_ascii=False)
    if fmt == "mistral":
        opener = _special(tok, "[TOOL_CALLS]") or json.dumps("[TOOL_CALLS]")
        arr = dict(_calls_schema(tools, tool_choice, key))
        arr.pop("x-guidance")
        arr = {"type": "array", "items": arr, "minItems": 1, "x-guidance": JSON_OPTIONS}
        if not parallel:
            arr["maxItems"] = 1
        calls = f"{opener} %json {json.dumps(arr, ensure_ascii=False)}"
        if auto:
            return f"%llguidance {{}}\nstart: TEXT | calls\ncalls: {calls}\nTEXT: /[^\\[](.|\\n)*/\n"
        return f"%llguidance {{}}\nstart: calls\ncalls: {calls}\n"
    if fmt == "llama3":
        tag = _special(tok, "<|python_tag|>")
        call = f"{tag + ' ' if tag else ''}call_json\ncall_json: {body}"
        if auto:
            return f"%llguidance {{}}\nstart: TEXT | call\ncall: {call}\nTEXT: /[^{{<](.|\\n)*/\n"
        return f"%llguidance {{}}\nstart: call\ncall: {call}\n"
    # hermes / generic: <tool_call>\n{json}\n</tool_call>
    call_tail = f'"\\n" call_json "\\n</tool_call>"\ncall_json: {body}'
    if auto:
        return ("%llguidance {}\n"
                f"start: call{'*' if parallel else '?'} tail\n"
                "tail: TEXT\n"
                "TEXT: /(.|\\n)*/\n"
                "call_open[lazy]: TEXT \"<tool_call>\"\n"
                f"call: call_open {call_tail}\n")
    return ("%llguidance {}\n"
            + ("start: call (\"\\n\" call)*\n" if parallel else "start: call\n")
            +
            f"call: \"<tool_call>\" {call_tail}\n")


def _harmony_grammar(tools, tool_choice, tok) -> str:
    """gpt-oss must call: its reasoning message (free text up to <|end|>) may come first, then
    `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}` and
    <|call|>.  Harmony answers "auto" in its own way (no constraint: runtime/reasoning.py reads it)."""
    vocab = getattr(tok, "tokenizer", tok)
    marks = {m: (f"<[{i}]>" if (i := vocab.token_to_id(m)) is not None else None)     # harmony's tokens, by id
             for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>")}
    missing = [m for m, g in marks.items() if g is None]
    if missing:
        raise ValueError(f"the vocabulary lacks harmony's {', '.join(missing)}")
    ch, msg, end, start, con, call = marks.values()
    fns = _chosen_functions(tools, tool_choice)
    alts = "\n".join(f'call{i}: {json.dumps("commentary to=functions." + f["name"] + " ")} {con} "json" {msg} '
                     f'%json {json.dumps(dict(f["parameters"], **{"x-guidance": JSON_OPTIONS}), ensure_ascii=False)}'
                     for i, f in enumerate(fns))
    return ("%llguidance {}\n"
            f"start: analysis? {ch} call {call}\n"
            f'analysis: {ch} "analysis" {msg} THOUGHT {end} {start} "assistant"\n'
            "THOUGHT: /(.|\\n)*/\n"
            f"call: {' | '.join(f'call{i}' for i in range(len(fns)))}\n{alts}\n")


def tool_constraint(tools, tool_choice, tok, fmt: str = "hermes", parallel: bool = True) -> Constraint | None:
    """A Constraint for the answer of a request with `tools` (None when nothing is constrained)."""
    g = tool_grammar(tools, tool_choice, tok, fmt, parallel)
    return None if g is None else Constraint.lark(g, tok)


# ---- parsing ----------------------------------------------------------------------------------------------------
class _Obj:
    """One JSON object being scanned: depth/strings tracked char by char, the top-level keys found, and
    where the arguments value starts and ends."""

    def __init__(self):
        self.text = ""
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.str_start = -1
        self.last_str = None          # the last complete string at depth 1 (a key if ':' follows)
        self.key = None               # the key whose value is being read at depth 1
        self.args_start = -1
        self.args_end = -1
        self.args_is_str = False
        self.done = False

    def feed(self, ch: str) -> None:
        i = len(self.text)
        self.text += ch
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 1 and self.key is None:
                    self.last_str = self.text[self.str_start:i + 1]
                elif self.depth == 1 and self.args_start >= 0 and self.args_end < 0 and self.args_is_str:
                    self.args_end = i + 1
            return
        if ch.isspace():
            return
        if self.depth == 1 and self.key is not None and self.args_start < 0 and self._is_args():
            self.args_start = i
            self.args_is_str = ch == '"'
        if ch == '"':
            self.in_str = True
            self.str_start = i
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.key is not None and self.args_start >= 0 and self.args_end < 0 \
                    and not self.args_is_str:
                self.args_end = i + 1
            if self.depth == 0:
                self._end_value(i)
                self.done = True
        elif ch == ":" and self.depth == 1:
            try:
                self.key = json.loads(self.last_str) if self.last_str else None
            except ValueError:
                self.key = None
            self.last_str = None
        elif ch == "," and self.depth == 1:
            self._end_value(i)
            self.key = None

    def _is_args(self) -> bool:
        return self.key in ("arguments", "parameters")

    def _end_value(self, i: int) -> None:
        if self.args_start >= 0 and self.args_end < 0:
            self.args_end = len(self.text[:i].rstrip())

    def name(self) -> str | None:
        m = re.match(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")', self.text) or \
            re.match(r'\s*\{\s*"type"\s*:\s*"function"\s*,\s*"function"\s*:\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")',
                     self.text)
        if m:
            try:
                return json.loads(m.group(1))
            except ValueError:
                return None
        return None

    def args_so_far(self) -> str:
        """The arguments' raw text seen so far (an object/array value streams; a string value waits)."""
        if self.args_start < 0 or self.args_is_str:
            return ""
        end = self.args_end if self.args_end >= 0 else len(self.text)
        return self.text[self.args_start:end]


class ToolCallParser:
    """Incremental tool-call parser.  `feed(text)` and `finish()` return OpenAI-style deltas:
    {"content": str} and {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]} (the first
    delta of a call carries id and name; later ones carry argument text).  After finish(): `.content`,
    `.calls` (complete ToolCall objects).  names: the declared functions; a JSON object naming another one is
    text, not a call."""

    def __init__(self, fmt: str = "generic", names=None):
        self.fmt = fmt
        self.names = set(names) if names is not None else None
        self.content = ""
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._mode = "text"
        self._obj: _Obj | None = None
        self._sent_args = 0
        self._named = False
        self._seen_text = False         # any non-space content yet (a bare JSON call must come first)

    # -- helpers
    def _emit_content(self, text: str, out: list) -> None:
        if text:
            self.content += text
            if text.strip():
                self._seen_text = True
            if out and "content" in out[-1]:
                out[-1]["content"] += text
            else:
                out.append({"content": text})

    def _bare_json_ok(self) -> bool:
        return self.fmt in ("llama3", "generic") and not self._seen_text

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        self._buf += text
        while self._buf:
            if self._mode == "text":
                if not self._text_step(out):
                    break
            elif not self._call_step(out):
                break
        return out

    def _text_step(self, out) -> bool:
        buf = self._buf
        hits = [(buf.find(o), o) for o in _OPENERS if o in buf]
        if self._bare_json_ok():
            j = len(buf) - len(buf.lstrip())
            if j < len(buf) and buf[j] == "{":
                self._emit_content(buf[:j], out)
                self._buf = buf[j:]
                self._mode = "calls"
                return True
            if j == len(buf):            # only whitespace so far: hold it
                return False
        if hits:
            i, o = min(hits)
            self._emit_content(buf[:i], out)
            self._buf = buf[i + len(o):]
            self._mode = "calls"
            return True
        keep = 0                          # a tail that could begin an opener
        for o in _OPENERS:
            for k in range(min(len(o) - 1, len(buf)), 0, -1):
                if buf.endswith(o[:k]):
                    keep = max(keep, k)
                    break
        self._emit_content(buf[:len(buf) - keep], out)
        self._buf = buf[len(buf) - keep:]
        return False

    def _call_step(self, out) -> bool:
        if self._obj is None:
            s = self._buf.lstrip(" \t\r\n[],;")
            if not s:
                self._buf = ""
                return False
            for c in _CLOSERS + _OPENERS:
                if s.startswith(c):
                    self._buf = s[len(c):]
                    if c in _CLOSERS:
                        self._mode = "text"
                    return True
                if c.startswith(s):
                    self._buf = s          # maybe a closer/opener: wait
                    return False
            if s[0] != "{":
                self._mode = "text"        # text after the calls
                self._buf = s
                return True
            self._buf = s
            self._obj = _Obj()
            self._sent_args = 0
            self._named = False
        obj = self._obj
        used = 0
        for ch in self._buf:
            obj.feed(ch)
            used += 1
            if obj.done:
                break
        self._buf = self._buf[used:]
        self._stream(out)
        if obj.done:
            self._finish_obj(out)
            return True
        return False

    def _delta(self, index: int, **function) -> dict:
        d = {"index": index, "function": function}
        return {"tool_calls": [d]}

    def _stream(self, out) -> None:
        obj = self._obj
        index = len(self.calls)
        if not self._named:
            name = obj.name()
            if name is None or (self.names is not None and name not in self.names):
                return
            self._named = True
            self._id = "call_" + uuid.uuid4().hex[:24]
            d = self._delta(index, name=name, arguments="")
            d["tool_calls"][0].update(id=self._id, type="function")
            out.append(d)
        args = obj.args_so_far()
        if len(args) > self._sent_args:
            out.append(self._delta(index, arguments=args[self._sent_args:]))
            self._sent_args = len(args)

    def _finish_obj(self, out) -> None:
        obj = self._obj
        self._obj = None
        try:
            data = json.loads(obj.text)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("function"), dict):
            data = data["function"]
        name = data.get("name") if isinstance(data, dict) else None
        if not isinstance(name, str) or (self.names is not None and name not in self.names):
            if self._named:          # announced but not a call after all: nothing sensible to undo
                return
            self._emit_content(obj.text, out)
            if self.fmt in ("llama3", "generic") and self._mode == "calls":
                self._mode = "text"
            return
        args = data.get("arguments", data.get("parameters", {}))
        if isinstance(args, str):
            text = args
        elif obj.args_start >= 0 and not obj.args_is_str:
            text = obj.text[obj.args_start:obj.args_end].strip()
        else:
            text = json.dumps(args, ensure_ascii=False)
        if not self._named:
            self._stream(out)
        rest = text[self._sent_args:] if text.startswith(obj.args_so_far()[:self._sent_args]) else ""
        if rest:
            out.append(self._delta(len(self.calls), arguments=rest))
        self.calls.append(ToolCall(name=name, arguments=text, id=self._id))

    def finish(self) -> list[dict]:
        """End of output: held-back text becomes content; an unfinished call's text too (its deltas, if any
        were sent, stay; it is not in .calls)."""
        out: list[dict] = []
        if self._obj is not None:
            if not self._named:
                self._emit_content(self._obj.text, out)
            self._obj = None
        self._emit_content(self._buf, out)
        self._buf = ""
        return out


def parse_tool_calls(text: str, fmt: str = "generic", tools=None) -> tuple[str, list[ToolCall]]:
    """(content without the calls, calls) of a finished answer.  Also finds a call written as a bare JSON
    object or in a ```json fence when no tagged call is present.  tools: the request's tools; a call to a
    function not among them stays text."""
    names = [t["function"]["name"] for t in normalize_tools(tools)] if tools else None
    p = ToolCallParser(fmt, names)
    p.feed(text)
    p.finish()
    if p.calls:
        return p.content.strip(), p.calls
    m = re.search(r"```(?:json)?\s*(\{.*?\})\s*```", text, re.S)
    if m:
        q = ToolCallParser("generic", names)
        q.feed(m.group(1))
        q.finish()
        if q.calls:
            return (text[:m.start()] + text[m.end():]).strip(), q.calls
    return text, []
