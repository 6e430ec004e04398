"""One tool-call JSON object, {"name": "...", "arguments": <json>}, read a character at a time
(the parsers in parsers.py drive it): CallStart once the name is complete, Args fragments of the
arguments as they arrive (held until the name is known if they come first), CallEnd at the close.
A call written without an arguments key gets the arguments `{}` (one Args fragment before its
CallEnd), as OpenAI clients parse the arguments as a JSON object."""

from __future__ import annotations

import json

from edgellm.tools.events import Args, CallEnd, CallStart, Event

NAME_KEYS = ("name",)
ARG_KEYS = ("arguments", "parameters")
EMPTY_ARGS = "{}"  # the arguments of a call that has none


class CallObject:
    """One call object {"name": "...", "arguments": <json>} read a character at a time."""

    def __init__(self, index: int, name: str | None = None) -> None:
        self.index = index
        self.name = name  # known up front for a named tool_choice
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.key: str | None = None  # the top-level key whose value is being read
        self.buf = ""  # the current top-level key or name string, or held-back arguments
        self.reading = ""  # "key" | "name" | "args" | ""
        self.args_depth = 0
        self.started = name is not None
        self.done = False
        self.pending_args = ""  # arguments seen before the name
        self.args_started = False
        self.has_args = False  # an arguments key was read

    def feed(self, ch: str, out: list[Event]) -> None:
        if self.reading == "args":
            self._args_char(ch, out)
            return
        if self.in_string:
            if self.escape:
                self.escape = False
                self.buf += ch
            elif ch == "\\":
                self.escape = True
                self.buf += ch
            elif ch == '"':
                self.in_string = False
                self._string_done(out)
            else:
                self.buf += ch
            return
        if ch.isspace():
            return
        if self.depth == 0:
            if ch != "{":
                raise ValueError(f"a tool call must be a JSON object, found {ch!r}")
            self.depth = 1
        elif ch == '"':
            self.in_string = True
            self.buf = ""
            self.reading = ("key" if self.key is None else "name") if self.depth == 1 else "skip"
        elif ch == ":" and self.depth == 1:
            if self.key in ARG_KEYS:
                self.has_args = True
                self.reading = "args"
                self.args_depth = 0
                self.args_started = False
        elif ch == "," and self.depth == 1:
            self.key = None
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.done = True
                if not self.started:
                    raise ValueError("a tool call without a function name")
                if not self.has_args:
                    out.append(Args(self.index, EMPTY_ARGS))
                out.append(CallEnd(self.index))

    def _string_done(self, out: list[Event]) -> None:
        if self.reading == "skip":
            self.reading = ""
            return
        text = json.loads('"' + self.buf + '"')
        if self.reading == "key":
            self.key = text
        elif self.reading == "name" and self.key in NAME_KEYS and not self.started:
            self.name = text
            self.started = True
            out.append(CallStart(self.index, text))
            if self.pending_args:
                out.append(Args(self.index, self.pending_args))
                self.pending_args = ""
        self.reading = ""

    def _emit_args(self, text: str, out: list[Event]) -> None:
        if self.started:
            if out and isinstance(out[-1], Args) and out[-1].index == self.index:
                out[-1].text += text
            else:
                out.append(Args(self.index, text))
        else:
            self.pending_args += text

    def _args_char(self, ch: str, out: list[Event]) -> None:
        if not self.args_started:
            if ch.isspace():
                return
            self.args_started = True
        if self.in_string:
            self._emit_args(ch, out)
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.args_depth == 0:
                    self._args_done()
            return
        if self.args_depth == 0 and ch in ",}":  # a scalar value ended
            self._args_done()
            self.feed(ch, out)
            return
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.args_depth += 1
        elif ch in "}]":
            self.args_depth -= 1
        self._emit_args(ch, out)
        if self.args_depth == 0 and ch in "}]":
            self._args_done()

    def _args_done(self) -> None:
        self.reading = ""
        self.key = ""  # a value was read: what follows is "," or "}"
