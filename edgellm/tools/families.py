"""The tool-call output formats by name (`PARSERS`, vLLM's `--tool-call-parser` names), and which
one a model gets: the one configured (`edgellm serve --tool-call-parser`, models.yaml
`tool_parser`, `LLM(tool_call_parser=...)`), else the one its chat template asks for where that
is unambiguous, else hermes (also the format of the generic tool prompt that a template without
tool support gets)."""

from __future__ import annotations

from edgellm.tools.parser_llama3 import Llama3JsonParser
from edgellm.tools.parser_mistral import MistralParser
from edgellm.tools.parser_pythonic import PythonicParser
from edgellm.tools.parsers import HermesParser, ToolCallParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
DEFAULT_PARSER = "hermes"

# What a chat template writes (or tells the model to write) for each format. A template that
# matches more than one format is ambiguous and gets the default.
_TEMPLATE_MARKERS = {
    "hermes": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    "llama3_json": ("<|python_tag|>", '"parameters": dictionary of argument name'),
    "pythonic": ("[func_name1(",),
}


def check_parser_name(name: str) -> str:
    """`name` if it is a known format; a ValueError listing the known ones otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(sorted(PARSERS))})")
    return name


def detect_parser(template: str | None) -> str | None:
    """The format a chat template asks for, where exactly one format's markers are in it."""
    if not template or "tools" not in template:
        return None  # no tool support: the generic tool prompt, in hermes' format
    found = [name for name, marks in _TEMPLATE_MARKERS.items() if any(m in template for m in marks)]
    return found[0] if len(found) == 1 else None


def choose_parser(configured: str | None, template: str | None) -> str:
    """The format a model's tool calls are parsed in: `configured` when given (checked), else the
    one detected from its chat template, else hermes."""
    if configured is not None:
        return check_parser_name(configured)
    return detect_parser(template) or DEFAULT_PARSER
