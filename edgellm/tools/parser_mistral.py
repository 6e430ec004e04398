"""Mistral tool calls (`mistral`), both forms its tokenizers have used:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Seoul"}}, {"name": "now"}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Seoul"}[TOOL_CALLS]now[ARGS]{}

The first is the v3 tokenizers' (Mistral-7B-Instruct-v0.3): one `[TOOL_CALLS]`, then a JSON array
of call objects. The second is v11 and later (Mistral Small 3.1+, Ministral): `[TOOL_CALLS]`, the
function name, `[ARGS]` (or, decoded by mistral-common, nothing: the name ends at `{`; a
`[CALL_ID]id` after the name is skipped), the arguments object; one `[TOOL_CALLS]` per call.
Content may come before the first call and after the last. `[TOOL_CALLS]` is a special token in
these tokenizers, so the text carries it only when special tokens are decoded; decoded without
them, an output that begins with a JSON array of call objects is read as the first form.
"""

from __future__ import annotations

import re

from edgellm.tools.call_object import CallObject
from edgellm.tools.events import Args, CallEnd, CallStart, Content, Event
from edgellm.tools.parsers import ToolCallParser
from edgellm.tools.scan import HeldText, JsonSpan

TOOL_CALLS = "[TOOL_CALLS]"
_HEADER = re.compile(r"^([A-Za-z0-9_\-.]{1,64})(?:\[CALL_ID\][A-Za-z0-9]{1,64})?(?:\[ARGS\])?$")
_HEADER_CHARS = re.compile(r"^[A-Za-z0-9_\-.\[\]]{1,200}$")


class MistralParser(ToolCallParser):
    special_tokens = True  # [TOOL_CALLS], [ARGS], [CALL_ID]

    def __init__(self) -> None:
        super().__init__()
        self.text = HeldText(tags=(TOOL_CALLS,), openers="[")
        # text | tag (after [TOOL_CALLS]) | array (between call objects) | object (in one) |
        # header (the v11 name, [CALL_ID], [ARGS]) | args (the v11 arguments object)
        self.state = "text"
        self.raw = ""  # the text since the opening, given back if it turns out not to be a call
        self.call: CallObject | None = None
        self.span: JsonSpan | None = None
        self.header = ""
        self.count = 0
        self.in_array = 0  # calls completed in the current array

    def _give_back(self, out: list[Event]) -> None:
        """The text since the opening is not a call: content, and back to text."""
        out.append(Content(self.raw))
        self.state, self.raw = "text", ""

    def _char(self, ch: str, out: list[Event]) -> None:
        if self.broken:
            out.append(Content(ch))
            return
        if self.state == "text":
            content, opening = self.text.push(ch)
            out.append(Content(content))
            if opening == TOOL_CALLS:
                self.state, self.raw = "tag", self.text.dropped + TOOL_CALLS
            elif opening == "[":
                self.state, self.raw, self.in_array = "array", self.text.dropped + "[", 0
            return
        self.raw += ch
        if self.state == "tag":
            if ch.isspace():
                return
            if ch == "[":
                self.state, self.in_array = "array", 0
            elif _HEADER_CHARS.match(ch):
                self.state, self.header = "header", ch
            else:
                self._give_back(out)
        elif self.state == "array":
            self._array_char(ch, out)
        elif self.state == "object":
            self._object_char(ch, out)
        elif self.state == "header":
            self._header_char(ch, out)
        else:
            self._args_char(ch, out)

    def _array_char(self, ch: str, out: list[Event]) -> None:
        if TOOL_CALLS.startswith(self.raw.lstrip()):  # the opening "[" may be the tag's own
            if self.raw.lstrip() == TOOL_CALLS:
                self.state = "tag"
            return
        if ch.isspace() or ch == "," and self.in_array:
            return
        if ch == "{":
            self.state = "object"
            self.call = CallObject(self.count)
            self.call.feed(ch, out)
        elif ch == "]" and self.in_array:
            self.state, self.raw = "text", ""
        elif self.in_array:
            self.broken = True
        else:
            self._give_back(out)

    def _object_char(self, ch: str, out: list[Event]) -> None:
        assert self.call is not None
        try:
            self.call.feed(ch, out)
        except ValueError:
            if self.call.started or self.in_array:
                self.broken = True
            else:
                self._give_back(out)
            return
        if self.call.done:
            self.count += 1
            self.in_array += 1
            self.state = "array"

    def _header_char(self, ch: str, out: list[Event]) -> None:
        if ch == "{":
            m = _HEADER.match(self.header)
            if m is None:
                self._give_back(out)
                return
            out.append(CallStart(self.count, m.group(1)))
            self.state, self.span = "args", JsonSpan()
            self._args_char(ch, out)
        elif ch.isspace() and self.header.endswith("]"):
            return  # "[ARGS] {": space before the arguments
        elif _HEADER_CHARS.match(self.header + ch):
            self.header += ch
        else:
            self._give_back(out)

    def _args_char(self, ch: str, out: list[Event]) -> None:
        assert self.span is not None
        if not self.span.started and ch.isspace():
            return
        try:
            closed = self.span.feed(ch)
        except ValueError:
            self.broken = True
            return
        out.append(Args(self.count, ch))
        if closed:
            out.append(CallEnd(self.count))
            self.count += 1
            self.state, self.raw = "text", ""

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.state == "text":
            out.append(Content(self.text.flush()))
        elif not self.in_array and (
            self.state in ("tag", "header", "array")
            or (self.state == "object" and self.call is not None and not self.call.started)
        ):
            out.append(Content(self.raw))  # an opening that never became a call: content
        self.state = "text"
        return self._emit(out)
