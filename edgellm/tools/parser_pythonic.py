"""Pythonic tool calls (`pythonic`), as the Llama 3.2 / Llama 4 pythonic templates ask for them:

    [get_weather(city="Seoul", days=3), now()]

A Python list of calls with keyword arguments, where the output or a line begins. Each call's
arguments are streamed as JSON (see pyliteral.KwargsToJson): the fragments join to
json.dumps(the keyword values, ensure_ascii=False). A call is reported (CallStart) once it is
certain: at its first `name=` or at `()`; until then the text is held, and given back as content,
unchanged, if it turns out not to be a call (`[1] see the notes`, `[a link](...)`). A call that
breaks after it was reported ends the parsing: the rest is content and the call stays open. Text
after the closing `]` is content.
"""

from __future__ import annotations

import re

from edgellm.tools.events import Args, CallEnd, CallStart, Content, Event
from edgellm.tools.parsers import ToolCallParser
from edgellm.tools.pyliteral import KwargsToJson
from edgellm.tools.scan import HeldText

_NAME_CHAR = re.compile(r"[A-Za-z0-9_.\-]")


class PythonicParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self.text = HeldText(openers="[", line_start=True)
        # text | list (before a call's name, or "]") | name | open (after the name, before "(") |
        # args (inside the parentheses) | after (after a call: "," or "]")
        self.state = "text"
        self.raw = ""  # text since the "[" or the last event, given back if it is no call list
        self.name = ""
        self.args: KwargsToJson | None = None
        self.pending = ""  # the current call's JSON before its CallStart
        self.count = 0
        self.in_list = 0  # calls completed in this list

    def _give_back(self, out: list[Event]) -> None:
        """The text since the last reported event is not (the rest of) a call list."""
        if self.in_list or self.args is not None and self.args.started:
            self.broken = True  # calls were reported: the rest of the text is content
            out.append(Content(self.raw))
            return
        # content, but its last character (with the whitespace before it) is read again as text:
        # it may begin a line that opens a call list
        body, last = self.raw[:-1], self.raw[-1:]
        kept = body.rstrip()
        out.append(Content(kept))
        self.state, self.raw, self.args = "text", "", None
        for c in body[len(kept) :] + last:
            self._char(c, out)

    def _char(self, ch: str, out: list[Event]) -> None:
        if self.broken:
            out.append(Content(ch))
            return
        if self.state == "text":
            content, opening = self.text.push(ch)
            out.append(Content(content))
            if opening:
                self.state, self.raw, self.in_list = "list", self.text.dropped + "[", 0
            return
        self.raw += ch
        if self.state == "list":
            if ch.isspace():
                return
            if _NAME_CHAR.match(ch) and not ch.isdigit() and ch not in ".-":
                self.state, self.name = "name", ch
            elif ch == "]" and self.in_list:
                self._close_list()
            else:
                self._give_back(out)
        elif self.state == "name":
            if _NAME_CHAR.match(ch) and len(self.name) < 64:
                self.name += ch
            elif ch == "(":
                self._open_args()
            elif ch.isspace():
                self.state = "open"
            else:
                self._give_back(out)
        elif self.state == "open":
            if ch == "(":
                self._open_args()
            elif not ch.isspace():
                self._give_back(out)
        elif self.state == "args":
            self._args_char(ch, out)
        elif ch == "," or ch.isspace():  # after
            if ch == ",":
                self.state = "list"
        elif ch == "]":
            self._close_list()
        else:
            self._give_back(out)

    def _open_args(self) -> None:
        self.state, self.args, self.pending = "args", KwargsToJson(), ""

    def _args_char(self, ch: str, out: list[Event]) -> None:
        assert self.args is not None
        was_started = self.args.started
        try:
            text = self.args.feed(ch)
        except ValueError:
            self._give_back(out)
            return
        if not self.args.started:
            self.pending += text
            return
        if not was_started:
            out.append(CallStart(self.count, self.name))
            text, self.pending = self.pending + text, ""
        self.raw = ""
        out.append(Args(self.count, text))
        if self.args.done:
            out.append(CallEnd(self.count))
            self.count += 1
            self.in_list += 1
            self.state, self.args = "after", None

    def _close_list(self) -> None:
        self.state, self.raw = "text", ""

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.state == "text":
            out.append(Content(self.text.flush()))
        elif not (self.broken or self.in_list or self.args is not None and self.args.started):
            out.append(Content(self.raw))  # an unfinished list that never made a call: content
        self.state = "text"
        return self._emit(out)
