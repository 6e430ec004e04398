"""Tool calling and structured outputs over the API: `edgellm serve` (real uvicorn on 127.0.0.1,
the embedded default model, default flags) driven by the official openai client."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pydantic
import pytest

from tests.helpers.serverutil import serving, streamed_calls
from tests.helpers.structured_schemas import schemas

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a restaurant table",
    "parameters": {"type": "object", "properties": {
        "people": {"type": "integer", "minimum": 1, "maximum": 12},
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
        "required": ["people", "time"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The current time"}}  # no parameters
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the weather in Seoul? And book a table for 4 at 19:30."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_tools") / "server.log"
    # CPU mode auto (the default) is not batch-invariant: a prompt whose prefix is cached prefills
    # fewer rows, in another kernel, and a greedy near-tie may fall the other way. The tests
    # below compare a stream with the same request non-streamed token for token, so every
    # request prefills its whole prompt.
    with serving(["--max-model-len", "1024", "--kv-cache-memory", "128M", "--no-enable-prefix-caching"], log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def schema_of(tool):
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def test_named_tool_choice_stream_and_nonstream(client):
    tools = [WEATHER, BOOK, NOW]
    for tool in tools:
        choice = {"type": "function", "function": {"name": tool["function"]["name"]}}
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                           temperature=0, max_tokens=80)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.function.name == tool["function"]["name"] and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schema_of(tool))
        got, finish = streamed_calls(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=tools, tool_choice=choice, temperature=0, max_tokens=80, stream=True))
        assert finish == "tool_calls"
        assert [(g["name"], g["arguments"]) for g in got] == [(call.function.name, call.function.arguments)]


def test_required_tool_choice_and_parallel_false(client):
    """With parallel calls allowed, a 135M model may go on calling until max_tokens: every call
    completed before the cut is valid and reported, and the finish_reason says "length"."""
    tools = [WEATHER, BOOK]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                       temperature=0, max_tokens=160)
    c = r.choices[0]
    assert c.finish_reason in ("tool_calls", "length") and c.message.tool_calls
    for call in c.message.tool_calls:
        tool = {"get_weather": WEATHER, "book_table": BOOK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema_of(tool))
    got, finish = streamed_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, tool_choice="required", temperature=0, max_tokens=160, stream=True))
    assert finish == c.finish_reason
    done = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert [(g["name"], g["arguments"]) for g in got][: len(done)] == done
    assert len(got) in (len(done), len(done) + 1)  # a stream has sent the cut call's fragments too
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=160)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


def test_tool_result_round_trip_and_auto(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0, max_tokens=60)
    call = r.choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "clear"}'}]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40)
    c = r2.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls
    for tc in c.message.tool_calls or []:  # auto: whatever it calls is well-formed
        assert tc.function.name == "get_weather"
        json.loads(tc.function.arguments)


def test_cut_call_ends_with_length(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                       temperature=0, max_tokens=3)
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    _, finish = streamed_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=3, stream=True))
    assert finish == "length"


def test_json_schema_for_20_random_schemas(server):
    async def one(aclient, schema):
        r = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Fill in this record as JSON."}], temperature=0.8,
            seed=1, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}})
        return r.choices[0]

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        all_schemas = schemas(20, seed=99)
        return all_schemas, await asyncio.gather(*(one(aclient, s) for s in all_schemas))

    all_schemas, results = asyncio.run(run_all())
    for schema, c in zip(all_schemas, results):
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_parse_with_a_pydantic_model_and_json_object(client):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=120)
        languages: list[str] = pydantic.Field(max_length=3)

    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                      response_format=Person, temperature=0, max_tokens=120)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with the keys a and b."}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=300)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(json.loads(c.message.content), dict)
    r = client.completions.create(model=MODEL, prompt="Answer yes or no: is the sky blue?", max_tokens=5,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "obj"}}}]},
     "tools.0.function.parameters", "invalid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "schema"),
    ({"messages": [{"role": "tool", "content": "21C"}]}, "messages.0.tool_call_id", "tool_call_id"),
    ({"extra": {"guided_regex": "(unclosed"}}, "guided_regex", "cannot compile"),
    # compiles, but no token of the vocabulary spells this character: the request's fault, not a 500
    ({"extra": {"guided_regex": "\U00040000"}}, "guided_regex", "no token of this model's vocabulary"),
])
def test_bad_tool_and_format_requests_are_400_naming_the_field(client, body, param, words):
    kwargs = {"model": MODEL, "messages": body.get("messages", ASK), "max_tokens": 5}
    kwargs.update({k: v for k, v in body.items() if k not in ("messages", "extra")})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs, extra_body=body.get("extra"))
    err = info.value.response.json()["error"]
    assert err["param"] == param and words in err["message"], err
