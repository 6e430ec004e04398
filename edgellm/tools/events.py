"""The events a tool-call parser emits (see parsers.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class Args:
    index: int
    text: str


@dataclass
class CallEnd:
    index: int


Event = Content | CallStart | Args | CallEnd
