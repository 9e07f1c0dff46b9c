"""gpt-oss's text side: the o200k pre-tokenizer, token ids and end-of-generation tokens
against Hugging Face `tokenizers` (o200k_harmony itself is not on this machine: a small
byte-level BPE trained here with its regex and harmony's special tokens stands in), the
harmony chat template through our sandbox against transformers' rendering, and the
reasoning (the analysis channel) apart from the answer (runtime/reasoning.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from runtime import reasoning
from runtime.tokenizer import _PRE, Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))
from tiny_models import HARMONY_SPECIALS as SPECIALS, O200K, make_harmony  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"
HARMONY_ANSWER = ("<|channel|>analysis<|message|>The user says hi. Reply briefly.<|end|><|start|>assistant"
                  "<|channel|>final<|message|>Hi! How can I help?")


def _texts():
    texts = json.loads((FIXTURES / "pre_variants.json").read_text())["texts"]
    return texts + ["it'ſ", "DON'ſT", "İ'S", "K'K", "a/b\r\n/c", "x  \n\n y", "<|start|>user<|message|>Hi<|end|>"]


def test_o200k_split_is_tokenizers_own():
    """Our gpt-4o pre-tokenizer is o200k's regex as tokenizer.json writes it (the contractions
    case-insensitive, Unicode case folds too) and splits as `tokenizers` does."""
    from tokenizers import Regex, pre_tokenizers

    from quant.convert import bpe_pre_name
    assert "".join(_PRE["gpt-4o"][0]) == O200K
    ref = pre_tokenizers.Split(Regex(O200K), behavior="isolated")
    ours = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE["gpt-4o"][0]])
    for t in _texts():
        assert [p for p, _ in ours.pre_tokenize_str(t)] == [p for p, _ in ref.pre_tokenize_str(t)], repr(t)
    assert [p for p, _ in ours.pre_tokenize_str("it'ſ")] == ["it'ſ"]        # (llama.cpp: "it", "'ſ")
    # our converter names it as llama.cpp does
    assert bpe_pre_name({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": O200K}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}) == "gpt-4o"


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """The tiny gpt-oss checkpoint with its o200k-style tokenizer (tiny_models.make_harmony)."""
    return make_harmony(tmp_path_factory.mktemp("harmony") / "ck", _texts())


def _check_ids(tok, hf, what):
    for t in _texts() + [HARMONY_ANSWER]:
        assert tok.encode(t, add_bos=False) == hf.encode(t, add_special_tokens=False).ids, (what, t)
        assert tok.decode(tok.encode(t, add_bos=False)) == t, (what, t)


def test_ids_and_stops_from_the_folder_and_the_gguf(harmony, tmp_path):
    """Token ids equal `tokenizers`' from the folder and from the GGUF our converter writes
    (tokenizer.ggml.pre "gpt-4o"); generation ends at <|return|>, <|call|>, <|endoftext|>
    and goes on after <|end|> (the end of the reasoning message), from either."""
    from quant.convert import convert
    from runtime.gguf_file import GGUFFile
    d, hf, ids, _ = harmony
    folder = Tokenizer.from_hf_files(d)
    _check_ids(folder, hf, "folder")
    path = convert(d, tmp_path / "h.gguf", "f16", progress=False)["path"]
    assert GGUFFile(path).metadata["tokenizer.ggml.pre"] == "gpt-4o"
    gguf = Tokenizer.from_gguf(GGUFFile(path).metadata)
    _check_ids(gguf, hf, "gguf")
    want = {ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]}
    assert want <= folder.stop_ids and want <= gguf.stop_ids
    assert ids["<|end|>"] not in folder.stop_ids and ids["<|end|>"] not in gguf.stop_ids


CONVERSATION = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4.", "thinking": "Simple arithmetic."},
    {"role": "user", "content": "And 3 + 3?"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "Its name"},
                                               "unit": {"type": "string", "enum": ["C", "F"]}},
                                               "required": ["city"]}}}]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_harmony_template_renders_as_transformers(harmony, tools):
    """gpt-oss's template (macros, namespaces, tojson, strftime_now) through our sandbox
    gives transformers' text and ids; an earlier answer's reasoning is dropped, as harmony
    wants; the prompt ends in the answer's header."""
    from transformers import AutoTokenizer

    from runtime.chat_template import encode_chat, render_chat
    d, _, _, template = harmony
    if template is None:
        pytest.skip("llama.cpp's test templates could not be fetched (pip download llama-cpp-python sdist failed)")
    ref = AutoTokenizer.from_pretrained(d).apply_chat_template(CONVERSATION, tools=tools, tokenize=False,
                                                                add_generation_prompt=True)
    tok = Tokenizer.from_hf_files(d)
    extra = {"tools": tools} if tools else {}
    ours = render_chat(template.read_text(), CONVERSATION, bos_token=tok.bos_token, eos_token=tok.eos_token,
                       add_generation_prompt=True, **extra)
    assert ours == ref
    assert ours.endswith("<|start|>assistant") and "Simple arithmetic" not in ours
    assert "<|channel|>final<|message|>4.<|end|>" in ours
    assert encode_chat(tok, template.read_text(), CONVERSATION, **extra) == tok.encode(ref, add_bos=False)


# ---- reasoning apart from the answer ---------------------------------------------------------------------------

def test_harmony_answer_splits_into_reasoning_and_answer_as_it_streams():
    """Every prefix of a streamed answer: the reasoning and the answer shown so far are
    prefixes of the whole ones, no marker (nor half of one) is shown, and the bubble is
    'thinking' from the first marker until the final channel opens."""
    whole = reasoning.split(HARMONY_ANSWER)
    assert (whole.reasoning, whole.answer, whole.thinking) == ("The user says hi. Reply briefly.",
                                                               "Hi! How can I help?", False)
    opened = HARMONY_ANSWER.index("final<|message|>") + len("final<|message|>")
    for k in range(len(HARMONY_ANSWER) + 1):
        p = reasoning.split(HARMONY_ANSWER[:k])
        assert whole.reasoning.startswith(p.reasoning) and whole.answer.startswith(p.answer), k
        assert "<|" not in p.reasoning + p.answer and not (p.reasoning + p.answer).endswith("<"), k
        assert p.thinking == (len("<|channel|>") <= k < opened), k
    # a tool call (a message to a recipient) is neither reasoning nor answer: a call, whole at its <|call|>
    call = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
            "<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Paris\"}")
    p = reasoning.split(call)
    assert (p.reasoning, p.answer, p.calls) == ("Need the weather.", "", [("functions.get_weather", '{"city": "Paris"}',
                                                                           False)])
    assert reasoning.split(call + "<|call|>").calls == [("functions.get_weather", '{"city": "Paris"}', True)]
    # a model that writes no channels at all: its text is the answer, nothing is lost
    assert reasoning.split("just text").answer == "just text"
    assert reasoning.for_template("just text") == {"content": "just text"}
    assert reasoning.for_template(HARMONY_ANSWER) == {"content": "Hi! How can I help?",
                                                      "reasoning_content": "The user says hi. Reply briefly.",
                                                      "thinking": "The user says hi. Reply briefly."}


def test_deltas_give_each_piece_its_share():
    """Fed a token's text at a time, Deltas hands out the reasoning and the answer exactly once."""
    for text in (HARMONY_ANSWER, "<think>\nLet me see.\n</think>\n\nSure.", "plain", "<", "<thi", "a <|chan"):
        d, r, a = reasoning.Deltas(), "", ""
        for k in range(0, len(text), 3):
            dr, da = d.feed(text[k:k + 3])
            r, a = r + dr, a + da
        dr, da = d.finish()          # (a tail that looked like a marker's start was text)
        r, a = r + dr, a + da
        whole = reasoning.split(text, final=True)
        assert (r, a) == (whole.reasoning, whole.answer)
        assert r + a == text or whole.format, text


def test_think_tags_split_and_an_opened_tag():
    p = reasoning.split("<think>\nLet me see.\n</think>\n\nSure.")
    assert (p.reasoning, p.answer, p.thinking, p.format) == ("Let me see.", "Sure.", False, "think")
    assert reasoning.split("<think>\nstill going</th").thinking
    assert reasoning.split("<think>\nstill going</th").reasoning == "still going"
    assert reasoning.opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not reasoning.opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.opens_reasoning("<|im_start|>assistant\n")


def test_chat_session_gives_the_template_answers_without_their_reasoning(harmony):
    """A ChatSession on the tiny gpt-oss: an earlier answer as the model wrote it (channels
    and all) reaches gpt-oss's template as content + thinking, so the template (which
    refuses channel markers in content) renders it, without its reasoning; a new answer
    streams after the prompt's `<|start|>assistant`."""
    from runtime.chat import ChatSession
    from runtime.engine import Engine
    from runtime.loader import load_model
    d, _, _, template = harmony
    if template is None:
        pytest.skip("llama.cpp's test templates could not be fetched")
    eng = Engine(load_model(d), n_ctx=512)
    s = ChatSession(eng, system="Be brief.", max_tokens=4)
    s.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": HARMONY_ANSWER}]
    s.messages.append({"role": "user", "content": "and then?"})
    text = eng.tokenizer.decode(s.prompt_ids())
    assert "<|channel|>final<|message|>Hi! How can I help?<|end|>" in text
    assert "The user says hi" not in text and text.endswith("<|start|>assistant")
    s.messages.pop()
    out = "".join(s.send("and then?"))
    assert s.messages[-1] == {"role": "assistant", "content": out} and s.last_stats.generated_tokens >= 1


def test_chat_session_marks_an_answer_its_template_opened_in_reasoning(harmony):
    """A template that opens <think> in the prompt (Qwen3-Thinking's, DeepSeek-R1's): the
    answer, stored and streamed, begins with the tag, so the app and the next turn's template
    see where the reasoning ends."""
    from runtime.chat import ChatSession
    from runtime.engine import Engine
    from runtime.loader import load_model
    d, _, _, _ = harmony
    lm = load_model(d)
    lm.chat_template = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                        "{% if add_generation_prompt %}<|start|>assistant<|message|><think>\n{% endif %}")
    s = ChatSession(Engine(lm, n_ctx=256), max_tokens=3)
    pieces = list(s.send("hi"))
    assert pieces[0] == "<think>" and s.messages[-1]["content"].startswith("<think>")
    assert reasoning.split(s.messages[-1]["content"]).format == "think"
