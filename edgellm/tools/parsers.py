"""Tool-call output parsers: state machines fed the output text as it is detokenized (one token's
text or several at a time), emitting OpenAI-shaped events as soon as each piece is certain.

Events: Content(text) for text outside any call, CallStart(index, name) when a call's function name
is complete, Args(index, text) for fragments of its arguments (their concatenation is the
arguments' JSON text, exactly as the model wrote it), CallEnd(index). Nothing is re-parsed or
diffed: each character is consumed once. Text that could still turn out to be the start of a call
(a partial `<tool_call>`, whitespace before it) is held back until it is known to be content.

Formats here (the model families' own are chosen by name in families.PARSERS: hermes, and
llama3_json, mistral and pythonic in parser_llama3.py, parser_mistral.py, parser_pythonic.py):
  hermes     Hermes / Qwen2.5 / the generic tool prompt: <tool_call>{"name": .., "arguments":
  {..}}</tool_call>
  json_array the output of tool_choice "required": [{"name": .., "arguments": {..}}, ...]
  arguments  the output of a named tool_choice: the arguments object itself (the name is known)
"""

from __future__ import annotations

from edgellm.tools.call_object import CallObject
from edgellm.tools.events import Args, CallEnd, CallStart, Content, Event

__all__ = [
    "Args",
    "ArgumentsParser",
    "CallEnd",
    "CallStart",
    "Content",
    "Event",
    "HermesParser",
    "JsonArrayParser",
    "ToolCallParser",
]


class ToolCallParser:
    """Base: feed() text as it arrives, finish() at the end; `calls` holds the completed calls.

    `special_tokens`: the format's markers are special tokens of the models that write it, so
    their output is decoded with special tokens kept (skip_special_tokens false) while tools are
    on; the stop token's own text is left out of the output either way
    (engine/step_output.append_token)."""

    special_tokens = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (name, arguments JSON text) of completed calls
        self._args: dict[int, str] = {}
        self._names: dict[int, str] = {}
        self.content = ""  # all content emitted
        self.broken = False  # the text stopped following the format; the rest is content

    def _track(self, events: list[Event]) -> list[Event]:
        for e in events:
            if isinstance(e, CallStart):
                self._names[e.index] = e.name
                self._args[e.index] = ""
            elif isinstance(e, Args):
                self._args[e.index] += e.text
            elif isinstance(e, CallEnd):
                self.calls.append((self._names[e.index], self._args[e.index]))
            elif isinstance(e, Content):
                self.content += e.text
        return events

    def _emit(self, out: list[Event]) -> list[Event]:
        """The events of one feed(): adjacent Content, and adjacent Args of one call, merged."""
        merged: list[Event] = []
        for e in out:
            last = merged[-1] if merged else None
            if isinstance(e, Content) and isinstance(last, Content):
                merged[-1] = Content(last.text + e.text)
            elif isinstance(e, Args) and isinstance(last, Args) and last.index == e.index:
                merged[-1] = Args(e.index, last.text + e.text)
            elif not (isinstance(e, Content | Args) and not e.text):
                merged.append(e)
        return self._track(merged)

    def feed(self, text: str) -> list[Event]:
        """The events of `text` (each character consumed once, by _char)."""
        out: list[Event] = []
        for ch in text:
            self._char(ch, out)
        return self._emit(out)

    def _char(self, ch: str, out: list[Event]) -> None:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        return []

    @property
    def open_call(self) -> bool:
        """A call was started and not completed (the output was cut)."""
        return len(self._names) > len(self.calls)


class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "text"  # text | call | close
        self.hold = ""
        self.call: CallObject | None = None
        self.count = 0
        self.raw = ""  # the current call's raw text, given back as content if it breaks

    def _char(self, ch: str, out: list[Event]) -> None:
        if self.state == "text" or self.broken:
            self.hold += ch
            if self.broken:
                out.append(Content(self.hold))
                self.hold = ""
                return
            stripped = self.hold.lstrip()
            if stripped.startswith(self.OPEN):
                self.hold, self.state, self.raw = "", "call", self.OPEN
                self.call = CallObject(self.count)
            elif not stripped or self.OPEN.startswith(stripped):
                return  # whitespace or a partial tag: wait
            else:
                cut = self.hold.rfind("<")
                if cut > 0 and self.OPEN.startswith(self.hold[cut:]):
                    out.append(Content(self.hold[:cut]))
                    self.hold = self.hold[cut:]
                else:
                    out.append(Content(self.hold))
                    self.hold = ""
            return
        if self.state == "call":
            self.raw += ch
            try:
                self.call.feed(ch, out)  # type: ignore[union-attr]
            except ValueError:
                self._break(out)
                return
            if self.call.done:  # type: ignore[union-attr]
                self.count += 1
                self.state, self.hold = "close", ""
            return
        self.hold += ch  # state close: whitespace then </tool_call>
        stripped = self.hold.lstrip()
        if stripped == self.CLOSE:
            self.state, self.hold = "text", ""
        elif stripped and not self.CLOSE.startswith(stripped):
            self.state = "text"  # no closing tag: carry on as text
            rest, self.hold = self.hold, ""
            for c in rest:
                self._char(c, out)

    def _break(self, out: list[Event]) -> None:
        self.broken = True
        if self.call is not None and not self.call.started:
            out.append(Content(self.raw))

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.state == "text" and self.hold.strip():
            out.append(Content(self.hold))
        self.hold = ""
        return self._track(out)


class JsonArrayParser(ToolCallParser):
    """tool_choice "required": the grammar makes the text [{"name": .., "arguments": ..}, ...]."""

    def __init__(self) -> None:
        super().__init__()
        self.call: CallObject | None = None
        self.count = 0
        self.opened = False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for ch in text:
            if self.call is not None:
                self.call.feed(ch, out)
                if self.call.done:
                    self.call = None
                    self.count += 1
            elif ch == "[" and not self.opened:
                self.opened = True
            elif ch == "{":
                self.call = CallObject(self.count)
                self.call.feed(ch, out)
        return self._track(out)


class ArgumentsParser(ToolCallParser):
    """A named tool_choice: the whole output is the arguments of that one function."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.started = False
        self.text = ""

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if not self.started:
            out.append(CallStart(0, self.name))
            self.started = True
        if text:
            out.append(Args(0, text))
            self.text += text
        return self._track(out)

    def finish(self, complete: bool = True) -> list[Event]:
        out: list[Event] = [] if self.started else [CallStart(0, self.name)]
        self.started = True
        out.append(CallEnd(0))
        return self._track(out)
