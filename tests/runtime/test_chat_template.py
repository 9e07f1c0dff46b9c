"""Chat templates: the real files' templates render as transformers renders them, the built-in fallbacks
are the known formats (and llama.cpp's), BOS is never doubled, and hostile templates fail cleanly."""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from runtime.chat_template import (CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplateError, builtin_template,
                                   encode_chat, prompt_needs_bos, render_chat)
from runtime.tokenizer import Tokenizer


def _load_refs():
    name = "llamba_tokenizer_refs"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer" / "refs.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


refs = _load_refs()


@pytest.fixture(scope="module")
def model(model_path):
    """name -> (path, metadata, Tokenizer), loaded once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            try:
                path = str(model_path(name))
            except Exception as e:
                pytest.skip(f"model {name} unavailable: {e}")
            md = refs.metadata(path)
            cache[name] = (path, md, Tokenizer.from_gguf(md))
        return cache[name]
    return get


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": "\nok\n"},
     {"role": "user", "content": "日本語 🎉 <b>tags</b> {{ not jinja }}"}],
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\": 22}"},
]


# ----------------------------------------------------------------------------------------------------------------
# real templates vs transformers


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_file_template_matches_transformers(model, name):
    path, md, tok = model(name)
    template = md["tokenizer.chat_template"]
    hft = refs.hf_tokenizer(path)
    assert hft.chat_template == template
    for conv in CONVERSATIONS:
        for agp in (True, False):
            ours = render_chat(template, conv, bos_token=tok.bos_token, eos_token=tok.eos_token,
                               add_generation_prompt=agp)
            theirs = hft.apply_chat_template(conv, tokenize=False, add_generation_prompt=agp)
            assert ours == theirs
            # and the ids: transformers tokenizes the rendered text without adding special tokens
            assert encode_chat(tok, template, conv, add_generation_prompt=agp) == \
                hft.encode(theirs, add_special_tokens=False)


def test_qwen_tools_template_matches_transformers(model):
    path, md, tok = model("qwen2.5-coder-0.5b")
    template = md["tokenizer.chat_template"]
    hft = refs.hf_tokenizer(path)
    ours = render_chat(template, TOOL_CHAT, bos_token=tok.bos_token, eos_token=tok.eos_token, tools=TOOLS)
    theirs = hft.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"name": "get_weather"' in ours and "<tool_call>" in ours


def test_qwen_template_ids(model):
    _, md, tok = model("qwen2.5-coder-1.5b")
    ids = encode_chat(tok, None, [{"role": "user", "content": "hi"}])
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert ids[0] == im_start and ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------------------------------------
# built-in fallbacks


def test_gemma_fallback_is_the_gemma_format(model):
    _, md, tok = model("gemma3-270m")
    assert md.get("tokenizer.chat_template") is None          # this file carries none
    conv = CONVERSATIONS[1]
    text = render_chat(None, conv, bos_token=tok.bos_token, eos_token=tok.eos_token, arch="gemma3")
    assert text == ("<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    no_prompt = render_chat(None, conv, bos_token="<bos>", eos_token="<eos>", arch="gemma3",
                            add_generation_prompt=False)
    assert no_prompt == text[:-len("<start_of_turn>model\n")]
    ids = encode_chat(tok, None, conv, arch="gemma3")
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id          # no double BOS
    assert ids[1] == tok.token_to_id("<start_of_turn>")
    assert ids[-3:] == tok.encode("<start_of_turn>model\n", add_bos=False)
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat(None, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                    bos_token="<bos>", eos_token="<eos>", arch="gemma3")


@pytest.mark.parametrize("fmt,arch", [("gemma", "gemma3"), ("chatml", "llama")])
def test_fallbacks_match_llama_cpp_builtins(fmt, arch):
    """Our fallbacks render as llama.cpp's built-in `gemma` / `chatml` formats (less Gemma's leading BOS,
    which llama.cpp adds while tokenizing)."""
    ref = refs.chat_builtin()
    expected = iter(ref["rendered"][fmt])
    for conv in ref["conversations"]:
        for agp in (True, False):
            want = next(expected)
            assert want["add_generation_prompt"] == agp
            got = render_chat(None, conv, bos_token="<bos>", eos_token="<eos>", arch=arch,
                              add_generation_prompt=agp)
            if fmt == "gemma":
                assert got.startswith("<bos>")
                got = got[len("<bos>"):]
            assert got == want["text"]


def test_builtin_template_choice():
    assert builtin_template("gemma3") is GEMMA_TEMPLATE
    assert builtin_template("gemma2") is GEMMA_TEMPLATE
    assert builtin_template("llama") is CHATML_TEMPLATE
    assert builtin_template(None) is CHATML_TEMPLATE
    text = render_chat("", [{"role": "user", "content": [{"type": "text", "text": "multi"},
                                                         {"type": "image"}]}],
                       bos_token="", eos_token="")
    assert text == "<|im_start|>user\nmulti<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------------------------------------------
# BOS handling


def test_bos_is_added_once(model):
    _, _, gemma = model("gemma3-270m")
    _, _, smol = model("smollm2-135m")
    with_bos = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    without = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    conv = [{"role": "user", "content": "hi"}]
    # model wants BOS (gemma): a template that writes it does not get a second one, one that does not gets it
    assert prompt_needs_bos(gemma, "<bos>hi") is False
    assert prompt_needs_bos(gemma, "hi") is True
    a = encode_chat(gemma, with_bos, conv)
    b = encode_chat(gemma, without, conv)
    assert a == b == [gemma.bos_id] + gemma.encode("hi", add_bos=False)
    # model does not want BOS (smollm2): nothing added; a template writing it keeps its own
    assert prompt_needs_bos(smol, "hi") is False
    assert encode_chat(smol, without, conv) == smol.encode("hi", add_bos=False)
    assert encode_chat(smol, with_bos, conv)[0] == smol.bos_id


# ----------------------------------------------------------------------------------------------------------------
# what transformers' environment offers


def test_template_environment_features():
    conv = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "x"}]
    tmpl = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
            "|{{ strftime_now('%Y') | length }}|{% generation %}G{% endgeneration %}"
            "|{% set ns = namespace(n=0) %}{% for i in range(3) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"
            "|{{ dict(a=1) | tojson }}|{{ extra_var }}")
    out = render_chat(tmpl, conv, bos_token="", eos_token="", extra_var="E")
    assert out == '{"role": "user", "content": "héllo"}|4|G|3|{"a": 1}|E'
    # trim_blocks / lstrip_blocks as transformers sets them
    assert render_chat("  {% if true %}\nA\n  {% endif %}\nB", conv, bos_token="", eos_token="") == "A\nB"
    with pytest.raises(ChatTemplateError, match="custom message"):
        render_chat("{{ raise_exception('custom message') }}", conv, bos_token="", eos_token="")
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat("{% for %}", conv, bos_token="", eos_token="")
    with pytest.raises(ValueError, match="role"):
        render_chat(None, [{"content": "no role"}], bos_token="", eos_token="")


def test_large_conversation_renders_within_budget(model):
    _, md, tok = model("qwen2.5-coder-0.5b")
    conv = []
    for i in range(1000):
        conv += [{"role": "user", "content": f"question {i} " * 20}, {"role": "assistant", "content": "ok " * 50}]
    t = time.perf_counter()
    text = render_chat(md["tokenizer.chat_template"], conv, bos_token=tok.bos_token, eos_token=tok.eos_token)
    assert time.perf_counter() - t < 5
    assert text.count("<|im_start|>") == 2002


# ----------------------------------------------------------------------------------------------------------------
# hostile templates


HOSTILE = {
    "dunder attribute": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "dunder on data": "{{ messages.__class__ }}",
    "globals via cycler": "{{ cycler.__init__.__globals__.os.system('touch /tmp/llamba-pwned') }}",
    "self reference": "{{ self.__init__.__globals__ }}",
    "function internals": "{{ raise_exception.__globals__ }}",
    "mutating a list": "{% set x = [] %}{{ x.append(1) }}",
    "namespace dunder": "{% set ns = namespace(__class__=1) %}",
    "nested huge loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "loop over data squared": "{% for m in messages * 3000 %}{% for n in messages * 3000 %}{% endfor %}{% endfor %}",
    "huge range": "{% for i in range(10**9) %}{% endfor %}",
    "string repeat": "{{ 'a' * 1000000000 }}",
    "doubling with ~": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s | length }}",
    "doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}",
    "big power": "{{ 7 ** 100000000 }}",
    "center width": "{{ 'x' | center(1000000000) }}",
    "percent width": "{{ '%0999999999d' % 1 }}",
    "format width": "{{ '{:>99999999999}'.format(1) }}",
    "replace amplification": "{{ ('a' * 100000) | replace('', 'b' * 1000) }}",
    "method replace amplification": "{{ ('a' * 100000).replace('a', 'b' * 1000) }}",
    "infinite recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "lipsum": "{{ lipsum(1000000) }}",
}


@pytest.mark.parametrize("label", list(HOSTILE))
def test_hostile_template_fails_cleanly(label):
    marker = Path("/tmp/llamba-pwned")
    marker.unlink(missing_ok=True)
    t = time.perf_counter()
    with pytest.raises(ChatTemplateError) as info:
        render_chat(HOSTILE[label], [{"role": "user", "content": "hi"}], bos_token="<s>", eos_token="</s>")
    assert time.perf_counter() - t < 15
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("chat template")
    assert not marker.exists()
