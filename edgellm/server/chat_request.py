"""The /v1/chat/completions body: its messages (text parts only), tools and tool_choice,
chat_template_kwargs, logprobs; the conversation handed to the chat template."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict

from edgellm.server.errors import bad_request
from edgellm.server.protocol import SamplingRequest, StrictBody
from edgellm.structured import StructuredOutputs
from edgellm.tools.spec import ToolError, ToolPlan, plan


class TextPart(StrictBody):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        out = []
        for i, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"content part type {part.type!r} is not supported; only 'text' parts are",
                    param=f"messages.content.{i}.type",
                    code="unsupported_content",
                )
            out.append(part.text)
        return "".join(out)


# apply_chat_template's own arguments: template variables only may come from a request
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "tokenize",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "conversation",
        "messages",
    }
)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def _num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise bad_request("messages must be a non-empty list", param="messages")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= 20:
                raise bad_request("top_logprobs must be between 0 and 20", param="top_logprobs")
            if self.top_logprobs and not self.logprobs:
                raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        for i, msg in enumerate(self.messages):
            if msg.role == "tool" and not msg.tool_call_id:
                raise bad_request(
                    "a message with role 'tool' needs the tool_call_id it answers",
                    param=f"messages.{i}.tool_call_id",
                )
            for j, call in enumerate(msg.tool_calls or []):
                fn = call.get("function") if isinstance(call, dict) else None
                if (
                    not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments", ""), (str, dict))
                ):
                    raise bad_request(
                        "a tool call needs function.name and function.arguments (a JSON string)",
                        param=f"messages.{i}.tool_calls.{j}.function",
                    )
        self.tool_plan()
        reserved = sorted(set(self.chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            # "chat_template" would let a client run its own Jinja (CPU for as long as it likes)
            raise bad_request(
                f"chat_template_kwargs may not set {reserved[0]!r}", param="chat_template_kwargs"
            )

    def tool_plan(self) -> ToolPlan | None:
        try:
            return plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolError as exc:
            raise bad_request(str(exc), param=exc.param) from None

    def constraint(self) -> StructuredOutputs | None:
        own = super().constraint()
        tools = self.tool_plan()
        if tools is None:
            return own
        forced = tools.constraint()
        if forced is not None and own is not None:
            raise bad_request(
                f"tool_choice {tools.mode!r} constrains the output itself; "
                f"it cannot be combined with {own.source}",
                param=own.source,
            )
        return forced or own

    def conversation(self) -> list[dict[str, Any]]:
        out = []
        for msg in self.messages:
            item: dict[str, Any] = {
                "role": "system" if msg.role == "developer" else msg.role,
                "content": msg.text() or "",
            }
            if msg.name is not None:
                item["name"] = msg.name
            if msg.tool_call_id is not None:
                item["tool_call_id"] = msg.tool_call_id
            if msg.tool_calls:
                item["tool_calls"] = [_template_call(c) for c in msg.tool_calls]
            out.append(item)
        return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as chat templates read it: arguments as an object."""
    fn = call["function"]
    args = fn.get("arguments", "")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # the template gets the text as it was sent
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }
