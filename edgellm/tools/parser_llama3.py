"""Llama 3.x JSON tool calls (`llama3_json`), as the Llama 3.1 / 3.2 chat templates ask for them:

    {"name": "get_weather", "parameters": {"city": "Seoul"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}

A call is a JSON object with "name" and "parameters" (or "arguments"), where the output begins or
right after `<|python_tag|>` (which may follow content); several calls are separated by `;` and/or
whitespace. A `{` that turns out not to be a call object is given back as content, unchanged; text
after the calls is content. The arguments' fragments are the model's own JSON text, streamed as it
arrives (see CallObject).
"""

from __future__ import annotations

from edgellm.tools.call_object import CallObject
from edgellm.tools.events import Content, Event
from edgellm.tools.parsers import ToolCallParser
from edgellm.tools.scan import HeldText

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self.text = HeldText(tags=(PYTHON_TAG,), openers="{")
        self.state = "text"  # text | tag (after <|python_tag|>) | call | between (after a call)
        self.hold = ""  # separators after a call
        self.call: CallObject | None = None
        self.raw = ""  # the current call's text, given back if it is not a call
        self.count = 0

    def _char(self, ch: str, out: list[Event]) -> None:
        if self.broken:
            out.append(Content(ch))
        elif self.state == "text":
            content, opening = self.text.push(ch)
            out.append(Content(content))
            if opening == PYTHON_TAG:
                self.state, self.raw = "tag", self.text.dropped + PYTHON_TAG
            elif opening == "{":
                self._open(self.text.dropped + ch, out)
        elif self.state == "tag":
            if ch.isspace():
                self.raw += ch
            elif ch == "{":
                self._open(self.raw + ch, out)
            else:  # not a JSON call (a built-in tool's code, say): content, tag included
                out.append(Content(self.raw))
                self.state = "text"
                self._char(ch, out)
        elif self.state == "call":
            self._call_char(ch, out)
        elif ch.isspace() or ch == ";":  # between
            self.hold += ch
        elif ch == "{":
            self._open(self.hold + ch, out)
        else:  # the calls are over: what follows, separators included, is content
            rest, self.hold, self.state = self.hold + ch, "", "text"
            for c in rest:
                self._char(c, out)

    def _open(self, raw: str, out: list[Event]) -> None:
        self.state, self.raw, self.hold = "call", raw, ""
        self.call = CallObject(self.count)
        self.call.feed("{", out)

    def _call_char(self, ch: str, out: list[Event]) -> None:
        assert self.call is not None
        self.raw += ch
        try:
            self.call.feed(ch, out)
        except ValueError:
            if self.call.started:
                self.broken = True  # a call began and stopped following the format
            else:
                out.append(Content(self.raw))
                self.state = "text"
            return
        if self.call.done:
            self.count += 1
            self.state, self.hold = "between", ""

    def finish(self) -> list[Event]:
        out: list[Event] = []
        unnamed = self.state == "call" and self.call is not None and not self.call.started
        if self.state == "text":
            out.append(Content(self.text.flush()))
        elif self.state == "tag" or unnamed:
            out.append(Content(self.raw))  # an opening that never became a call: content
        self.state = "text"
        return self._emit(out)
