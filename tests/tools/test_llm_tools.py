"""The offline API with tools: LLM.chat(tools=..., tool_choice=...) on the default model returns
parsed calls whose arguments are valid for the schema, for a named and a required choice."""

from __future__ import annotations

import json

import jsonschema
import pytest

from edgellm.llm import LLM
from edgellm.sampling import SamplingParams

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "now", "description": "The time"}}]
ASK = [{"role": "user", "content": "What is the weather in Seoul?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_model_len=512)


def test_named_and_required_tool_choice(llm):
    greedy = SamplingParams(max_tokens=60, temperature=0)
    named = llm.chat(ASK, greedy, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = named[0].outputs[0]
    assert c.finish_reason == "tool_calls" and len(c.tool_calls) == 1
    assert c.tool_calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(c.tool_calls[0]["function"]["arguments"]), PARAMS)
    one = llm.chat(ASK, SamplingParams(max_tokens=80, temperature=0), tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False)[0].outputs[0]
    assert one.finish_reason == "tool_calls" and len(one.tool_calls) == 1
    assert one.tool_calls[0]["function"]["name"] in ("get_weather", "now")
    free = llm.chat(ASK, greedy)[0].outputs[0]
    assert free.tool_calls is None and free.finish_reason in ("stop", "length")


def test_bad_tools_are_value_errors(llm):
    with pytest.raises(ValueError, match="not among the tools"):
        llm.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="only allowed when tools"):
        llm.chat(ASK, tool_choice="required")
