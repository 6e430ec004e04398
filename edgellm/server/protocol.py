"""OpenAI request bodies (pydantic, strict types, unknown fields ignored) -> SamplingParams.

Strict: a string where a number belongs is a 400, as with OpenAI; an int is
a valid float. vLLM's extensions that load generators send (ignore_eos,
min_tokens, top_k, min_p, repetition_penalty, stop_token_ids, ...) are
honoured, and vLLM's priority (an int, lower runs sooner; anything but 0 is a 400 unless the
server runs --scheduling-policy priority). stream_options.chunking = "sentence" is edgellm's own.

Structured outputs: OpenAI's response_format (json_object, json_schema) and vLLM's extras
(structured_outputs {json, regex, choice, grammar, json_object} and the older guided_json /
guided_regex / guided_choice / guided_grammar), at most one per request.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgellm.sampling import SamplingParams
from edgellm.server.errors import bad_request
from edgellm.structured import StructuredOutputError, StructuredOutputs
from edgellm.tools.spec import ToolError, ToolPlan, plan

MAX_N = 64
MAX_STOP = 16


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    chunking: Literal["token", "sentence"] | None = None
    max_chunk_chars: int = Field(200, ge=8, le=4096)


class TextPart(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
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


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int = 0  # vLLM's: lower runs sooner; not 0 needs --scheduling-policy priority

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop sequences are allowed", param="stop")

    def constraint(self) -> StructuredOutputs | None:
        """The one structured-output constraint this request asks for, if any (400 if malformed)."""
        found: list[StructuredOutputs] = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                found.append(StructuredOutputs(json_object=True, source="response_format"))
            elif kind == "json_schema":
                body = fmt.get("json_schema")
                if not isinstance(body, dict) or "schema" not in body:
                    raise bad_request(
                        "response_format.json_schema.schema is required (the JSON schema "
                        "the output must follow)",
                        param="response_format.json_schema",
                    )
                found.append(
                    StructuredOutputs(
                        json=body["schema"], source="response_format.json_schema.schema"
                    )
                )
            elif kind != "text":
                raise bad_request(
                    f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                    f"got {kind!r}",
                    param="response_format.type",
                )
        if self.structured_outputs is not None:
            known = {"json", "regex", "choice", "grammar", "json_object"}
            given = {k: v for k, v in self.structured_outputs.items() if v is not None}
            unknown = sorted(set(given) - known)
            if unknown:
                raise bad_request(
                    f"structured_outputs.{unknown[0]} is not supported (use one of "
                    f"{', '.join(sorted(known))})",
                    param="structured_outputs",
                )
            found.append(StructuredOutputs(**given, source="structured_outputs"))
        for name, field in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                found.append(StructuredOutputs(**{field: value}, source=name))
        if len(found) > 1:
            raise bad_request(
                f"at most one structured-output constraint per request; got "
                f"{', '.join(f.source for f in found)}",
                param=found[1].source,
            )
        return found[0] if found else None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            constraint = self.constraint()
        except StructuredOutputError as exc:
            raise bad_request(str(exc), param=exc.param) from None
        except TypeError as exc:  # a field of the wrong type inside structured_outputs
            raise bad_request(f"structured_outputs: {exc}", param="structured_outputs") from None
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0
                if self.repetition_penalty is None
                else self.repetition_penalty,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=self._num_logprobs(),
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured_outputs=constraint,
            )
        except ValueError as exc:
            msg = str(exc)
            return _raise_param(msg)

    @property
    def chunking(self) -> str:
        return (self.stream_options.chunking if self.stream_options else None) or "token"


def _raise_param(msg: str) -> Any:
    param = msg.split(" ", 1)[0] if msg and msg.split(" ", 1)[0].isidentifier() else None
    if msg.startswith("stop strings"):
        param = "stop"
    raise bad_request(msg, param=param)


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


class ChatCompletionRequest(_Sampling):
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


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad_request("logprobs must be between 0 and 20", param="logprobs")
        if self.echo:
            raise bad_request(
                "echo is not supported by this server", param="echo", code="unsupported"
            )
        if self.suffix:
            raise bad_request(
                "suffix is not supported by this server", param="suffix", code="unsupported"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (it must equal n)", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be an empty list", param="prompt")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        # validated as one of the list forms, so a list holds only ids, only strings or only lists
        ids = [x for x in p if isinstance(x, int)]
        if len(ids) == len(p):
            return [ids]
        return [x for x in p if not isinstance(x, int)]
