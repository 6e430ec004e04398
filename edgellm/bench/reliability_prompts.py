"""The conversation material of the reliability scripts (benchmarks/abort_storm.py, overload.py,
soak.py): the voice assistant's system prompt, the topics and words their questions are made of,
and the chat completions body they send (greedy, streamed unless told otherwise).
"""

from __future__ import annotations

from typing import Any

SYSTEM = (
    "You are a friendly voice assistant for a travel company. Answer in two or three short spoken "
    "sentences, without lists or markdown."
)
TOPICS = [
    "Iceland",
    "Lisbon",
    "Kyoto",
    "Rome",
    "Peru",
    "the aurora",
    "Japan",
    "New York",
    "Greek islands",
    "Canada",
    "Seoul",
    "Scotland",
    "Oslo",
    "Prague",
    "snorkeling",
    "Bali",
    "Cairo",
    "Patagonia",
    "Vienna",
    "Hanoi",
    "Marrakesh",
    "Sydney",
    "Lapland",
    "Havana",
]
WORDS = [
    "river",
    "mountain",
    "coffee",
    "window",
    "lantern",
    "harbor",
    "garden",
    "violin",
    "market",
    "winter",
    "summer",
    "rocket",
    "pencil",
    "forest",
    "desert",
    "island",
    "bridge",
    "castle",
    "meadow",
    "thunder",
    "silver",
    "copper",
    "velvet",
    "marble",
    "candle",
    "ladder",
    "anchor",
    "falcon",
    "orchard",
    "glacier",
    "canyon",
    "prairie",
    "compass",
    "meteor",
    "saddle",
    "tunnel",
    "beacon",
]


def chat_body(
    model: str,
    question: str,
    max_tokens: int,
    *,
    stream: bool = True,
    system: str | None = SYSTEM,
    **extra: Any,
) -> dict[str, Any]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    return {
        "model": model,
        "messages": msgs,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **extra,
    }
