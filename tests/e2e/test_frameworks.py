"""Real agent frameworks as clients of `edgellm serve`, unchanged: pipecat's OpenAILLMService runs a
function-calling turn end to end (the registered function is called with arguments valid for its
schema, its result goes back, the final answer streams), and langchain-openai's bind_tools and
with_structured_output."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pydantic
import pytest

from tests.helpers.serverutil import serving

MODEL = "smollm2-135m-instruct"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_frameworks") / "server.log"
    with serving(["--max-model-len", "1024", "--kv-cache-memory", "128M"], log) as srv:
        yield srv


def test_pipecat_function_calling_turn(server):
    from pipecat.adapters.schemas.function_schema import FunctionSchema
    from pipecat.adapters.schemas.tools_schema import ToolsSchema
    from pipecat.frames.frames import (
        FunctionCallResultFrame,
        LLMFullResponseEndFrame,
        LLMRunFrame,
        LLMTextFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineTask
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.llm import OpenAILLMService

    calls: list[dict] = []
    seen: dict[str, list] = {"text": [], "results": [], "ends": []}

    async def get_weather(params) -> None:
        calls.append(dict(params.arguments))
        params.context.set_tool_choice("none")  # the answer after the result is text
        await params.result_callback({"temp_c": 21, "sky": "clear"})

    weather = FunctionSchema(name="get_weather", description="Current weather in a city",
                             properties=WEATHER_PARAMS["properties"], required=WEATHER_PARAMS["required"])
    context = LLMContext(messages=[{"role": "system", "content": "You are a helpful voice assistant."},
                                   {"role": "user", "content": "What is the weather in Seoul?"}],
                         tools=ToolsSchema(standard_tools=[weather]),
                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    llm = OpenAILLMService(api_key="unused", base_url=server.url + "/v1", model=MODEL,
                           params=OpenAILLMService.InputParams(temperature=0.0, max_completion_tokens=40))
    llm.register_function("get_weather", get_weather)
    pair = LLMContextAggregatorPair(context)

    class Sink(FrameProcessor):
        async def process_frame(self, frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, LLMTextFrame):
                seen["text"].append(frame.text)
            elif isinstance(frame, FunctionCallResultFrame):
                seen["results"].append(frame.result)
            elif isinstance(frame, LLMFullResponseEndFrame):
                seen["ends"].append(len(seen["text"]))
            await self.push_frame(frame, direction)

    task = PipelineTask(Pipeline([pair.user(), llm, Sink(), pair.assistant()]), idle_timeout_secs=60)

    async def drive() -> None:
        await task.queue_frame(LLMRunFrame())
        for _ in range(600):  # until the answer after the tool result has finished
            await asyncio.sleep(0.1)
            if calls and len(seen["ends"]) >= 2 and seen["text"]:
                break
        await task.cancel()

    async def main() -> None:
        await asyncio.gather(PipelineRunner(handle_sigint=False).run(task), drive())

    asyncio.run(main())
    assert len(calls) == 1
    jsonschema.validate(calls[0], WEATHER_PARAMS)
    assert seen["text"], "the answer after the tool result never streamed"
    roles = [m.get("role") for m in context.get_messages()]
    assert "tool" in roles and roles[-1] == "assistant"  # the result went back, the answer came after


def test_langchain_bind_tools_and_structured_output(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=80)

    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city (unit: celsius or fahrenheit)."""
        return f"21 {unit} in {city}"

    msg = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Seoul?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "get_weather"
    args = msg.tool_calls[0]["args"]
    assert isinstance(args.get("city"), str) and isinstance(args.get("unit"), str)

    class Person(pydantic.BaseModel):
        """A person."""

        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=120)

    for method in ("json_schema", "function_calling"):
        person = chat.with_structured_output(Person, method=method).invoke("Invent a person.")
        assert isinstance(person, Person) and 0 <= person.age <= 120
    json.dumps(person.model_dump())
