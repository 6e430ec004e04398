"""Feeding tool-call parsers text the way a stream arrives: token by token, in chunks, whole."""

from __future__ import annotations


def pieces(tok, text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    ids = tok.encode(text, add_special_tokens=False)
    step = 1 if how == "tokens" else 3
    out, done = [], ""
    for i in range(step, len(ids) + step, step):
        now = tok.decode(ids[:i])
        if now.endswith("\ufffd") and i < len(ids):
            continue  # part of a multi-byte character: the detokenizer holds it back too
        out.append(now[len(done) :])
        done = now
    assert "".join(out) == text
    return out


def run(parser, chunks):
    events = []
    for c in chunks:
        events += parser.feed(c)
    events += parser.finish()
    return events
