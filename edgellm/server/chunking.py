"""Sentence chunking for TTS: token deltas in, whole sentences out.

A sentence ends at terminal punctuation (. ? ! and the full-width 。？！, plus
… and any closing quotes or brackets right after it) once the next character
shows it really ended: whitespace (kept with the sentence), or anything when
the punctuation follows a Hangul syllable (Korean often runs on without a
space: "했어요.그리고") or is full-width. "3.14", "e.g." inside a sentence,
and a few common abbreviations ("Dr. Smith") do not end one. A newline always
ends a chunk. A chunk never grows past max_chars: it is cut at the last space
(or hard, when there is none). Joined chunks are exactly the input text.
"""

from __future__ import annotations

_TERMINAL = ".?!…。？！"
_FULL_WIDTH = "。？！"
_CLOSERS = "\"')]}»”’」』）"
_ABBREVIATIONS = frozenset(
    {
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "vs",
        "etc",
        "e.g",
        "i.e",
        "no",
        "fig",
        "approx",
        "inc",
        "ltd",
        "co",
    }
)


def _is_hangul(ch: str) -> bool:
    return "\uac00" <= ch <= "\ud7a3" or "\u3131" <= ch <= "\u318e"


class SentenceChunker:
    def __init__(self, max_chars: int = 200) -> None:
        if max_chars < 8:
            raise ValueError("max_chars must be >= 8")
        self.max_chars = max_chars
        self.buf = ""

    def push(self, text: str) -> list[str]:
        """Add a delta; returns the chunks that are complete now (possibly none)."""
        self.buf += text
        out: list[str] = []
        while True:
            cut = self._boundary()
            if cut is None or cut > self.max_chars:
                if len(self.buf) <= self.max_chars:
                    break
                cut = self._length_cut()
            out.append(self.buf[:cut])
            self.buf = self.buf[cut:]
        return out

    def flush(self) -> str:
        """The rest, at the end of the stream."""
        rest, self.buf = self.buf, ""
        return rest

    def _length_cut(self) -> int:
        space = self.buf.rfind(" ", 1, self.max_chars)
        return space + 1 if space > 0 else self.max_chars

    def _boundary(self) -> int | None:
        """End index (exclusive) of the first complete sentence in buf, if any."""
        buf = self.buf
        i = 0
        n = len(buf)
        while i < n:
            ch = buf[i]
            if ch == "\n":
                if buf[: i + 1].strip():
                    return i + 1
                i += 1
                continue
            if ch not in _TERMINAL:
                i += 1
                continue
            start = i
            j = i + 1
            while j < n and buf[j] in _TERMINAL:
                j += 1
            while j < n and buf[j] in _CLOSERS:
                j += 1
            if j >= n:
                return None  # the next character decides
            nxt = buf[j]
            prev = buf[start - 1] if start > 0 else ""
            if nxt.isspace():
                if not self._is_abbreviation(start):
                    return j + 1  # the whitespace that proved the end stays with the sentence
            elif _is_hangul(prev) or buf[start] in _FULL_WIDTH:
                return j
            i = j
        return None

    def _is_abbreviation(self, dot: int) -> bool:
        if self.buf[dot] != ".":
            return False
        word_start = dot
        while word_start > 0 and not self.buf[word_start - 1].isspace():
            word_start -= 1
        word = self.buf[word_start:dot].lower().lstrip("\"'([")
        return word in _ABBREVIATIONS


def is_sentence_end(chunk: str) -> bool:
    """Whether a chunk ends the way the chunker ends sentences (for tests and clients)."""
    s = chunk.rstrip(" \t")
    if s.endswith("\n"):
        return True
    s = s.rstrip()
    while s and s[-1] in _CLOSERS:
        s = s[:-1]
    return bool(s) and s[-1] in _TERMINAL
