"""What both OpenAI request bodies share (pydantic, strict types, unknown fields ignored):
the sampling fields, their checks, the structured-output constraint -> SamplingParams.

Strict: a string where a number belongs is a 400, as with OpenAI; an int is
a valid float. vLLM's extensions that load generators send (ignore_eos,
min_tokens, top_k, min_p, repetition_penalty, stop_token_ids, ...) are
honoured, and vLLM's priority (an int, lower runs sooner; anything but 0 is a 400 unless the
server runs --scheduling-policy priority). stream_options.chunking = "sentence" is edgellm's own.

Structured outputs: OpenAI's response_format (json_object, json_schema) and vLLM's extras
(structured_outputs {json, regex, choice, grammar, json_object} and the older guided_json /
guided_regex / guided_choice / guided_grammar), at most one per request. The bodies themselves:
chat_request.py (/v1/chat/completions) and completion_request.py (/v1/completions).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgellm.sampling import SamplingParams
from edgellm.server.errors import bad_request
from edgellm.structured import StructuredOutputError, StructuredOutputs

MAX_N = 64
MAX_STOP = 16


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictBody):
    include_usage: bool = False
    chunking: Literal["token", "sentence"] | None = None
    max_chunk_chars: int = Field(200, ge=8, le=4096)


class SamplingRequest(StrictBody):
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
