"""Structured outputs below the engine: the constraint spec and its schema checks, and the grammar
service (xgrammar over the default model's real tokenizer) driving random logits, so that every
output the masks allow is checked against the constraint, for 20 random schemas."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from edgellm.structured import StructuredOutputError, StructuredOutputs
from edgellm.structured.grammar import GrammarService
from tests.helpers.structured_schemas import schemas


@pytest.fixture(scope="module")
def tok():
    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path(), "gguf")


@pytest.fixture(scope="module")
def service(tok):
    svc = GrammarService(tok.hf, 49152, tok.eos_token_ids)
    yield svc
    svc.shutdown()


def drive(service, tok, spec, seed, max_tokens=200, scale=4.0) -> tuple[str, bool]:
    """Greedy over random logits under the grammar: (text, ended by the grammar's stop token)."""
    matcher = service.matcher(service.compile(spec))
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = torch.randn(3, service.vocab_size, generator=gen) * scale
        service.mask(logits, [matcher], [1])  # row 1 of a 3-row batch: the others stay untouched
        assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
        token = int(logits[1].argmax())
        assert matcher.accept(token)
        if token in tok.eos_token_ids:
            return tok.decode(out), True
        out.append(token)
    return tok.decode(out), False


@pytest.mark.parametrize("index", range(20))
def test_random_schema_outputs_validate(service, tok, index):
    schema = schemas(20, seed=1234)[index]
    spec = StructuredOutputs(json=schema)
    for seed in range(2):
        text, ended = drive(service, tok, spec, seed)
        assert ended, text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_choice_grammar(service, tok):
    text, ended = drive(service, tok, StructuredOutputs(json_object=True), 0)
    assert ended and isinstance(json.loads(text), dict)
    for seed in range(4):
        text, ended = drive(service, tok, StructuredOutputs(regex=r"[a-c]{2}-\d{1,3}"), seed)
        assert ended and re.fullmatch(r"[a-c]{2}-\d{1,3}", text), text
        choices = ["yes", "no", 'say "hi"\n', "서울"]
        text, ended = drive(service, tok, StructuredOutputs(choice=choices), seed)
        assert ended and text in choices, text
        text, ended = drive(service, tok, StructuredOutputs(grammar='root ::= "x" [0-9]+ "y"'), seed, max_tokens=60)
        assert re.fullmatch(r"x[0-9]+y", text) if ended else re.fullmatch(r"x[0-9]+", text), text


def test_compiled_once_and_off_the_callers_thread(service):
    spec = StructuredOutputs(json={"type": "object", "properties": {"q": {"type": "integer"}}})
    seen = []
    orig = service._compile
    service._compile = lambda s: (seen.append(threading.current_thread().name), orig(s))[1]
    try:
        first = service.compile(StructuredOutputs(json=json.dumps(spec.json)))  # same schema, as text
        again = service.compile(spec)
    finally:
        service._compile = orig
    assert first is again and len(seen) == 1 and seen[0].startswith("edgellm-grammar")


@pytest.mark.parametrize("kwargs, words", [
    ({"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}, ["'not'", "#/properties/a"]),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, ["'uniqueItems'"]),
    ({"json": {"allOf": [{"type": "integer"}]}}, ["'allOf'"]),
    ({"json": {"type": "strnig"}}, ["invalid JSON schema"]),
    ({"json": "{not json"}, ["not valid JSON"]),
    ({"json": [1, 2]}, ["must be an object"]),
    ({"choice": []}, ["choice"]),
    ({"regex": ""}, ["regex"]),
    ({}, ["exactly one"]),
    ({"regex": "a", "choice": ["b"]}, ["exactly one"]),
])
def test_bad_constraints_are_refused_naming_the_problem(kwargs, words):
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutputs(**kwargs, source="response_format")
    assert info.value.param == "response_format"
    for w in words:
        assert w in str(info.value)


def test_uncompilable_regex_and_grammar_fail_cleanly(service):
    for spec in (StructuredOutputs(regex="(unclosed"), StructuredOutputs(grammar="root ::= undefined_rule")):
        with pytest.raises(StructuredOutputError, match="cannot compile"):
            service.compile(spec)
    # a failed compilation is not cached: the service still works
    assert service.compile(StructuredOutputs(regex="ok")) is not None
