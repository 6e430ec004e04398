"""The model families' tool-call parsers (llama3_json, mistral, pythonic) against recorded outputs
written from each family's documented format, fed a character at a time, token by token (the
default model's tokenizer), in multi-token chunks and whole: every way must give the same calls,
the same content and the same open call, with argument fragments that join to the arguments."""

from __future__ import annotations

import ast
import json

import pytest

from edgellm.tools.events import Args, CallEnd, CallStart, Content
from edgellm.tools.families import PARSERS
from edgellm.tools.pyliteral import KwargsToJson
from tests.helpers.tool_streams import pieces, run

HOW = ["chars", "tokens", "chunks", "whole"]
NOTE = 'say "hi" {not a brace} [nor this]'

# (output text, its content, [(name, arguments value)], a call left open)
LLAMA3 = [
    ('{"name": "get_time", "parameters": {}}', "", [("get_time", {})], False),
    ('{"name": "search", "parameters": {"query": "서울 날씨", "note": "say \\"hi\\" {not a brace} [nor this]"}}',
     "", [("search", {"query": "서울 날씨", "note": NOTE})], False),
    (('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Seoul", "days": 3}}; '
     '{"name": "get_time", "arguments": {"tz": "Asia/Seoul"}}'), "",
     [("get_weather", {"city": "Seoul", "days": 3}), ("get_time", {"tz": "Asia/Seoul"})], False),
    ('The capital of Korea is Seoul. Use {braces} freely; "quotes" too.',
     'The capital of Korea is Seoul. Use {braces} freely; "quotes" too.', [], False),
    ('Let me look that up.<|python_tag|>{"name": "search", "parameters": {"query": "부산"}}',
     "Let me look that up.", [("search", {"query": "부산"})], False),
    ('{"answer": 42, "unit": "m"} is the JSON you asked for.',
     '{"answer": 42, "unit": "m"} is the JSON you asked for.', [], False),
    ('{"name": "f", "parameters": {"x": [1, {"y": "}"}]}}\nDone.', "Done.", [("f", {"x": [1, {"y": "}"}]})], False),
    ('{"name": "get_weather", "parameters": {"city": "Seo', "", [], True),
]

MISTRAL = [
    (('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "서울", "note": "say \\"hi\\" {not a brace} '
     '[nor this]"}}, {"name": "get_time", "arguments": {}}]'), "",
     [("get_weather", {"city": "서울", "note": NOTE}), ("get_time", {})], False),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Seoul", "days": 3}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Seoul", "days": 3}), ("get_time", {})], False),
    ('Checking the weather now. [TOOL_CALLS]get_weather[ARGS]{"city": "부산", "q": "a \\"b\\" }"}',
     "Checking the weather now.", [("get_weather", {"city": "부산", "q": 'a "b" }'})], False),
    ('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "", [("get_time", {})], False),
    ('[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}', "", [("get_time", {})], False),
    ('[{"name": "get_time", "arguments": {}}]', "", [("get_time", {})], False),  # special tokens skipped
    ('Sure! In Python, [x for x in range(3)] builds a list; {"a": 1} is a dict.',
     'Sure! In Python, [x for x in range(3)] builds a list; {"a": 1} is a dict.', [], False),
    ('[1, 2, 3] are the first numbers.', '[1, 2, 3] are the first numbers.', [], False),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Se', "", [], True),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci', "", [], True),
]

# (output text, its content, the Python source of its call list or None, a call left open)
PYTHONIC = [
    ('[get_weather(city="Seoul", days=3), get_time()]', "", '[get_weather(city="Seoul", days=3), get_time()]',
     False),
    (r"""[search(query='say "hi" {not a brace} [nor this]', note="it's \"quoted\"\n", path='C:\\temp\x41\101')]""",
     "", r"""[search(query='say "hi" {not a brace} [nor this]', note="it's \"quoted\"\n", path='C:\\temp\x41\101')]""",
     False),
    ("[get_weather(city='서울', unit=\"섭씨\")]", "", "[get_weather(city='서울', unit=\"섭씨\")]", False),
    (('[book(people=4, time="19:30", extras={"chair": True, "notes": None, "tags": ["window", \'quiet\'], '
     '1: -2.5e-3, "n": [[], {}, 0x1F, 1_000]}, ok=False)]'), "",
     ('[book(people=4, time="19:30", extras={"chair": True, "notes": None, "tags": ["window", \'quiet\'], '
     '1: -2.5e-3, "n": [[], {}, 0x1F, 1_000]}, ok=False)]'), False),
    ('Let me check that for you.\n[get_weather(city="Seoul")]', "Let me check that for you.",
     '[get_weather(city="Seoul")]', False),
    ('[\n  get_weather(city="Seoul",),\n  get_time(),\n]\nDone.', "Done.",
     '[get_weather(city="Seoul",), get_time()]', False),
    ("[1] The first item.\nSee [the docs](https://x.y) and f(x=1) in text.\n[note] and [see](this)",
     "[1] The first item.\nSee [the docs](https://x.y) and f(x=1) in text.\n[note] and [see](this)", None, False),
    ('[get_weather(city="Seo', "", None, True),
]


def check(parser, events, content, calls, open_call):
    assert "".join(e.text for e in events if isinstance(e, Content)).strip() == content
    assert parser.content.strip() == content
    assert [n for n, _ in parser.calls] == [n for n, _ in calls]
    for (_, args), (_, want) in zip(parser.calls, calls):
        assert json.loads(args) == want
    assert parser.open_call is open_call
    # a call's start (with its name), then its fragments, then its end; the fragments join to its
    # arguments
    for i, (name, args) in enumerate(parser.calls):
        mine = [e for e in events if getattr(e, "index", None) == i]
        assert isinstance(mine[0], CallStart) and mine[0].name == name and isinstance(mine[-1], CallEnd)
        assert sum(isinstance(e, CallStart) for e in mine) == 1
        assert "".join(e.text for e in mine if isinstance(e, Args)) == args


def feed_all(tok, name, text, how):
    parser = PARSERS[name]()
    chunks = list(text) if how == "chars" else pieces(tok, text, how)
    return parser, run(parser, chunks)


@pytest.fixture(scope="module")
def tok():
    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path(), "gguf")


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("case", range(len(LLAMA3)))
def test_llama3_json(tok, how, case):
    text, content, calls, open_call = LLAMA3[case]
    parser, events = feed_all(tok, "llama3_json", text, how)
    check(parser, events, content, calls, open_call)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("case", range(len(MISTRAL)))
def test_mistral(tok, how, case):
    text, content, calls, open_call = MISTRAL[case]
    parser, events = feed_all(tok, "mistral", text, how)
    check(parser, events, content, calls, open_call)


def python_calls(source):
    """The reference: each call's name and json.dumps of its keyword values, by Python itself."""
    tree = ast.parse(source, mode="eval").body
    assert isinstance(tree, ast.List)
    return [(c.func.id, json.dumps({k.arg: ast.literal_eval(k.value) for k in c.keywords}, ensure_ascii=False))
            for c in tree.elts]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("case", range(len(PYTHONIC)))
def test_pythonic(tok, how, case):
    text, content, source, open_call = PYTHONIC[case]
    want = python_calls(source) if source else []
    parser, events = feed_all(tok, "pythonic", text, how)
    check(parser, events, content, [(n, json.loads(a)) for n, a in want], open_call)
    assert parser.calls == want  # the JSON text itself, not only its value


def test_every_way_gives_the_same_result(tok):
    for name, cases in (("llama3_json", LLAMA3), ("mistral", MISTRAL), ("pythonic", PYTHONIC)):
        for text, *_ in cases:
            seen = set()
            for how in HOW:
                parser, _ = feed_all(tok, name, text, how)
                seen.add((tuple(parser.calls), parser.content, parser.open_call, parser.broken))
            assert len(seen) == 1, (name, text, seen)


# Calls written without arguments, in each format: the arguments are "{}" exactly, [(name, ...)]
NO_ARGUMENTS = [
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', ["get_time"]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>\n<tool_call>{"name": "now"}</tool_call>',
     ["get_time", "now"]),
    ("llama3_json", '{"name": "get_time"}', ["get_time"]),
    ("llama3_json", '<|python_tag|>{"name": "get_time"}; {"name": "now", "parameters": {}}', ["get_time", "now"]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time"}, {"name": "now"}]', ["get_time", "now"]),
    ("mistral", '[{"name": "get_time"}]', ["get_time"]),  # special tokens skipped
    ("mistral", "[TOOL_CALLS]get_time[ARGS]{}", ["get_time"]),
    ("pythonic", "[get_time(), now()]", ["get_time", "now"]),
]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("case", range(len(NO_ARGUMENTS)))
def test_a_call_without_arguments_gets_an_empty_object(tok, how, case):
    name, text, names = NO_ARGUMENTS[case]
    parser, events = feed_all(tok, name, text, how)
    assert parser.calls == [(n, "{}") for n in names] and parser.content == ""
    for i in range(len(names)):
        assert "".join(e.text for e in events if isinstance(e, Args) and e.index == i) == "{}"


def test_text_that_may_open_a_call_is_held_back_only_that_long():
    p = PARSERS["mistral"]()
    assert p.feed("Hello [TOOL") == [Content("Hello")]
    assert p.feed("S] and more") == [Content(" [TOOLS] and more")]
    p = PARSERS["llama3_json"]()
    assert p.feed("  ") == []  # may be the whitespace before a call
    assert p.feed('{"name": "f", ') == [CallStart(0, "f")]
    p = PARSERS["pythonic"]()
    assert p.feed("Look:\n[get_weather(") == [Content("Look:")]  # not yet known to be a call
    assert p.feed("city=") == [CallStart(0, "get_weather"), Args(0, '{"city": ')]


@pytest.mark.parametrize("bad", ["f(1)", "x=foo", "x=g()", "x=(1, 2)", "x={1, 2}", "x=1 # c", 'x=r"a"',
                                 "x=1j", "x=True=", "x=[1 2]", "x={'a' 1}", "x='a\nb'"])
def test_pythonic_arguments_that_are_not_literals_are_refused(bad):
    conv = KwargsToJson()
    with pytest.raises(ValueError):
        for ch in bad[2:] if bad.startswith("f(") else bad + ")":
            conv.feed(ch)
