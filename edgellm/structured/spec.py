"""StructuredOutputs: one constraint on a request's output, as vLLM's `structured_outputs`.

Exactly one of:
  json         a JSON schema (dict or its JSON text): the output is one JSON value valid for it
  json_object  True: the output is one JSON object (OpenAI's response_format json_object)
  regex        the output matches this regular expression (whole output)
  choice       the output is exactly one of these strings
  grammar      an EBNF grammar (GBNF as llama.cpp writes it; the start rule is `root`)

JSON is emitted compactly (no free whitespace between tokens): a small model left free to pick
whitespace can fill its whole budget with newlines. `key` identifies the compiled grammar, so two
requests with the same constraint share one compilation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from edgellm.structured.schema_check import check_schema

MAX_SPEC_BYTES = 256 * 1024  # a schema, regex or grammar larger than this is refused


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled; `param` names the offending request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputs:
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # which request field this came from, for error messages ("response_format", "guided_json", ...)
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise StructuredOutputError(
                f"{self.source} needs exactly one of json, json_object, regex, choice, grammar; "
                "got "
                f"{', '.join(given) or 'none'}",
                self.source,
            )
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise StructuredOutputError(
                    f"{self.source}: choice must be a non-empty list of non-empty strings",
                    self.source,
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise StructuredOutputError(
                    f"{self.source}: {name} must be a non-empty string", self.source
                )
        if len(self.key) > MAX_SPEC_BYTES:
            raise StructuredOutputError(
                f"{self.source} is larger than {MAX_SPEC_BYTES} bytes", self.source
            )
        if self.json is not None:
            check_schema(self.schema(), self.source)

    def schema(self) -> dict[str, Any]:
        """The JSON schema as a dict (json or json_object only)."""
        if self.json_object:
            return {"type": "object"}
        if isinstance(self.json, str):
            try:
                value = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(
                    f"{self.source}: the JSON schema is not valid JSON ({exc})", self.source
                ) from None
        else:
            value = self.json
        if not isinstance(value, (dict, bool)):
            raise StructuredOutputError(
                f"{self.source}: a JSON schema must be an object", self.source
            )
        return value if isinstance(value, dict) else ({} if value else {"not": {}})

    @property
    def kind(self) -> str:
        if self.json is not None or self.json_object:
            return "json"
        return (
            "regex"
            if self.regex is not None
            else "choice"
            if self.choice is not None
            else "grammar"
        )

    @property
    def key(self) -> str:
        if self.kind == "json":
            body: Any = self.schema()
        else:
            body = getattr(self, self.kind)
        return (
            self.kind
            + ":"
            + json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        )
