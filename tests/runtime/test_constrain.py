"""Constrained output (runtime/constrain.py): JSON schemas of real-world shape on real models, greedy and
sampled, every output parsed and validated with jsonschema; Lark, GBNF and regex outputs matched; compile
errors that say where; a speculative draft under a constraint changes nothing (greedy); the mask kernel
against a numpy reference.  Models load once per module; answers are short."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from runtime.chat_template import encode_chat
from runtime.constrain import Constraint, ConstraintError, Matcher, apply_mask, full_mask, mask_words
from runtime.engine import Engine
from runtime.generate import Generation
from runtime.sampling import SamplingParams

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "constrain"
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1234)


# (name, what the prompt asks for, schema): the shapes APIs return -- nested objects, arrays with
# minItems/maxItems, enums, anyOf/oneOf/$ref, string formats and patterns, number ranges, optional fields.
# Strings carry a maxLength so that every answer fits max_tokens (the benchmark reads the same file).
SCHEMAS = [(d["name"], d["prompt"], d["schema"])
           for d in json.loads((FIXTURES / "schemas.json").read_text(encoding="utf-8"))]
assert len(SCHEMAS) >= 30
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def smol(model_path):
    return Engine(str(model_path("smollm2-135m")), n_ctx=1024, threads=1)


@pytest.fixture(scope="module")
def qwen(model_path):
    return Engine(str(model_path("qwen2.5-coder-0.5b")), n_ctx=1024, threads=1)


def _run(eng, ids, params, max_tokens, constraint, drafter=None) -> Generation:
    """One answer; its sequence released after (the engines are shared by the module)."""
    gen = Generation(eng, ids, params, max_tokens=max_tokens, constraint=constraint, drafter=drafter)
    try:
        return gen.run()
    finally:
        if gen.seq is not None:
            eng.release(gen.seq)
        if drafter is not None:
            drafter.release()


def _prompt(eng, what, schema=None):
    text = f"Reply with JSON only: {what}."
    return encode_chat(eng.tokenizer, None, [{"role": "user", "content": text}], arch=eng.config.arch)


def _check_json(gen, schema):
    assert gen.stats.stop_reason == "stop", (gen.stats.stop_reason, gen.text)
    value = json.loads(gen.text)
    jsonschema.validate(value, schema, format_checker=CHECKER)
    assert not re.search(r"\s{2,}|\n", gen.text), gen.text       # whitespace bounded
    return value


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name,what,schema", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_json_schema_smollm(smol, name, what, schema, params):
    c = Constraint.json_schema(schema, smol)
    gen = _run(smol, _prompt(smol, what), params, 160, c)
    _check_json(gen, schema)


QWEN_SCHEMAS = ["customer", "nested_array_objects", "oneof_shape", "event_date", "employee", "ref_defs"]


@pytest.mark.parametrize("name", QWEN_SCHEMAS)
def test_json_schema_qwen(qwen, name):
    _, what, schema = next(s for s in SCHEMAS if s[0] == name)
    c = Constraint.json_schema(schema, qwen)
    gen = _run(qwen, _prompt(qwen, what), GREEDY, 160, c)
    _check_json(gen, schema)


def test_json_object_any(smol):
    gen = _run(smol, _prompt(smol, "a user profile"), SAMPLED, 120, Constraint.json_object(smol))
    if gen.stats.stop_reason == "stop":
        assert isinstance(json.loads(gen.text), dict)
    else:       # free-form strings may run to max_tokens: max_tokens wins, never more
        assert gen.stats.stop_reason == "length" and len(gen.ids) == 120 and gen.text.startswith("{")


def test_schema_cache_and_matchers_independent(smol):
    schema = SCHEMAS[0][2]
    a = Constraint.json_schema(schema, smol)
    assert Constraint.json_schema(json.dumps(schema), smol) is a          # cached by the schema's text
    m1, m2 = a.matcher(), a.matcher()
    for t in smol.tokenizer.encode('{"name', add_bos=False):
        assert m1.consume(t)
    row1, row2 = np.zeros(a.n_words, np.uint32), np.zeros(a.n_words, np.uint32)
    m1.fill_mask(row1)
    m2.fill_mask(row2)
    assert not np.array_equal(row1, row2)


# ---- grammars and regexes ---------------------------------------------------------------------------------
def test_gbnf_file(smol):
    c = Constraint.gbnf((FIXTURES / "shopping_list.gbnf").read_text(), smol)
    ids = smol.tokenizer.encode("Write a shopping list.\n", add_bos=False)
    for params in (GREEDY, SAMPLED):
        gen = _run(smol, ids, params, 60, c)
        assert gen.stats.stop_reason in ("stop", "eos"), gen.stats.stop_reason
        name = "(apples|bread|milk|eggs|rice|cheese)"
        assert re.fullmatch(rf"Shopping list:\n(- [1-9][0-9]? {name}\n){{1,3}}", gen.text), gen.text


def test_lark_file(smol):
    c = Constraint.lark((FIXTURES / "answer.lark").read_text(), smol)
    p = _prompt(smol, "is the sky blue? answer yes/no/maybe and why")
    for params in (GREEDY, SAMPLED):
        gen = _run(smol, p, params, 40, c)
        assert gen.stats.stop_reason == "stop", (gen.stats.stop_reason, gen.text)
        assert re.fullmatch(r"(yes|no|maybe): [A-Za-z ,]{1,40}\.", gen.text), gen.text


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[0-9]{3}-[0-9]{4}",
                                     r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
                                     r"(red|green|blue)(, (red|green|blue)){2}"])
def test_regex(smol, pattern):
    c = Constraint.regex(pattern, smol)
    gen = _run(smol, _prompt(smol, "one example"), SAMPLED, 30, c)
    assert gen.stats.stop_reason == "stop", (gen.stats.stop_reason, gen.text)
    assert re.fullmatch(pattern, gen.text), gen.text


def test_grammar_detects_gbnf_or_lark(smol):
    assert Constraint.grammar('root ::= "a" | "b"', smol).kind == "gbnf"
    assert Constraint.grammar('start: "a" | "b"', smol).kind == "lark"


@pytest.mark.parametrize("build,text,expect", [
    ("lark", 'start: foo\nfoo: "a" bar\n', r"Lark grammar: at 2\(\d+\): unknown name: \"bar\""),
    ("gbnf", 'root ::= "a" item\n', r"GBNF grammar.*'item'"),
    ("gbnf", 'root ::= "a\n', r"GBNF grammar"),
    ("regex", "a(b", r"regex: .*unclosed group"),
    ("json_schema", '{"type": "objekt"}', r"JSON schema: .*objekt"),
    ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}', r"missing"),
    ("json_schema", '{"type": "object",', r"not valid JSON: .*line 1 column"),
    ("json_schema", '{"type": "string", "format": "no-such-format"}', r"no-such-format"),
])
def test_compile_errors_say_where(smol, build, text, expect):
    with pytest.raises(ConstraintError) as e:
        getattr(Constraint, build)(text, smol)
    assert re.search(expect, str(e.value), re.S), str(e.value)
    assert isinstance(e.value, ValueError)          # the server answers 400


def test_dead_matcher_ends_cleanly(smol):
    m = Constraint.regex("[0-9]+", smol).matcher()
    assert not m.consume(smol.tokenizer.encode("hello", add_bos=False)[0])
    assert m.dead and "hello" in m.error
    gen = _run(smol, _prompt(smol, "a number"), GREEDY, 20, m)
    assert gen.ids == [] and gen.stats.stop_reason == "constraint" and gen.stats.constraint_error


def test_matcher_masks_rollback_and_draft_rows(smol):
    c = Constraint.json_schema(SCHEMAS[2][2], smol)
    ids = smol.tokenizer.encode('{"street": "1 Main St", "city": "Paris"', add_bos=False)
    rows = np.zeros((len(ids) + 1, c.n_words + 3), np.uint32)      # wider rows: the tail is zeroed
    m = c.matcher()
    assert m.fill_masks(rows, ids) == len(ids) + 1 and m.n_consumed == 0
    row = np.zeros(c.n_words, np.uint32)
    seq = c.matcher()
    for k in range(len(ids) + 1):
        seq.fill_mask(row)
        assert np.array_equal(rows[k, :c.n_words], row) and not rows[k, c.n_words:].any(), k
        if k < len(ids):
            assert seq.consume(ids[k])
    seq.rollback(len(ids) - 2)
    seq.fill_mask(row)
    assert np.array_equal(row, rows[2, :c.n_words])
    bad = list(ids[:3]) + [smol.tokenizer.encode("}", add_bos=False)[0]] + list(ids[4:])
    assert m.fill_masks(rows, bad) == 4 and not rows[4:].any()        # stops at the disallowed draft


# ---- speculative decoding under a constraint ------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_draft(model_path, smol):
    from runtime.speculative import Drafter
    return Drafter(Engine(str(model_path("smollm2-135m")), n_ctx=1024, threads=1), smol, k=4, adaptive=False)


@pytest.mark.parametrize("name", ["customer", "nested_array_objects", "weather"])
def test_speculative_greedy_equals_plain(smol, smol_draft, name):
    _, what, schema = next(s for s in SCHEMAS if s[0] == name)
    c = Constraint.json_schema(schema, smol)
    p = _prompt(smol, what)
    plain = _run(smol, p, GREEDY, 120, c)
    spec = _run(smol, p, GREEDY, 120, c, smol_draft)
    assert spec.ids == plain.ids and spec.stats.stop_reason == plain.stats.stop_reason == "stop"
    assert spec.stats.speculative["drafted"] > 0
    _check_json(spec, schema)


def test_speculative_cut_draft_vocab_and_sampling(model_path, smol):
    from runtime.speculative import Drafter
    d = Drafter(Engine(str(model_path("smollm2-135m")), n_ctx=1024, threads=1), smol, k=3, adaptive=False,
                draft_vocab=4096)
    c = Constraint.regex(r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", smol)
    p = _prompt(smol, "a date")
    plain = _run(smol, p, GREEDY, 30, c)
    spec = _run(smol, p, GREEDY, 30, c, d)
    assert spec.ids == plain.ids
    schema = next(s for s in SCHEMAS if s[0] == "recipe")[2]
    gen = _run(smol, _prompt(smol, "a recipe"), SAMPLED, 160, Constraint.json_schema(schema, smol), d)
    _check_json(gen, schema)


# ---- the mask kernel -------------------------------------------------------------------------------------------
def _reference(logits, bitmask):
    out = logits.copy()
    V = logits.shape[1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :V]
    allowed = np.zeros(logits.shape, bool)
    allowed[:, :bits.shape[1]] = bits.astype(bool)
    out[~allowed] = -np.inf
    return out


@pytest.mark.parametrize("V,B,words", [(49152, 1, None), (151936, 3, None), (100, 2, None), (33, 1, None),
                                       (1000, 2, 20)])
def test_apply_mask_matches_numpy(V, B, words):
    rng = np.random.default_rng(V + B)
    W = words or mask_words(V)
    logits = rng.standard_normal((B, V)).astype(np.float32)
    mask = rng.integers(0, 2 ** 32, (B, W), dtype=np.uint64).astype(np.uint32)
    mask[:, 0] = 0xFFFFFFFF
    mask[:, -1] = 0
    if W > 2:
        mask[0, 1] = 0xFFFFFFFF
    want = _reference(logits, mask)
    got = logits.copy()
    assert apply_mask(got, mask) is got
    np.testing.assert_array_equal(got, want)
    one = logits[0].copy()                           # one row, 1-D
    apply_mask(one, mask[0])
    np.testing.assert_array_equal(one, want[0])
    same = logits.copy()
    apply_mask(same, full_mask(V, B))
    np.testing.assert_array_equal(same, logits)


@pytest.mark.gpu
def test_apply_mask_cupy():
    import cupy as cp
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 151936)).astype(np.float32)
    mask = rng.integers(0, 2 ** 32, (3, mask_words(151936)), dtype=np.uint64).astype(np.uint32)
    d = cp.asarray(logits)
    apply_mask(d, cp.asarray(mask))
    np.testing.assert_array_equal(cp.asnumpy(d), _reference(logits, mask))


# ---- the CLI -----------------------------------------------------------------------------------------------------
def test_cli_generate_json_schema(model_path, capsys):
    from runtime.cli import main
    schema = FIXTURES / "person.schema.json"
    rc = main(["generate", "-m", str(model_path("smollm2-135m")), "-p", "A person as JSON: ", "-n", "40",
               "--temp", "0", "--json-schema", str(schema), "--json", "-c", "256", "-t", "1"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    jsonschema.validate(json.loads(out["text"]), json.loads(schema.read_text()))
    assert out["stop_reason"] == "stop"
    rc = main(["generate", "-m", str(model_path("smollm2-135m")), "-p", "x", "--regex", "a(b", "-c", "256", "-t", "1"])
    assert rc == 1 and "unclosed group" in capsys.readouterr().err


def test_time_strings_bounded(smol):
    c = Constraint.json_schema({"type": "string", "format": "date-time"}, smol)
    ok = '"2021-02-20T08:26:12.123456789+05:30"'
    runaway = '"2021-02-20T08:26:12.' + "7" * 40 + 'Z"'
    for text, want in ((ok, True), (runaway, False)):
        m = c.matcher()
        assert (all(m.consume(t) for t in smol.tokenizer.encode(text, add_bos=False)) and m.is_accepting()) == want


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_cuda_mask_kernel_compiles(arch):
    """The CuPy kernel's source compiles with NVRTC (no GPU needed; its results: test_apply_mask_cupy)."""
    import ctypes
    from runtime.constrain import MASK_KERNEL_SOURCE
    nvrtc = pytest.importorskip("nvidia.cuda_nvrtc")
    libs = sorted((Path(list(nvrtc.__path__)[0]) / "lib").glob("libnvrtc.so*"))
    if not libs:
        pytest.skip("NVRTC wheel without its library")
    lib = ctypes.CDLL(str(libs[0]))
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), MASK_KERNEL_SOURCE.encode(), b"mask.cu", 0, None, None) == 0
    try:
        opts = (ctypes.c_char_p * 1)(f"-arch={arch}".encode())
        rc = lib.nvrtcCompileProgram(prog, 1, opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_masked_argmax_equals_argmax_of_masked_logits(smol):
    """Greedy under a constraint takes the argmax where the logits are (Engine.step(argmax=True,
    masks=...)): each step's token equals np.argmax of the step's logits masked on the host, for a
    two-sequence step (one row constrained, one all ones) as the scheduler sends it."""
    c = Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}}, smol)
    ids = _prompt(smol, "an object with a number n")
    a, b = smol.new_sequence(), smol.new_sequence()
    try:
        la, lb = smol.prefill(a, ids), smol.prefill(b, ids)
        m = c.matcher()
        row = np.zeros(m.n_words, np.uint32)
        ta = tb = int(np.argmax(la))
        asked = []
        for _ in range(6):
            assert m.fill_mask(row)
            masks = np.stack([row, np.full_like(row, 0xFFFFFFFF)])
            state = [len(a), len(b)]
            logits = smol.step([a, b], [[ta], [tb]])
            want = np.argmax(apply_mask(logits.copy(), masks), axis=-1)
            for s, n in zip((a, b), state):
                smol.cache.truncate(s, n)
            got = smol.step([a, b], [[ta], [tb]], argmax=True, masks=lambda: asked.append(1) or masks)
            assert list(got) == list(want)
            assert m.consume(int(got[0]))
            ta, tb = int(got[0]), int(got[1])
        assert len(asked) == 6
        assert m.fill_mask(row) and row.any()
    finally:
        smol.release(a)
        smol.release(b)
