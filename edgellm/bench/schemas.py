"""Random JSON schemas for the structured-output tests and benchmarks/structured_outputs.py:
nested objects, arrays, enums, required fields, numbers with bounds. Strings and arrays are
bounded, so that a valid output always fits in a test's token budget."""

from __future__ import annotations

import random
from typing import Any

WORDS = [
    "id",
    "name",
    "city",
    "count",
    "price",
    "tags",
    "open",
    "kind",
    "note",
    "level",
    "items",
    "score",
]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "null"])
    if kind == "string":
        s: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 12)}
        if rng.random() < 0.3:
            s["minLength"] = 1
        return s
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "number":
        lo = round(rng.uniform(-10, 10), 2)
        return {"type": "number", "minimum": lo, "maximum": lo + round(rng.uniform(0.5, 100), 2)}
    if kind == "enum":
        return {
            "enum": rng.sample(
                ["red", "green", "blue", "서울", 'say "hi"', 7, True], rng.randint(1, 4)
            )
        }
    return {"type": kind}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4))
    props: dict[str, Any] = {}
    for name in names:
        r = rng.random()
        if r < 0.2 and depth < 2:
            props[name] = random_schema(rng, depth + 1)
        elif r < 0.4 and depth < 2:
            item = random_schema(rng, depth + 1) if rng.random() < 0.3 else _leaf(rng)
            props[name] = {
                "type": "array",
                "items": item,
                "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3),
            }
        else:
            props[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def schemas(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
