"""Which tool-call format a model's output is parsed in: models.yaml `tool_parser`, `edgellm serve
--tool-call-parser`, `LLM(tool_call_parser=...)`, detection from the chat template, the hermes
fallback, and a clear error for an unknown name; then the chosen parser end to end: the message
and stream deltas of a response, and a real `edgellm serve --tool-call-parser pythonic` answering
the official openai client with parsed tool_calls."""

from __future__ import annotations

import argparse
import dataclasses
import json

import openai
import pytest

from edgellm.cli import build_parser, main
from edgellm.registry import RegistryError, load_registry, parse_entry
from edgellm.server import tool_output
from edgellm.server.launch import tool_parser_name
from edgellm.tools.families import PARSERS, choose_parser, detect_parser
from edgellm.tools.parser_llama3 import Llama3JsonParser
from edgellm.tools.parser_mistral import MistralParser
from edgellm.tools.parser_pythonic import PythonicParser
from edgellm.tools.parsers import HermesParser
from edgellm.tools.spec import plan
from tests.helpers.serverutil import serving, streamed_calls

KNOWN = "known: hermes, llama3_json, mistral, pythonic"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
NOW = {"type": "function", "function": {"name": "get_time"}}

# Excerpts of the families' chat templates, with the lines that name their formats.
QWEN = ('{%- if tools %}{{- "<tools>" }}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}'
        '{{- "</tools>\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
        '\\n</tool_call>" }}{%- endif %}')
MISTRAL = ('{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}'
           '{%- for tool_call in message.tool_calls %}[TOOL_CALLS]{{ tool_call.function.name }}[ARGS]'
           '{{ tool_call.function.arguments }}{%- endfor %}')
LLAMA31 = ('{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}'
           '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name '
           'and its value}.\' }}{%- if builtin_tools %}{{- "<|python_tag|>" }}{%- endif %}')
LLAMA32_JSON = ('{%- if tools is not none %}{{- \'Respond in the format {"name": function name, "parameters": '
                'dictionary of argument name and its value}.\' }}{%- endif %}')
LLAMA32_PYTHONIC = ('{%- if tools is not none %}{{- "To call functions, please respond with a python list of the '
                    'calls. " }}{{- \'Respond in the format [func_name1(params_name1=params_value1, '
                    'params_name2=params_value2...), func_name2(params)] \' }}{%- endif %}')
PLAIN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("template, name", [
    (QWEN, "hermes"), (MISTRAL, "mistral"), (LLAMA31, "llama3_json"), (LLAMA32_JSON, "llama3_json"),
    (LLAMA32_PYTHONIC, "pythonic"),
    (QWEN + MISTRAL, None),  # two formats: ambiguous
    (PLAIN, None), ("<tool_call> without the word for them", None), (None, None),
])
def test_detected_from_the_chat_template(template, name):
    assert detect_parser(template) == name
    assert choose_parser(None, template) == (name or "hermes")  # else hermes (the generic prompt's)


def test_configured_wins_and_unknown_names_are_refused():
    assert choose_parser("pythonic", MISTRAL) == "pythonic"
    assert choose_parser("mistral", PLAIN) == "mistral"
    with pytest.raises(ValueError, match=f"unknown tool-call parser 'qwen' \\({KNOWN}\\)"):
        choose_parser("qwen", QWEN)
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}


def test_registry_key(tmp_path):
    assert parse_entry("m", {"source": "default", "tool_parser": "llama3_json"}, tmp_path).tool_parser == "llama3_json"
    assert parse_entry("m", {"source": "default"}, tmp_path).tool_parser is None
    p = tmp_path / "models.yaml"
    p.write_text("models:\n  m: {source: default, tool_parser: llama3}\n")
    with pytest.raises(RegistryError, match=f"model 'm': tool_parser: unknown tool-call parser 'llama3' \\({KNOWN}"):
        load_registry(p)
    p.write_text("models:\n  m: {source: default, tool_parser: 3}\n")
    with pytest.raises(RegistryError, match="tool_parser must be a string"):
        load_registry(p)


def test_cli_flag_and_its_precedence(tmp_path, capsys):
    args = build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    spec = parse_entry("m", {"source": "default", "tool_parser": "pythonic"}, tmp_path)
    assert tool_parser_name(spec, args) == "mistral"  # the flag over the registry
    assert tool_parser_name(spec, argparse.Namespace(tool_call_parser=None)) == "pythonic"
    assert tool_parser_name(parse_entry("m", {"source": "default"}, tmp_path),
                            argparse.Namespace(tool_call_parser=None)) is None  # from the template
    # an unknown name stops `edgellm serve` before any model is loaded, naming the known ones
    p = tmp_path / "models.yaml"
    p.write_text("models:\n  m: {source: default}\n")
    assert main(["serve", "--config", str(p), "--tool-call-parser", "qwen25"]) == 2
    err = capsys.readouterr().err
    assert "unknown tool-call parser 'qwen25'" in err and KNOWN in err


def test_offline_api_and_served_model_check_the_name():
    from edgellm.llm import LLM
    from edgellm.server.served_model import ServedModel

    with pytest.raises(ValueError, match=KNOWN):
        LLM(tool_call_parser="llama")  # refused before the model loads
    with pytest.raises(ValueError, match=KNOWN):
        ServedModel(names=["m"], engine=None, max_waiting_requests=0, tool_parser="llama")


OUTPUTS = {  # the same two calls in each family's format
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "서울", "days": 2}}</tool_call>\n'
              '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "서울", "days": 2}}; '
                   '{"name": "get_time", "parameters": {}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "서울", "days": 2}[TOOL_CALLS]get_time[ARGS]{}',
    "pythonic": "[get_weather(city='서울', days=2), get_time()]",
}
CLASSES = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
           "pythonic": PythonicParser}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_the_plan_parses_in_the_chosen_format(name):
    tools = dataclasses.replace(plan([WEATHER, NOW], "auto", None), parser_name=name)
    assert type(tools.parser()) is CLASSES[name]
    want = [("get_weather", {"city": "서울", "days": 2}), ("get_time", {})]
    msg, finish = tool_output.message(tools, OUTPUTS[name], "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == want
    stream = tool_output.StreamedCalls(tools)
    deltas = [d for ch in OUTPUTS[name] for d in stream.feed(ch)]
    more, finish = stream.finish("stop")
    calls: dict[int, list[str]] = {}
    for d in deltas + more:
        assert "content" not in d
        for tc in d["tool_calls"]:
            if "id" in tc:  # id, type and name only in a call's first delta
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                calls[tc["index"]][1] += tc["function"]["arguments"]
    assert finish == "tool_calls" and [(n, json.loads(a)) for n, a in calls.values()] == want
    # the other formats' parsers read this output as content, not calls
    for other in set(OUTPUTS) - {name}:
        parser = PARSERS[other]()
        parser.feed(OUTPUTS[name])
        parser.finish()
        assert parser.calls == [] and not parser.open_call and parser.content == OUTPUTS[name]


NO_ARGUMENTS = {  # get_time called without arguments, in each family's format
    "hermes": '<tool_call>{"name": "get_time"}</tool_call>',
    "llama3_json": '{"name": "get_time"}',
    "mistral": '[TOOL_CALLS][{"name": "get_time"}]',
    "pythonic": "[get_time()]",
}


@pytest.mark.parametrize("name", sorted(NO_ARGUMENTS))
def test_a_call_without_arguments_has_the_arguments_empty_object(name):
    """OpenAI clients json.loads the arguments: "{}", never "" (the message, and the joined stream
    fragments, a character at a time)."""
    tools = dataclasses.replace(plan([WEATHER, NOW], "auto", None), parser_name=name)
    msg, finish = tool_output.message(tools, NO_ARGUMENTS[name], "stop")
    assert finish == "tool_calls" and msg["tool_calls"][0]["function"]["arguments"] == "{}"
    stream = tool_output.StreamedCalls(tools)
    deltas = [d for ch in NO_ARGUMENTS[name] for d in stream.feed(ch)] + stream.finish("stop")[0]
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d["tool_calls"]]
    assert "".join(fragments) == "{}"


MODEL = "smollm2-135m-instruct"
FORCED = {  # the two calls forced by a regex, in each format served below
    "pythonic": r"\[get_weather\(city='서울', days=2\), get_time\(\)\]",
    "mistral": r'\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "서울", "days": 2\}\[TOOL_CALLS\]get_time\[ARGS\]\{\}',
}


@pytest.fixture(scope="module", params=sorted(FORCED))
def parser_server(request, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"serve_{request.param}") / "server.log"
    with serving(["--max-model-len", "1024", "--kv-cache-memory", "128M", "--tool-call-parser", request.param],
                 log) as srv:
        yield request.param, srv


def test_served_with_the_configured_parser(parser_server):
    """tool_choice auto, the output forced into the server's format by a regex: the server parses
    it with the parser it was started with, streamed and not (mistral: special tokens decoded,
    the EOS text left out, so nothing follows the calls as content)."""
    name, server = parser_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Seoul, and the time?"}],
              "tools": [WEATHER, NOW], "temperature": 0, "max_tokens": 60, "extra_body": {"guided_regex": FORCED[name]}}
    c = client.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert got == [("get_weather", {"city": "서울", "days": 2}), ("get_time", {})]
    calls, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls"
    assert [(t["name"], json.loads(t["arguments"])) for t in calls] == got


def test_mistral_markers_are_special_tokens_kept_in_the_decoded_text():
    """In Mistral's tokenizers [TOOL_CALLS] and [ARGS] are special tokens: decoded with them skipped
    (the default) the calls are lost; the plan of the mistral format keeps them, and the output
    streamed token by token through the detokenizer then parses into the calls."""
    from edgellm.loader import default_model_path
    from edgellm.sampling import SamplingParams
    from edgellm.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path(), "gguf")
    tok.hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    ids = tok.encode(OUTPUTS["mistral"], add_special_tokens=False)
    assert tok.hf.convert_tokens_to_ids("[TOOL_CALLS]") in ids
    mistral = dataclasses.replace(plan([WEATHER, NOW], "auto", None), parser_name="mistral")
    hermes = plan([WEATHER, NOW], "auto", None)
    assert hermes.sampling(SamplingParams()).skip_special_tokens
    want = [("get_weather", {"city": "서울", "days": 2}), ("get_time", {})]
    for tools, found in ((mistral, want), (dataclasses.replace(mistral, mode="named", name="now"), None)):
        params = tools.sampling(SamplingParams())
        detok = tok.detokenizer([1, 2], params.skip_special_tokens)
        text = "".join(detok.step(t) for t in ids) + detok.flush()
        if found is None:  # other modes decode as asked: the markers are gone
            assert params.skip_special_tokens and "[TOOL_CALLS]" not in text
            continue
        assert not params.skip_special_tokens and text == OUTPUTS["mistral"]
        msg, finish = tool_output.message(tools, text, "stop")
        assert finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == found
