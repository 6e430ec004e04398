"""A chat choice's output text -> OpenAI tool calls: the message of a non-streamed response, and
the `delta.tool_calls` of a stream (id, type and function.name only in a call's first delta; then
arguments fragments whose concatenation is the arguments' JSON; finish_reason "tool_calls").

A call cut by max_tokens is never reported as a call: the choice ends with finish_reason "length"
and the calls completed before the cut (a stream has already sent the cut call's fragments; its
finish_reason says they are incomplete)."""

from __future__ import annotations

from typing import Any

from edgellm.tools.parsers import Args, CallStart, Content, Event, ToolCallParser
from edgellm.tools.spec import ToolPlan, call_id, parse_output


def message(plan: ToolPlan, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """The assistant message and finish_reason of a finished choice."""
    parser, calls, reason = parse_output(plan, text, finish)
    content = parser.content.strip() or None
    if not calls:
        return {"role": "assistant", "content": text}, finish
    if parser.broken or (plan.mode == "named" and finish != "stop"):
        content = text
    msg: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls}
    return msg, reason


class StreamedCalls:
    """One streamed choice's parser: feed() each text delta, finish() at the end; both return
    the delta objects to send (without role, which the caller adds to the first)."""

    def __init__(self, plan: ToolPlan) -> None:
        parser = plan.parser()
        assert parser is not None
        self.parser: ToolCallParser = parser
        self.ids: dict[int, str] = {}

    def _deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Content) and e.text:
                out.append({"content": e.text})
            elif isinstance(e, CallStart):
                self.ids[e.index] = call_id()
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": e.index,
                                "id": self.ids[e.index],
                                "type": "function",
                                "function": {"name": e.name, "arguments": ""},
                            }
                        ]
                    }
                )
            elif isinstance(e, Args) and e.text:
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self.parser.feed(text)) if text else []

    def finish(self, finish: str) -> tuple[list[dict[str, Any]], str]:
        deltas = self._deltas(self.parser.finish()) if finish == "stop" else []
        reason = "tool_calls" if self.parser.calls and finish == "stop" else finish
        return deltas, reason
