"""The offline API with tools: LLM.chat(tools=..., tool_choice=...) on the default model returns
parsed calls whose arguments are valid for the schema, for a named and a required choice."""

from __future__ import annotations

import json

import jsonschema
import pytest

from edgellm.llm import LLM
from edgellm.sampling import SamplingParams
from edgellm.structured.spec import StructuredOutputs

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


MISTRAL_V11 = r'\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Seoul", "unit": "celsius"\}'


def test_mistral_format_keeps_special_tokens_and_drops_the_eos_text():
    """tool_choice auto in Mistral's v11 format (the output forced into it by a regex): the plan
    decodes special tokens ([TOOL_CALLS] is one in Mistral's tokenizers), the EOS that ends the
    output adds no text (SmolLM2's <|im_end|> would otherwise follow the call as content), and
    the call is parsed."""
    llm = LLM(None, max_model_len=512, tool_call_parser="mistral")
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=StructuredOutputs(regex=MISTRAL_V11))
    c = llm.chat(ASK, params, tools=TOOLS)[0].outputs[0]
    assert c.finish_reason == "tool_calls" and c.token_ids[-1] in llm.get_tokenizer().eos_token_ids
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c.tool_calls] == [
        ("get_weather", {"city": "Seoul", "unit": "celsius"})]
    assert "<|im_end|>" not in c.text and c.text.startswith("[TOOL_CALLS]get_weather")
