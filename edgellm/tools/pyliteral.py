"""Python keyword arguments -> the JSON object text of their values, a character at a time: what
a pythonic tool call `f(city="Seoul", days=3, tags=["a"], opts={"x": None})` means as OpenAI
arguments.

KwargsToJson is fed the text after the call's "(" and returns JSON fragments as soon as each is
certain; their concatenation is json.dumps(dict of the keyword values, ensure_ascii=False) (", " and
": " separators). Values are Python literals: strings in either quote with Python's escapes (no
triple quotes, no prefixes), ints and floats (signs, exponents, underscores, hex), True / False /
None, lists, and dicts (string, number, True / False / None keys, written as JSON writes them).
Anything else (positional arguments, names, calls, tuples, sets, comments) is a ValueError.
"""

from __future__ import annotations

import ast
import codecs
import json
import math
import re

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_WORD_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+-")
_WORDS = {"True": "true", "False": "false", "None": "null"}
_OCTAL = set("01234567")
_HEX = set("0123456789abcdefABCDEF")


def _literal_json(word: str) -> str:
    """A bare word in a value position (a number, True, False or None) as JSON text."""
    if word in _WORDS:
        return _WORDS[word]
    if not word[0].isdigit() and not (word[0] in "+-." and len(word) > 1):
        raise ValueError(f"not a literal: {word!r}")
    try:
        value = ast.literal_eval(word)
    except (ValueError, SyntaxError):
        raise ValueError(f"not a number: {word!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a JSON number: {word!r}")
    return json.dumps(value)


class _Frame:
    """One open container: the call's keyword arguments ("kw"), a list or a dict."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.items = 0  # elements (keyword arguments, items, entries) begun so far
        # what comes next: "key" (or the close), "eq" / "colon", "value", "sep" (a comma or the
        # close)
        self.expect = "key" if kind != "list" else "value"


class KwargsToJson:
    def __init__(self) -> None:
        self.stack = [_Frame("kw")]
        self.word = ""
        self.quote = ""  # inside a string: its quote character
        self.escape = ""  # inside a string: the escape sequence read so far
        self.started = False  # a keyword argument's "name=" was read, or the call closed
        self.done = False

    def feed(self, ch: str) -> str:
        """JSON text that this character makes certain (often ""); ValueError where the text stops
        being keyword arguments of literals. After the call's closing ")", `done` is True."""
        if self.done:
            raise ValueError("the call is already closed")
        if self.quote:
            return self._string_char(ch)
        out = ""
        if self.word:
            if ch in _WORD_CHARS:
                self.word += ch
                return ""
            out = self._word_done()
        return out + self._char(ch)

    def _begin_element(self, frame: _Frame) -> str:
        frame.items += 1
        if frame.kind == "kw":
            return "{" if frame.items == 1 else ", "
        return "" if frame.items == 1 else ", "

    def _word_done(self) -> str:
        word, self.word = self.word, ""
        frame = self.stack[-1]
        if frame.expect == "key" and frame.kind == "kw":
            if not _IDENT.match(word) or word in _WORDS:
                raise ValueError(f"expected a keyword argument, found {word!r}")
            frame.expect = "eq"
            return self._begin_element(frame) + json.dumps(word)
        if frame.expect == "key":  # a dict key: JSON keys are strings
            frame.expect = "colon"
            return self._begin_element(frame) + json.dumps(_literal_json(word))
        if frame.expect == "value":
            frame.expect = "sep"
            prefix = self._begin_element(frame) if frame.kind == "list" else ""
            return prefix + _literal_json(word)
        raise ValueError(f"unexpected {word!r}")

    def _char(self, ch: str) -> str:
        frame = self.stack[-1]
        if ch.isspace():
            return ""
        if ch in _WORD_CHARS and frame.expect in ("key", "value"):
            self.word = ch
            return ""
        dict_key = frame.expect == "key" and frame.kind == "dict"
        if ch in "'\"" and (frame.expect == "value" or dict_key):
            if dict_key:
                prefix, frame.expect = self._begin_element(frame), "colon"
            else:
                prefix = self._begin_element(frame) if frame.kind == "list" else ""
                frame.expect = "sep"
            self.quote = ch
            return prefix + '"'
        if frame.expect == "eq" and ch == "=" or frame.expect == "colon" and ch == ":":
            frame.expect = "value"
            self.started = True
            return ": "
        if frame.expect == "value" and ch in "[{":
            prefix = self._begin_element(frame) if frame.kind == "list" else ""
            frame.expect = "sep"
            self.stack.append(_Frame("list" if ch == "[" else "dict"))
            return prefix + ch
        if ch == "," and frame.expect == "sep":
            frame.expect = "key" if frame.kind != "list" else "value"
            return ""
        closer = {"kw": ")", "list": "]", "dict": "}"}[frame.kind]
        # closable: after an element, empty, or after a trailing comma (Python allows one)
        empty_or_comma = "value" if frame.kind == "list" else "key"
        if ch == closer and frame.expect in ("sep", empty_or_comma):
            self.stack.pop()
            if frame.kind == "kw":
                self.done = self.started = True
                return "{}" if frame.items == 0 else "}"
            return ch
        raise ValueError(f"unexpected {ch!r} in keyword arguments")

    def _string_char(self, ch: str) -> str:
        if self.escape:
            self.escape += ch
            text, reread = self._escape_step()
            return text + self._string_char(ch) if reread else text
        if ch == "\\":
            self.escape = ch
            return ""
        if ch == self.quote:
            self.quote = ""
            return '"'
        if ch == "\n":
            raise ValueError("a newline inside a one-line string")
        return json.dumps(ch, ensure_ascii=False)[1:-1]

    def _escape_step(self) -> tuple[str, bool]:
        """(the JSON text of the escape once complete, else ""; whether the last character is not
        part of it: a shorter octal escape ended before it, and it is read again)."""
        esc = self.escape
        kind = esc[1]
        if kind in _OCTAL:
            if esc[-1] not in _OCTAL:
                self.escape = esc[:-1]
                return self._decode_escape(), True
            return ("", False) if len(esc) < 4 else (self._decode_escape(), False)
        if kind in "xuU":
            if len(esc) > 2 and esc[-1] not in _HEX:
                raise ValueError(f"bad escape {esc!r}")
            if len(esc) < 2 + {"x": 2, "u": 4, "U": 8}[kind]:
                return "", False
        elif kind == "N" and not esc.endswith("}"):
            if len(esc) > 80:
                raise ValueError("an unterminated \\N{...} escape")
            return "", False
        return self._decode_escape(), False

    def _decode_escape(self) -> str:
        esc, self.escape = self.escape, ""
        if esc == "\\\n":
            return ""  # a line continuation
        if not esc.isascii():
            text = esc  # not an escape Python knows: the backslash stays
        else:
            try:
                text = codecs.decode(esc, "unicode_escape")
            except UnicodeDecodeError:
                raise ValueError(f"bad escape {esc!r}") from None
        return json.dumps(text, ensure_ascii=False)[1:-1]
