"""Character-level pieces the family parsers share: HeldText (the text between calls, released as
content as soon as it cannot be the opening of a call) and JsonSpan (one JSON object or array read
a character at a time, to know where it ends without parsing it)."""

from __future__ import annotations


class HeldText:
    """The text outside calls, pushed a character at a time.

    A call opens at one of `tags` anywhere in the text, or at one of the `openers` characters where
    the output begins (or, with `line_start`, where any line begins), leading whitespace aside.
    push() returns (content to release now, the opening found: the tag or opener character, or
    None). Held back, and only those: trailing whitespace (dropped if an opening follows it) and a
    tail that is a proper prefix of a tag. The whitespace dropped before an opening is kept in
    `dropped`, for a parser to give back if the opening turns out not to be a call. flush() gives
    back what is held, unchanged.
    """

    def __init__(
        self, tags: tuple[str, ...] = (), openers: str = "", line_start: bool = False
    ) -> None:
        self.tags = tags
        self.openers = openers
        self.line_start = line_start
        self.hold = ""
        self.dropped = ""
        self.at_start = True  # nothing has been released or opened yet

    def push(self, ch: str) -> tuple[str, str | None]:
        hold = self.hold + ch
        for tag in self.tags:
            if hold.endswith(tag):
                before = hold[: -len(tag)]
                kept = before.rstrip()
                self.hold, self.at_start, self.dropped = "", False, before[len(kept) :]
                return kept, tag
        before = hold[:-1]
        at_opening = self.at_start or self.line_start and "\n" in before
        if ch in self.openers and not before.strip() and at_opening:
            self.hold, self.at_start, self.dropped = "", False, before
            return "", ch
        partial = 0
        for tag in self.tags:
            for n in range(min(len(tag) - 1, len(hold)), partial, -1):
                if hold.endswith(tag[:n]):
                    partial = n
                    break
        cut = len(hold) - partial
        while cut > 0 and hold[cut - 1].isspace():
            cut -= 1
        release, self.hold = hold[:cut], hold[cut:]
        if release:
            self.at_start = False
        return release, None

    def flush(self) -> str:
        rest, self.hold = self.hold, ""
        return rest


class JsonSpan:
    """One JSON object or array, a character at a time: feed() returns True on the character that
    closes it. Whitespace before it is skipped (feed returns False and `started` stays False);
    anything else before its opening bracket is a ValueError."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.in_string = False
        self.escape = False

    def feed(self, ch: str) -> bool:
        if not self.started:
            if ch.isspace():
                return False
            if ch not in "{[":
                raise ValueError(f"expected a JSON object or array, found {ch!r}")
            self.started = True
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False
