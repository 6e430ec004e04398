"""Tools and tool_choice as OpenAI defines them, checked, and what they make of a request:
the prompt (the model's own chat template with `tools=`, or the generic tool prompt below for a
template without tool support), the grammar ("required" and a named choice are constrained, so
even a small model calls a listed function with arguments valid for its schema), and the parser.

Modes: "none" (tools are left out of the prompt and nothing is parsed), "auto" (the model decides;
its text is parsed in its family's format, `parser_name`, see families.py), "required" (one or more
calls: a JSON array of
{"name", "arguments"} objects, one only when parallel_tool_calls is false), "named" (the output is
the arguments object of that function).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any

from edgellm.sampling import SamplingParams
from edgellm.structured.schema_check import check_schema
from edgellm.structured.spec import StructuredOutputError, StructuredOutputs
from edgellm.tools.families import DEFAULT_PARSER, PARSERS
from edgellm.tools.parsers import ArgumentsParser, JsonArrayParser, ToolCallParser

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

# The prompt for a model whose chat template does not take tools (SmolLM2's, for one): Hermes'
# format, which HermesParser reads.
GENERIC_TOOL_PROMPT = (
    "You can call functions. The functions, as JSON schemas:\n{tools}\n"
    "To call a function, answer with one line per call, exactly:\n"
    '<tool_call>{{"name": <function name>, "arguments": <arguments object>}}</tool_call>\n'
    "Otherwise answer normally."
)


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]]  # normalized {"type": "function", "function": {...}}
    name: str | None = None  # named mode
    parallel: bool = True
    parser_name: str = DEFAULT_PARSER  # the output format of mode "auto" (a PARSERS name)

    @property
    def functions(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    def constraint(self) -> StructuredOutputs | None:
        if self.mode == "named":
            params = self.functions[self.name or ""].get("parameters") or EMPTY_PARAMETERS
            return StructuredOutputs(json=params, source="tool_choice")
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": fn.get("parameters") or EMPTY_PARAMETERS,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, fn in self.functions.items()
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema, source="tools")

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """`params` as this plan needs them: special tokens kept in the decoded text where the
        format's markers are special tokens (Mistral's [TOOL_CALLS]), as vLLM does."""
        if self.mode == "auto" and PARSERS[self.parser_name].special_tokens:
            return replace(params, skip_special_tokens=False)
        return params

    def parser(self) -> ToolCallParser | None:
        if self.mode == "named":
            return ArgumentsParser(self.name or "")
        if self.mode == "required":
            return JsonArrayParser()
        if self.mode == "auto":
            return PARSERS[self.parser_name]()
        return None


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_output(
    tool_plan: ToolPlan, text: str, finish: str
) -> tuple[ToolCallParser, list[dict[str, Any]], str]:
    """A finished choice's text -> (its parser, the completed calls OpenAI-shaped, finish_reason:
    "tool_calls" when it made calls and stopped on its own, else `finish`)."""
    parser = tool_plan.parser()
    assert parser is not None
    parser.feed(text)
    if finish == "stop":
        parser.finish()
    calls = [
        {"id": call_id(), "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in parser.calls
    ]
    return parser, calls, "tool_calls" if calls and finish == "stop" else finish


def plan(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolPlan | None:
    """Check tools / tool_choice (ToolError naming the field) -> the plan, or None without tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    normalized: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(
                "each tool must be {'type': 'function', 'function': {...}}", f"{where}.type"
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError("a tool needs a 'function' object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(
                "a function name must be 1-64 letters, digits, '_', '-' or '.'",
                f"{where}.function.name",
            )
        if name in seen:
            raise ToolError(f"two tools are named {name!r}", f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ToolError(
                    "function parameters must be a JSON schema object",
                    f"{where}.function.parameters",
                )
            try:
                check_schema(params, f"{where}.function.parameters")
            except StructuredOutputError as exc:
                raise ToolError(str(exc), f"{where}.function.parameters") from None
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(
                "a function description must be a string", f"{where}.function.description"
            )
        clean = {"name": name, "parameters": params or EMPTY_PARAMETERS}
        if desc:
            clean["description"] = desc
        normalized.append({"type": "function", "function": clean})
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto", normalized, parallel=parallel)
    if tool_choice in ("none", "required"):
        return ToolPlan(tool_choice, normalized, parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in seen:
            raise ToolError(
                f"tool_choice names the function {name!r}, which is not among the tools",
                "tool_choice",
            )
        return ToolPlan("named", normalized, name=name, parallel=parallel)
    raise ToolError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
        "{'name': ...}}",
        "tool_choice",
    )


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def generic_prompt(tools: list[dict[str, Any]]) -> str:
    return GENERIC_TOOL_PROMPT.format(
        tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    )


def with_generic_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation with the generic tool prompt in its system message (one is added if none),
    and tool calls / tool results written as text the template can render."""
    out = [dict(m) for m in messages]
    prompt = generic_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0].get("content") else prompt
    else:
        out.insert(0, {"role": "system", "content": prompt})
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + "</tool_call>"
                for c in m.pop("tool_calls")
            )
            m["content"] = f"{m.get('content') or ''}\n{calls}".strip()
        elif m["role"] == "tool":
            m["role"] = "user"
            m["content"] = f"<tool_response>{m.get('content') or ''}</tool_response>"
            m.pop("tool_call_id", None)
    return out
