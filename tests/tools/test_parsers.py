"""The tool-call parsers against recorded outputs written from each format's documentation, fed
token by token (the default model's real tokenizer), in multi-token chunks and whole; each way must
give the same calls, the same content, and argument fragments that concatenate to the JSON."""

from __future__ import annotations

import json

import pytest

from edgellm.tools.parsers import Args, CallEnd, CallStart, Content, HermesParser, JsonArrayParser
from tests.helpers.tool_streams import pieces, run

TWO_CALLS = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "서울", '
             '"note": "say \\"hi\\" {not a brace}"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}'
             '\n</tool_call>')
HERMES = [
    (TWO_CALLS, "I will check both.",
     [("get_weather", {"city": "서울", "note": 'say "hi" {not a brace}'}), ("now", {})]),
    ('<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),  # no arguments key: {}
    ('<tool_call>\n{"arguments": {"q": [1, {"a": "}"}]}, "name": "search"}\n</tool_call>', "",
     [("search", {"q": [1, {"a": "}"}]})]),  # arguments before the name
    ("No tools needed: 3 < 4 and <b>bold</b>.", "No tools needed: 3 < 4 and <b>bold</b>.", []),
    ('<tool_call>not json</tool_call> then text', '<tool_call>not json</tool_call> then text', []),
    ('<tool_call>{"name": "f", "arguments": {"n": 1}}</tool_call>\nDone.', "Done.", [("f", {"n": 1})]),
]


@pytest.fixture(scope="module")
def tok():
    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path(), "gguf")


@pytest.mark.parametrize("how", ["tokens", "chunks", "whole"])
@pytest.mark.parametrize("case", range(len(HERMES)))
def test_hermes(tok, how, case):
    text, content, calls = HERMES[case]
    parser = HermesParser()
    events = run(parser, pieces(tok, text, how))
    assert "".join(e.text for e in events if isinstance(e, Content)).strip() == content
    assert [n for n, _ in parser.calls] == [n for n, _ in calls]
    for (_, args), (_, want) in zip(parser.calls, calls):
        assert json.loads(args) == want
    # event order: a call's start, then its fragments, then its end; fragments join to its arguments
    for i, (name, args) in enumerate(parser.calls):
        mine = [e for e in events if getattr(e, "index", None) == i]
        assert isinstance(mine[0], CallStart) and mine[0].name == name and isinstance(mine[-1], CallEnd)
        assert "".join(e.text for e in mine if isinstance(e, Args)) == args


def test_hermes_holds_back_only_what_may_be_a_tag():
    p = HermesParser()
    assert p.feed("Hello <tool") == [Content("Hello")]  # " <tool" may be the space before a call
    assert p.feed("kit is here") == [Content(" <toolkit is here")]
    assert p.feed("\n\n") == []  # whitespace: held until something follows
    assert p.feed("x") == [Content("\n\nx")]


@pytest.mark.parametrize("how", ["tokens", "chunks", "whole"])
def test_json_array(tok, how):
    text = '[{"name": "a", "arguments": {"x": [1, {"y": "]}"}]}}, {"name": "b", "arguments": {}}]'
    parser = JsonArrayParser()
    run(parser, pieces(tok, text, how))
    assert [(n, json.loads(a)) for n, a in parser.calls] == [("a", {"x": [1, {"y": "]}"}]}), ("b", {})]
